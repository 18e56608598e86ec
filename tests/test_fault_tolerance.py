"""Fault tolerance: the test-only fault hook, which failures are retried, and real flow runs under faults.

The slow tests run the real CLI (a file:// mirror of 600 real digits from the bundled sample, the
small model: they prove recovery, not the network) against the session's Prefect server
(``shared_server``: recovery is not about starting one) with faults injected through
``MNIST_FAULT_INJECT``. The stall runs on the session's Ray cluster (``shared_ray``), as a
deployment's runs do: the job's runtime env hands the fault to Ray Train's workers there, and the
test asserts it fired (the stalled rank named). The others keep a Ray of their own: the worker
kills' two runs are about overlapping, which on one cluster they would not (runs there take turns;
the test says why), the killed driver's test is about its local Ray going with it, and a node loss
needs a cluster whose node the test can take away.

* worker kills: one Ray Train restarts (``max_failures``), one more exhausts it and Prefect's
  retry of the training stage resumes the same run from its latest checkpoint;
* a stalled worker: the run fails within ``train.hang_timeout_s`` with the rank named;
* exactly-once mid-epoch resumption and a killed driver, in one run: kills between mid-epoch
  checkpoints, then the driver killed mid-training (held there by the test-only pause), then the
  same run name again on a different number of workers: finished stages skipped after
  verification, training resumed from the last checkpoint, and the row_ids every rank trained on
  (``MNIST_RECORD_ROWS``) add up to the training set once per epoch;
* node loss on a real two-node cluster, while training is held paused.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from ray.exceptions import ActorDiedError
from ray.train import WorkerGroupError

from tests.support.digits import real_digits_mirror
from tests.support.mlflow_server import MlflowServer
from tests.support.models import SMALL_MODEL_ARGS, faults_dir, pause_env, wait_for_pause
from tests.support.prefect_server import api_env
from tests.support.ray_cluster import SharedRay, join_env
from training.checkpoint.records import HISTORY_FILE, read_history
from training.failures import is_infrastructure_failure
from training.worker.faults import FAULT_ENV, ROW_LOG_ENV, Fault, FaultInjector, parse_faults, paused

ROOT = Path(__file__).resolve().parent.parent


def test_fault_spec_parses_and_rejects_bad_parts():
    faults = parse_faults("kill:rank=1:epoch=0:step=12; stall:step=3")
    assert faults == [Fault("kill", rank=1, epoch=0, step=12), Fault("stall", rank=0, epoch=None, step=3)]
    assert faults[1].matches(0, 5, 3) and not faults[1].matches(1, 5, 3) and not faults[0].matches(1, 1, 12)
    assert parse_faults(None) == [] and parse_faults("") == []
    with pytest.raises(ValueError, match="unknown action 'explode'"):
        parse_faults("explode:rank=1")
    with pytest.raises(ValueError, match="cannot parse 'rank=x'"):
        parse_faults("kill:rank=x")


def test_kill_fires_once_per_run(tmp_path):
    """The first matching step SIGKILLs the process; the restarted attempt finds the marker and runs on."""
    code = (
        "import sys; from training.worker.faults import FaultInjector; "
        f"FaultInjector({str(tmp_path / 'faults')!r}, rank=1, spec='kill:rank=1:epoch=0:step=2').check(0, 2); "
        "print('survived')"
    )
    first = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert first.returncode == -signal.SIGKILL and "survived" not in first.stdout
    assert len(list((tmp_path / "faults").glob("*.fired"))) == 1
    second = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert second.returncode == 0 and "survived" in second.stdout


def test_injector_is_off_without_the_environment_variable(tmp_path, monkeypatch):
    monkeypatch.delenv("MNIST_FAULT_INJECT", raising=False)
    injector = FaultInjector(tmp_path, rank=0)
    assert not injector
    injector.check(0, 0)  # nothing happens
    assert not (tmp_path / "faults").exists()


def test_fault_hook_is_not_a_config_field():
    """The UI form is the config schema: nothing in it can inject faults."""
    from pipeline_config import PipelineConfig

    schema = PipelineConfig.model_json_schema()
    sections = [schema, *schema["$defs"].values()]
    names = {name.lower() for section in sections for name in section.get("properties", {})}
    assert names and not any("fault" in name or "inject" in name for name in names)
    assert "inject" not in json.dumps(schema).lower()


def test_only_infrastructure_failures_are_retried():
    lost = WorkerGroupError("rank 1 died", {1: ActorDiedError(), 0: RuntimeError("Connection closed by peer [127.0.0.1]:1234")})
    bug = WorkerGroupError("every rank raised", {0: ValueError("bad shape"), 1: ValueError("bad shape")})
    assert is_infrastructure_failure(lost)
    assert not is_infrastructure_failure(bug)
    assert not is_infrastructure_failure(ValueError("train.epochs must be positive"))
    try:
        try:
            raise ActorDiedError()
        except ActorDiedError as inner:
            raise RuntimeError("Ray Train run failed") from inner
    except RuntimeError as wrapped:
        assert is_infrastructure_failure(wrapped)


# ---------------------------------------------------------------------------------------------
# Real runs (slow)

COMMON = [
    *SMALL_MODEL_ARGS, "--train.num-workers", "2", "--train.epochs", "3", "--train.global-batch-size", "64",
    "--train.stage-retry-delay-s", "1", "--evaluate.min-accuracy", "0",
]


@pytest.fixture(scope="module")
def mirror_flags(tmp_path_factory) -> list[str]:
    return real_digits_mirror(tmp_path_factory.mktemp("mirror"), train_per_class=60, test_per_class=20)


def hooks(faults: str | None = None, record_rows: bool = False, tracking: str | None = None) -> dict[str, str]:
    """The test-only environment: ``faults`` (``MNIST_FAULT_INJECT``) and the row log (``MNIST_RECORD_ROWS``);
    ``tracking``: an MLflow server's address (``MLFLOW_TRACKING_URI``, how a user turns tracking on)."""
    return {**({FAULT_ENV: faults} if faults else {}), **({ROW_LOG_ENV: "1"} if record_rows else {}),
            **({"MLFLOW_TRACKING_URI": tracking} if tracking else {})}


