"""The pipeline on a real multi-node Ray cluster of containers, and a worker node preempted mid-run.

Opt in: these tests are marked ``cluster`` and are skipped (by design, see ``tests/conftest.py``)
unless RUN_CLUSTER_TESTS=1, which `make test-cluster` sets after `make image`. They need Docker
and the image ``<project>:<lock hash>`` (``CLUSTER_IMAGE`` overrides the tag); `make test` (CI)
and `make test-fast` never run them.

The cluster (tests/support/cluster.py), one Docker network, one image, no bind mount and no
shared volume: moto's S3 server, a Prefect server, a Ray head with ``--num-cpus=0`` and two Ray
workers with one CPU each, token authentication on. The driver runs on the head
(``docker exec``: `python -m flows.mnist --ray.address auto`), every artifact goes to
``s3://`` on moto, and the stages' task runs report to the Prefect server by its container name.

* the cluster: three alive nodes, two CPUs, all on token auth, a driver without the token refused;
* the small-model pipeline on it, training on both workers (two ranks on two nodes, SPREAD), with
  worker-2 sent SIGTERM while training is held in epoch 1 (``ray start``'s handler marks the node
  draining with reason PREEMPTION, as a spot reclaim or a Kubernetes drain does): the workers see
  it through ``ray.train.get_preemption_info``, save a mid-epoch checkpoint to S3 at once, Ray
  Train restarts on the preemption budget (not ``max_failures``) with the one worker left
  (``train.min_workers=1``) from that checkpoint, and the run completes, evaluates and promotes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid

import pytest

from tests.support.cluster import DRAIN_S, DockerCluster, default_image, docker
from tests.support.models import SMALL_MODEL_ARGS, pause_env
from training.worker.faults import FAULT_ENV

pytestmark = pytest.mark.cluster

BUCKET = "cluster"
ROOT_URI = f"s3://{BUCKET}/mnist"
RUN_TIMEOUT_S = 900


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, request):
    if shutil.which("docker") is None or docker("info", check=False).returncode != 0:
        pytest.fail("the cluster test needs a running Docker engine (`dockerd`)")
    image = os.environ.get("CLUSTER_IMAGE") or default_image()
    if docker("image", "inspect", image, check=False).returncode != 0:
        pytest.fail(f"no image {image}: run `make image` first")
    started = time.monotonic()
    cluster = DockerCluster(image).up()
    print(f"cluster up in {time.monotonic() - started:.1f}s: {cluster.prefix}")
    cluster.s3_client().create_bucket(Bucket=BUCKET)
    try:
        yield cluster
    finally:
        if request.session.testsfailed:
            folder = tmp_path_factory.mktemp("cluster-logs")
            cluster.dump_logs(folder)
            print(f"cluster logs: {folder}")
        cluster.down()


def s3_keys(cluster: DockerCluster, prefix: str) -> list[str]:
    pages = cluster.s3_client().get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return sorted(item["Key"] for page in pages for item in page.get("Contents", []))


def s3_json(cluster: DockerCluster, key: str):
    return json.loads(cluster.s3_client().get_object(Bucket=BUCKET, Key=key)["Body"].read())


def s3_lines(cluster: DockerCluster, key: str) -> list[dict]:
    body = cluster.s3_client().get_object(Bucket=BUCKET, Key=key)["Body"].read().decode()
    return [json.loads(line) for line in body.splitlines() if line.strip()]


def test_cluster_has_two_one_cpu_workers_behind_token_auth(cluster):
    nodes = [n for n in cluster.nodes() if n["Alive"]]
    by_host = {n["NodeManagerHostname"]: n["Resources"].get("CPU", 0.0) for n in nodes}
    assert by_host == {"head": 0.0, "worker-1": 1.0, "worker-2": 1.0}, by_host
    status = cluster.exec("head", ["ray", "status"]).stdout
    assert "2.0 CPU" in status or "0.0/2.0 CPU" in status, status
    # A driver with another token is refused by the cluster.
    refused = cluster.exec(
        "worker-1", ["python", "-c", "import ray; ray.init(address='head:6379'); print('joined')"],
        env={"RAY_AUTH_TOKEN": "0" * 64}, check=False, timeout=180,
    )
    assert refused.returncode != 0 and "joined" not in refused.stdout, refused.stdout + refused.stderr
    assert "InvalidAuthToken" in refused.stderr, refused.stderr[-3000:]


def test_pipeline_on_the_cluster_survives_a_preempted_worker(cluster, tmp_path):
    run = f"cluster-{uuid.uuid4().hex[:6]}"
    run_dir = f"mnist/runs/{run}"
    command = [
        "python", "-m", "flows.mnist", "--preset", "smoke", *SMALL_MODEL_ARGS,
        "--storage-root", ROOT_URI, "--ray.address", "auto", "--run-name", run,
        "--train.epochs", "3", "--train.num-workers", "2", "--train.min-workers", "1", "--train.placement", "SPREAD",
        "--train.preemption-check-steps", "2", "--train.preemption-check-s", "0",  # every 2 steps throughout: the drain comes in epoch 1
        "--train.stage-retry-delay-s", "1", "--evaluate.min-accuracy", "0",
        "--json",
    ]
    # Rank 0 holds at step 4 of epoch 1 (the test preempts worker-2 there), and again at step 10,
    # after the just-in-time checkpoint, so the node goes while training is surely inside epoch 1.
    holds = f"{pause_env(epoch=1, step=4)[FAULT_ENV]};{pause_env(epoch=1, step=10)[FAULT_ENV]}"
    out_path, err_path = tmp_path / "driver.out", tmp_path / "driver.err"
    started = time.monotonic()
    with open(out_path, "w") as out, open(err_path, "w") as err:
        driver = subprocess.Popen(["docker", "exec", "-e", f"{FAULT_ENV}={holds}", cluster.container("head"), *command],
                                  stdout=out, stderr=err, text=True)

    def pauses() -> list[str]:
        return sorted(k for k in s3_keys(cluster, f"{run_dir}/faults/") if k.endswith(".fired"))

    def release(marker: str) -> None:
        cluster.s3_client().put_object(Bucket=BUCKET, Key=marker.removesuffix(".fired") + ".release", Body=b"released\n")

    try:
        # 1. Training runs on both workers, one rank on each, and is held in epoch 1.
        cluster.wait(lambda: pauses() or driver.poll() is not None, 600, "training to pause in epoch 1")
        assert driver.poll() is None, err_path.read_text()[-4000:]
        first = pauses()
        print(f"paused after {time.monotonic() - started:.0f}s: {first}")
        attempts = s3_lines(cluster, f"{run_dir}/train_attempts.jsonl")
        assert attempts[0] | {"world_size": 2, "local_world_size": 1} == attempts[0], attempts  # two ranks, two nodes

        # 2. Preempt worker-2: SIGTERM to its `ray start` (the container's init passes it on). A
        # replacement node joins, as an autoscaler's would: a fresh filesystem with nothing of the run.
        preempted_id = cluster.node_ids()["worker-2"]
        docker("kill", "--signal", "TERM", cluster.container("worker-2"))
        cluster.start_worker("worker-3")
        cluster.wait(lambda: preempted_id in draining_nodes(cluster), 30, "worker-2 to be draining", interval_s=0.5)
        time.sleep(2)  # Ray Train's preemption watcher polls every second (RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S=1)
        release(first[0])
        second = cluster.wait(lambda: [m for m in pauses() if m not in first], 60, "the second hold at step 10")
        cluster.wait(lambda: not cluster.running("worker-2"), DRAIN_S + 60, "worker-2 to stop after its drain")
        print(f"worker-2 gone after {time.monotonic() - started:.0f}s")
        release(second[0])

        # 3. The run finishes on worker-1 and the replacement.
        driver.wait(timeout=RUN_TIMEOUT_S)
    finally:
        if driver.poll() is None:
            driver.kill()
    out, err = out_path.read_text(), err_path.read_text()
    print(f"run finished after {time.monotonic() - started:.0f}s, exit {driver.returncode}")
    assert driver.returncode == 0, f"{out[-3000:]}\n{err[-6000:]}"

    summary = s3_json(cluster, f"{run_dir}/summary.json")
    assert summary["status"] == "completed", summary
    attempts = summary["training_attempts"]
    # The restart resumed from the just-in-time checkpoint: mid-epoch 1 after step 6 (the check at
    # step 5 saw the preemption; no periodic mid-epoch checkpoints are configured), on two nodes again.
    assert [(a["start_epoch"], a["start_step"], a["world_size"]) for a in attempts] == [(0, 0, 2), (1, 6, 2)], attempts
    assert attempts[1]["local_world_size"] == 1, attempts
    assert summary["resumed_from_epoch"] == 1
    # The training stage and Ray Train's controller ran on the head (runner.stages.stage_options),
    # not on the preempted node: one controller for the whole run.
    code = ("import json, ray; from ray.util.state import list_actors; ray.init(address='auto', logging_level='ERROR'); "
            "print(json.dumps([a.node_id for a in list_actors(filters=[('class_name', '=', 'TrainController')], limit=100)]))")
    controllers = json.loads(cluster.python("head", code).strip().splitlines()[-1])
    assert controllers == [cluster.node_ids()["head"]], controllers
    # Ray Train charged the restart to the preemption budget, not max_failures.
    controller_logs = cluster.exec("head", ["sh", "-c", "cat /tmp/ray/session_latest/logs/train/*.log 2>/dev/null || true"]).stdout
    assert "Source: preemption" in controller_logs, controller_logs[-3000:]
    assert "Source: worker group" not in controller_logs, controller_logs[-3000:]
    # Every stage's task run reported to the Prefect server by its container name.
    import httpx

    flow_runs = httpx.post(f"{cluster.prefect_api}/flow_runs/filter", json={"flow_runs": {"name": {"any_": [run]}}}, timeout=30).json()
    assert [r["state_type"] for r in flow_runs] == ["COMPLETED"], flow_runs
    tasks = httpx.post(f"{cluster.prefect_api}/task_runs/filter",
                       json={"flow_runs": {"id": {"any_": [flow_runs[0]["id"]]}}}, timeout=30).json()
    completed = {t["name"].rsplit("-", 1)[0] for t in tasks if t["state_type"] == "COMPLETED"}
    assert {"download", "to-parquet", "transform", "train", "evaluate", "cleanup"} <= completed, completed
    # Evaluated from the checkpoint on the bucket: nothing depended on a node's disk.
    assert summary["test_accuracy"] > 0.5 and summary["best_checkpoint"].startswith(f"{ROOT_URI}/runs/{run}/"), summary


def draining_nodes(cluster: DockerCluster) -> dict:
    code = ("import json, ray; ray.init(address='auto', logging_level='ERROR'); "
            "print(json.dumps(ray._private.state.state.get_draining_nodes()))")
    return json.loads(cluster.python("head", code).strip().splitlines()[-1])