def start_cli(
    args: list[str], storage: Path, api: str, faults: str | None = None, record_rows: bool = False, tracking: str | None = None,
    ray: SharedRay | None = None,
) -> tuple[subprocess.Popen, Path]:
    """``python -m flows.mnist`` against the Prefect API ``api`` (the session's shared server), started; (process, log prefix).
    ``ray``: the Ray cluster it joins (default: a local Ray of its own).

    Its output goes to files, not pipes: a run started beside another must never block on a full pipe.
    """
    name = args[args.index("--run-name") + 1]
    log = storage.parent / f"{name}-{time.monotonic_ns()}"
    with open(f"{log}.out", "w") as out, open(f"{log}.err", "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "flows.mnist", "--storage-root", str(storage), *args],
            cwd=ROOT, env=api_env(api, **hooks(faults, record_rows, tracking), **(join_env(ray) if ray else {})),
            stdout=out, stderr=err, text=True,
            start_new_session=True,
        )
    return proc, log


def finish_cli(started: tuple[subprocess.Popen, Path], storage: Path, name: str, timeout: float = 900) -> tuple[subprocess.CompletedProcess, dict]:
    """Wait for a run `start_cli` started; (its exit code and output, its summary.json or {})."""
    proc, log = started
    try:
        proc.wait(timeout=timeout)
    finally:
        stop_cli(started)
    out = subprocess.CompletedProcess(proc.args, proc.returncode, Path(f"{log}.out").read_text(), Path(f"{log}.err").read_text())
    summary_path = storage / "runs" / name / "summary.json"
    return out, json.loads(summary_path.read_text()) if summary_path.is_file() else {}


def stop_cli(started: tuple[subprocess.Popen, Path]) -> None:
    """SIGKILL a run `start_cli` started, with its process group (its local Ray), if it is still running."""
    proc, _ = started
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)


def run_cli(
    args: list[str], storage: Path, api: str, faults: str | None = None, timeout: float = 900, record_rows: bool = False,
    tracking: str | None = None, ray: SharedRay | None = None,
) -> tuple[subprocess.CompletedProcess, dict]:
    """``python -m flows.mnist`` to its end against the Prefect API ``api`` (the session's shared server);
    ``ray``: the Ray cluster it joins (default: a local Ray of its own)."""
    name = args[args.index("--run-name") + 1]
    return finish_cli(start_cli(args, storage, api, faults, record_rows, tracking, ray), storage, name, timeout)


@pytest.mark.slow
@pytest.mark.spine
def test_worker_kills_are_recovered_by_ray_train_then_by_prefect_retry(tmp_path, mirror_flags, shared_server, mlflow_server):
    """Both runs are tracked in MLflow. The interrupted one keeps one MLflow run with one point per
    epoch through a worker restart and a Prefect retry, and its promoted model is the registered
    model's champion; the reference run loses its MLflow server mid-training and completes anyway.
    Each run starts a local Ray of its own, not the session's cluster (``shared_ray``): runs on one
    cluster take turns (`runner.cluster.cluster_slot`; tests/test_shared_cluster.py), so there the reference
    run would end before the killed one began, and the killed run would never wait on the other's
    dataset build. (Before the turns, the two runs deadlocked on the
    session's 2-CPU cluster: each sized its training placement group from the cluster's CPUs as if it
    had the cluster alone, both groups were placed, and neither run's Ray Data tasks could start.)
    The fault reaching Ray Train's workers of a joined cluster is the stalled-worker test's."""
    storage = tmp_path / "storage"
    outage = MlflowServer(tmp_path / "mlflow-outage").start()
    # The uninterrupted reference run with the same seed, started first and running beside the
    # interrupted one on the same root (one builds the dataset, the other waits for it and reuses it).
    # It promotes nothing, so the champion is the interrupted run's.
    calm = start_cli([*mirror_flags, *COMMON, "--run-name", "calm", "--no-promote.enabled"], storage, shared_server.api,
                     tracking=outage.uri)
    try:
        # First kill: Ray Train restarts the worker group (max_failures=1). Second kill: Ray Train gives
        # up, Prefect retries the stage, and fit() resumes the same run from its epoch-1 checkpoint.
        faults = "kill:rank=1:epoch=1:step=2;kill:rank=0:epoch=2:step=2"
        args = [*mirror_flags, *COMMON, "--run-name", "kills", "--train.max-failures", "1", "--train.stage-retries", "1"]
        kills = start_cli(args, storage, shared_server.api, faults, tracking=mlflow_server.uri)
        # The reference run's tracking server goes away once its first epoch is in MLflow.
        outage.wait_for_epoch("calm", 600, alive=lambda: calm[0].poll() is None)
        outage.stop()
        out, summary = finish_cli(kills, storage, "kills")
        assert out.returncode == 0, out.stderr[-3000:]
        assert summary["status"] == "completed"
        assert len(list((storage / "runs" / "kills" / "faults").glob("*.fired"))) == 2  # both faults really fired
        starts = [a["start_epoch"] for a in summary["training_attempts"]]
        assert starts == [0, 1, 2], starts  # every restart resumed from the latest checkpoint, none from scratch
        assert summary["resumed_from_epoch"] == 1
        # The run's per-epoch record has every epoch once, the ones rerun after a restart replaced
        # (Ray Train's own metrics_dataframe would hold only the num_to_keep=2 kept checkpoints).
        history = read_history(storage / "runs" / "kills" / HISTORY_FILE)
        assert [row["epoch"] for row in history] == [0, 1, 2]
        assert all(0 <= row["val_accuracy"] <= 1 and row["finished_at"] > 0 for row in history)
        reference, ref_summary = finish_cli(calm, storage, "calm")
        assert reference.returncode == 0, reference.stderr[-3000:]
        assert [a["start_epoch"] for a in ref_summary["training_attempts"]] == [0]
        # Started together on one local root: one built the dataset, the other waited on its fcntl lock and reused it.
        assert summary["data"]["dataset_dir"] == ref_summary["data"]["dataset_dir"]
        assert sorted([summary["data"]["conversion_skipped"], ref_summary["data"]["conversion_skipped"]]) == [False, True]
        assert [p.name for p in (storage / "datasets").iterdir()] == [Path(summary["data"]["dataset_dir"]).name]  # no second copy
    finally:
        stop_cli(calm)  # only when the test failed before it ended
        outage.stop()
    # MLflow: one run for the interrupted pipeline run, one point per epoch (step = the global epoch),
    # the test metrics, the reports, and the promoted model as the registered model's champion.
    (tracked,) = mlflow_server.runs(run_name="kills")
    assert tracked.info.status == "FINISHED" and tracked.info.run_name == "kills"
    assert mlflow_server.steps(tracked.info.run_id) == mlflow_server.steps(tracked.info.run_id, "train_loss") == [0, 1, 2]
    assert tracked.data.metrics["test_accuracy"] == pytest.approx(summary["test_accuracy"])
    assert tracked.data.params["train.max_failures"] == "1" and tracked.data.params["model.name"] == summary["config"]["model"]["name"]
    assert tracked.data.tags["prefect_flow_run_id"] and tracked.data.tags["git_commit"]
    assert {a.path for a in mlflow_server.client().list_artifacts(tracked.info.run_id, "evaluation")} >= {
        "evaluation/confusion_matrix.png", "evaluation/training_curves.png", "evaluation/metrics.json"}
    assert summary["tracking"]["run_id"] == tracked.info.run_id and summary["tracking"]["not_recorded"] == []
    # The Prefect run page links to the MLflow run, and the MLflow run back to the Prefect flow run.
    links = {a["key"]: a for a in shared_server.artifacts(summary["flow_run_id"])}  # a link artifact: markdown in Prefect 3.9
    assert summary["tracking"]["url"] in links["mnist-mlflow-run"]["data"] and tracked.info.run_id in summary["tracking"]["url"]
    assert tracked.data.tags["prefect_flow_run_url"].endswith(f"/runs/flow-run/{summary['flow_run_id']}")
    model, version = summary["promotion"]["model"], summary["promotion"]["version"]
    assert summary["promotion"]["promoted"] and mlflow_server.client().get_model_version_by_alias(model, "champion").run_id == tracked.info.run_id
    ours = hashlib.sha256((storage / "models" / model / f"v{version}" / "model.pt").read_bytes()).hexdigest()
    assert mlflow_server.champion_sha256(model) == ours  # models:/<model>@champion is our champion's weights
    # The reference run lost its server mid-training: it completed, warned once, and says what MLflow lacks.
    assert ref_summary["status"] == "completed" and ref_summary["tracking"]["run_id"]
    assert {"epoch metrics", "test metrics"} <= set(ref_summary["tracking"]["not_recorded"]), ref_summary["tracking"]
    assert (reference.stdout + reference.stderr).count("the run goes on without tracking") == 1
    assert "not in MLflow" in reference.stdout + reference.stderr
    # Same seed, same result: each epoch's order and augmentation are fixed by (seed, epoch) and
    # the restarts resumed from exact checkpoints (weights, optimizer, EMA), so the interrupted
    # run matches the uninterrupted one within half a point (200 test digits: one digit).
    assert summary["test_accuracy"] >= 0.25, summary["test_accuracy"]  # it learned (chance is 10%)
    assert abs(summary["test_accuracy"] - ref_summary["test_accuracy"]) <= 0.005, (summary["test_accuracy"], ref_summary["test_accuracy"])
    # Finer than one test digit: every epoch's validation loss matches too (the small model is still
    # learning fast at 3 epochs, so a restart from a wrong state would move it far more than this).
    calm = read_history(storage / "runs" / "calm" / HISTORY_FILE)
    assert len(calm) == len(history) and all(abs(a["val_loss"] - b["val_loss"]) <= 1e-3 for a, b in zip(history, calm)), (history, calm)


def has_committed_checkpoint(run_dir: Path) -> bool:
    """True once Ray Train's controller has registered a checkpoint of the run.

    A ``checkpoint_*/model.pt`` on storage is not enough: the worker uploads the folder first and
    the controller records it in ``checkpoint_manager_snapshot.json`` when it next polls (every
    2 s); a failure in between restarts from the checkpoint before. CI once killed a node inside
    that window and the restart began at epoch 0. The pause settles before its marker appears,
    so after `wait_for_pause` this holds; the tests check it anyway.
    """
    try:
        snapshot = json.loads((run_dir / "checkpoint_manager_snapshot.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(snapshot.get("latest_checkpoint_result"))


def committed_rows(row_log: Path, attempts: list[dict]) -> dict[int, Counter]:
    """Per epoch, the row_ids whose training survived: each attempt's steps before the next attempt's start.

    A step after the checkpoint the next attempt resumed from was rolled back with its weights,
    so its rows are not counted; the last attempt's steps all count.
    """
    starts = [(a["start_epoch"], a["start_step"], a["world_size"]) for a in attempts]
    rows: dict[int, Counter] = {}
    for index, (epoch, step, world) in enumerate(starts):
        files = sorted(row_log.glob(f"from-e{epoch}s{step}-w{world}-rank*.jsonl"))
        assert len(files) == world, (starts[index], [f.name for f in files])  # every rank of the attempt logged
        end = starts[index + 1][:2] if index + 1 < len(starts) else (1 << 30, 0)
        for path in files:
            for line in path.read_text().splitlines():
                entry = json.loads(line)
                if (entry["epoch"], entry["step"]) < end:
                    rows.setdefault(entry["epoch"], Counter()).update(entry["rows"])
    return rows


@pytest.mark.slow
def test_interrupted_epochs_train_every_row_exactly_once_and_a_killed_driver_resumes(tmp_path, mirror_flags, shared_server, mlflow_server):
    """Kills between mid-epoch checkpoints, then the driver killed mid-training, then the same run name
    on a different number of workers: the run resumes (finished stages skipped after verification,
    training from the last committed checkpoint) and the rows that every surviving step trained on
    add up to the training set exactly once per epoch. Tracked in MLflow, the resumed run continues
    the killed driver's MLflow run, and no epoch gets a second point."""
    storage = tmp_path / "storage"
    base = [*mirror_flags, *COMMON, "--run-name", "exact", "--train.checkpoint-every-steps", "3", "--train.stage-retries", "0"]
    # First run, 2 workers: a kill at step 5 of epoch 1 is repaired by Ray Train from the step-3
    # checkpoint; at step 4 of epoch 2 training pauses (its step-3 checkpoint committed first) and
    # the driver is SIGKILLed with its whole process group: the flow process and its local Ray.
    faults = f"kill:rank=1:epoch=1:step=5;{pause_env(epoch=2, step=4)[FAULT_ENV]}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "flows.mnist", "--storage-root", str(storage), *base, "--train.max-failures", "1"],
        cwd=ROOT, env=api_env(shared_server.api, **hooks(faults, record_rows=True, tracking=mlflow_server.uri)), stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True,
    )
    run_dir = storage / "runs" / "exact"
    try:
        wait_for_pause(storage, "exact", timeout_s=600, alive=lambda: proc.poll() is None)
        assert has_committed_checkpoint(run_dir)
        mlflow_server.wait_for_epoch("exact", 60)
        (tracked,) = mlflow_server.runs(run_name="exact")
        deadline = time.monotonic() + 30  # the epoch lines (and their MLflow points) follow the history within a poll
        while mlflow_server.steps(tracked.info.run_id) != [0, 1] and time.monotonic() < deadline:
            time.sleep(1)
        assert mlflow_server.steps(tracked.info.run_id) == [0, 1]  # logged live, before the crash
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    assert list(run_dir.glob("checkpoint_*")), "no checkpoint before the crash"
    assert not (run_dir / "summary.json").is_file() or json.loads((run_dir / "summary.json").read_text())["status"] != "completed"
    # Second run of the same run name with 1 worker: the rest of epoch 2 is split over 1 rank.
    out, summary = run_cli([*base, "--train.num-workers", "1"], storage, shared_server.api, record_rows=True, tracking=mlflow_server.uri)
    assert out.returncode == 0, out.stderr[-3000:]
    assert summary["status"] == "completed"
    (resumed,) = mlflow_server.runs(run_name="exact")  # the same MLflow run, finished now
    assert resumed.info.run_id == tracked.info.run_id and resumed.info.status == "FINISHED"
    assert mlflow_server.steps(resumed.info.run_id) == [0, 1, 2]  # epoch 2 added once, 0 and 1 not again
    assert summary["data"]["download_skipped"] and summary["data"]["conversion_skipped"]  # verified on storage, skipped
    attempts = summary["training_attempts"]
    assert [a["world_size"] for a in attempts] == [2, 2, 1], attempts
    assert [a["start_epoch"] for a in attempts] == [0, 1, 2], attempts  # the crashed run's two attempts, then the resumed one
    assert attempts[1]["start_step"] > 0 and attempts[2]["start_step"] > 0, attempts  # resumed mid-epoch
    from ray.train import Result

    assert Result.from_path(str(run_dir)).metrics["epoch"] == 2  # the resumed run finished all 3 epochs
    assert [row["epoch"] for row in read_history(run_dir / HISTORY_FILE)] == [0, 1, 2]
    train_ids = pq.read_table(Path(summary["data"]["dataset_dir"]) / "train", columns=["row_id"]).column("row_id").to_pylist()
    expected = Counter(train_ids)
    assert len(expected) == summary["data"]["rows"]["train"] == len(train_ids)
    consumed = committed_rows(run_dir / "row_log", attempts)
    assert sorted(consumed) == [0, 1, 2]
    for epoch, rows in consumed.items():
        twice = sorted(r for r, n in rows.items() if n > 1)
        missing = sorted(expected - rows)
        assert rows == expected, f"epoch {epoch}: {len(twice)} rows twice {twice[:10]}, {len(missing)} missing {missing[:10]}"


@pytest.mark.slow
def test_stalled_worker_fails_within_the_hang_timeout_naming_the_rank(tmp_path, mirror_flags, shared_server, shared_ray):
    """On the session's Ray cluster (``shared_ray``): Ray Train ends the stalled worker's group, and the
    run's end ends its job there."""
    storage = tmp_path / "storage"
    args = [
        *mirror_flags, *COMMON, "--run-name", "stall", "--train.epochs", "1", "--train.hang-timeout-s", "20",
        "--train.max-failures", "0", "--train.stage-retries", "0",
    ]
    start = time.monotonic()
    out, summary = run_cli(args, storage, shared_server.api, faults="stall:rank=1:epoch=0:step=2", timeout=600, ray=shared_ray)
    elapsed = time.monotonic() - start
    assert out.returncode == 1
    assert summary["status"] == "failed" and summary["stages"]["train"]["status"] == "failed"
    error = summary["stages"]["train"]["error"]
    assert "hang_timeout_s=20" in error and re.search(r"Ranks? 1 failed to pass monitoredBarrier", error), error
    assert summary["stages"]["train"]["seconds"] < 300, elapsed  # surfaced in bounded time, not hung


@pytest.mark.slow
def test_node_loss_restarts_on_the_remaining_node_with_elastic_workers(tmp_path, mirror_flags, shared_server):
    """A real two-node Ray cluster on loopback (`ray start` head + worker node); the worker node is killed mid-training."""
    ray_bin = Path(sys.executable).with_name("ray")
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths must stay < 108 bytes
    # Token authentication is about who may join a cluster, not what this test checks; it is set in
    # the subprocesses only, since Ray fixes a process's auth mode the first time it reads it.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API") and k != "MNIST_FAULT_INJECT"}
    env |= {"RAY_AUTH_MODE": "disabled", "RAY_TMPDIR": temp}
    # How fast the cluster notices the loss is the cluster's setting, not what this test proves. With
    # Ray's defaults the GCS marks a silent node dead after 5 failed health checks 3 s apart, and Ray
    # Train, which may try to start both workers again before that, waits 60 s for the group before it
    # settles for what is left (measured on an AMD EPYC, Zen 5, 2 cores: 75 s of the test's 132 s). This cluster checks every
    # second and gives a worker group 20 s; both nodes' processes, the Train controller included, read them.
    env |= {"RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3",
            "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "20"}
    # Both ranks pause at the first step of epoch 1 (epoch 0's checkpoint committed first): which node
    # hosts rank 0 is not fixed, and the node is lost while both are surely training. The attempt
    # after the loss does not pause again (the markers stay).
    pauses = f"{pause_env(epoch=1, step=0, rank=0)[FAULT_ENV]};{pause_env(epoch=1, step=0, rank=1)[FAULT_ENV]}"
    port, client_port = free_ports(2)  # not fixed: another cluster on this machine may hold one
    address = f"127.0.0.1:{port}"
    common = ["--node-ip-address=127.0.0.1", "--disable-usage-stats"]
    # In a session of its own: its daemons keep the group, which the cleanup kills (not `ray stop`,
    # which would stop every Ray on the machine).
    head = subprocess.Popen(
        [str(ray_bin), "start", "--head", f"--port={port}", f"--ray-client-server-port={client_port}", "--num-cpus=3",
         "--include-dashboard=false", *common],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    node = flow = None
    try:
        _, errors = head.communicate(timeout=180)
        assert head.returncode == 0, errors[-2000:]
        # The worker node runs in the foreground in its own process group, so killing that group is
        # losing the node: its raylet and every worker process on it.
        node = subprocess.Popen(
            [str(ray_bin), "start", f"--address={address}", "--num-cpus=2", "--block", *common],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )
        storage = tmp_path / "storage"
        # 3 + 2 CPUs, 1 kept for Ray Data: two workers of 2 CPUs, one on each node.
        args = [*mirror_flags, *COMMON, "--run-name", "nodes", "--train.epochs", "4", "--train.min-workers", "1",
                "--ray.address", address]
        log = tmp_path / "nodes.log"
        with open(log, "w") as out:
            flow = subprocess.Popen(
                [sys.executable, "-m", "flows.mnist", "--storage-root", str(storage), *args],
                cwd=ROOT, env=env | {FAULT_ENV: pauses, "PREFECT_API_URL": shared_server.api}, stdout=out,
                stderr=subprocess.STDOUT, text=True,
            )
        run_dir = storage / "runs" / "nodes"
        deadline = time.monotonic() + 600
        while len(paused(str(faults_dir(storage, "nodes")))) < 2 and time.monotonic() < deadline and flow.poll() is None:
            time.sleep(0.2)
        assert flow.poll() is None and len(paused(str(faults_dir(storage, "nodes")))) == 2, log.read_text()[-4000:]
        assert has_committed_checkpoint(run_dir)
        attempts = [json.loads(line) for line in (run_dir / "train_attempts.jsonl").read_text().splitlines()]
        assert attempts[0]["world_size"] == 2
        os.killpg(node.pid, signal.SIGKILL)  # the node is gone
        node.wait(timeout=60)
        flow.wait(timeout=900)
        assert flow.returncode == 0, log.read_text()[-4000:]
    finally:
        for proc in (flow, node):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL) if proc is node else proc.kill()
        stop_cluster(head.pid, temp)
        shutil.rmtree(temp, ignore_errors=True)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed"
    attempts = summary["training_attempts"]
    # restarted on the one remaining node, from a checkpoint written before the loss (shared storage)
    assert attempts[0] == attempts[0] | {"start_epoch": 0, "world_size": 2}
    assert attempts[-1]["world_size"] == 1 and attempts[-1]["start_epoch"] == 1, attempts  # epoch 0's, committed before the pause


def free_ports(count: int) -> list[int]:
    """``count`` different ports nothing listens on now (all held open together, so no repeats)."""
    probes = [socket.socket() for _ in range(count)]
    try:
        for probe in probes:
            probe.bind(("127.0.0.1", 0))
        return [probe.getsockname()[1] for probe in probes]
    finally:
        for probe in probes:
            probe.close()


def stop_cluster(group: int, temp: str) -> None:
    """SIGKILL this test's Ray cluster: the head's process group, and every process started with its
    temp folder (``RAY_TMPDIR``; the workers run in groups of their own under a ``ray::`` title).

    Not ``ray stop``, which stops every Ray process on the machine, other runs' clusters too.
    """
    try:
        os.killpg(group, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            started = (entry / "cmdline").read_bytes() + b"\0" + (entry / "environ").read_bytes()
        except OSError:
            continue
        if temp.encode() in started:
            try:
                os.kill(int(entry.name), signal.SIGKILL)
            except ProcessLookupError:
                pass
