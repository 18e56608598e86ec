"""The real flow end to end: smoke preset, real local Ray (2 CPUs, 2 training workers), real Prefect API
(the session's shared server, ``shared_server``: these runs are not about starting one).

Every run trains the small model (``training.model.catalog:small_cnn``, tests/support/models.py): these
tests prove the stages, the gate, promotion and the Ray connection, not the network. The seeds'
checkpoint contract (model.pt loads into a torchvision ResNet-18 built the seeds' way) is checked
on the ResNet-18 run of tests/test_default_recipe.py.

Slow (minutes): marked ``slow``; ``make test`` runs it, ``make test-fast`` skips it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import torch
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterId,
    LogFilter,
    LogFilterFlowRunId,
    LogFilterTaskRunId,
)

from flows.mnist import mnist_pipeline
from flows.train import STAGE_CPUS
from pipeline_config import DEFAULT_WORKLOAD, registry_model_name
from pipeline_config.evaluation import OWN_GATES
from pipeline_config.settings import parse_cli
from reporting.artifacts import KEYS
from tests.support.digits import shuffled_labels_mirror
from tests.support.models import SMALL_MODEL, SMALL_MODEL_ARGS
from tests.support.prefect_server import api_env, using_api
from tests.support.ray_cluster import join_env
from training.checkpoint.model_files import checkpoint_model, load_model
from training.model.catalog import ModelSpec, small_cnn

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
STAGES = set(STAGE_CPUS)
CHAMPION = registry_model_name(DEFAULT_WORKLOAD, SMALL_MODEL)  # mnist-small-cnn: these runs train the small model


@pytest.fixture(scope="module")
def storage(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("e2e") / "storage"


@pytest.fixture(scope="module")
def smoke_run(storage, shared_server):
    """One smoke run of the flow in this process against a real Prefect server (the session's); returns (state, summary, API data)."""
    config = parse_cli(
        ["--preset", "smoke", *SMALL_MODEL_ARGS, "--storage-root", str(storage), "--run-name", "smoke-e2e"]
    ).pipeline_config()
    with using_api(shared_server.api):
        state = mnist_pipeline(config, return_state=True)
        flow_run_id = state.state_details.flow_run_id
        with get_client(sync_client=True) as client:
            flow_run = client.read_flow_run(flow_run_id)
            task_runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    summary = json.loads((storage / "runs" / "smoke-e2e" / "summary.json").read_text())
    return state, summary, flow_run, task_runs


@pytest.mark.spine
def test_smoke_run_completes_every_stage(smoke_run, storage):
    state, summary, _, _ = smoke_run
    assert state.is_completed(), state.message
    assert summary["status"] == "completed"
    assert state.result().to_json() == summary  # the flow returns its typed summary, the one summary.json holds
    assert set(summary["stages"]) == STAGES
    assert all(stage["status"] == "completed" and stage["seconds"] > 0 for stage in summary["stages"].values())
    assert summary["data_source"] == "sample"
    assert summary["data"]["rows"] == {"train": 3800, "val": 200, "test": 1000}
    metrics = json.loads((storage / "runs" / "smoke-e2e" / "evaluation" / "metrics.json").read_text())
    assert summary["test_accuracy"] == metrics["accuracy"] >= 0.5  # one short epoch on real digits
    assert metrics["rows"] == 1000 and sum(map(sum, metrics["confusion"])) == 1000
    # The first model of its name on this root becomes the champion
    assert summary["promotion"]["promoted"] is True and summary["promotion"]["version"] == 1
    pointer = json.loads((storage / "models" / CHAMPION / "champion").read_text())
    assert pointer["run_name"] == "smoke-e2e" and pointer["test_accuracy"] == metrics["accuracy"]


@pytest.mark.spine
def test_every_stage_task_run_is_recorded_in_the_flows_api(smoke_run):
    """The Ray workers reported to the flow's own Prefect API, not to private temporary servers."""
    _, _, flow_run, task_runs = smoke_run
    assert flow_run.state.is_completed()
    names = {run.name.rsplit("-", 1)[0] for run in task_runs}
    assert names == STAGES
    assert all(run.flow_run_id == flow_run.id for run in task_runs)
    assert all(run.state.is_completed() for run in task_runs)


@pytest.mark.spine
def test_a_stage_log_line_written_on_a_ray_worker_is_in_the_prefect_servers_logs_for_its_task_run(smoke_run, shared_server):
    """The first thing Prefect + Ray users report missing (PrefectHQ/prefect#16016): a task's log lines, written
    in a Ray worker (every stage runs through the flow's RayTaskRunner), reach the flow's Prefect server under
    that task run. The transform stage logs its normalization with Prefect's run logger (`reporting.logs`)."""
    _, _, flow_run, task_runs = smoke_run
    transform = next(run for run in task_runs if run.name.rsplit("-", 1)[0] == "transform")
    wanted = LogFilter(task_run_id=LogFilterTaskRunId(any_=[transform.id]))
    with using_api(shared_server.api), get_client(sync_client=True) as client:
        deadline = time.monotonic() + 30  # the worker's log handler sends in batches; the run has ended by now
        while True:
            logs = client.read_logs(log_filter=wanted)
            lines = [log.message for log in logs if log.message.startswith("Normalization (per channel)")]
            if lines or time.monotonic() > deadline:
                break
            time.sleep(1)
    assert len(lines) == 1, [log.message for log in logs]
    assert all(log.flow_run_id == flow_run.id and log.task_run_id == transform.id for log in logs)


@pytest.mark.spine
def test_ray_train_checkpoints_record_the_model_they_hold_and_load_back(smoke_run, storage):
    """The Ray Train run and its checkpoint files, with the model named by ``model.name`` recorded in
    extra_state.pt and rebuilt from it. (On ResNet-18, the seeds' contract: tests/test_default_recipe.py.)"""
    from ray.train import Result

    _, summary, _, _ = smoke_run
    result = Result.from_path(summary["run_dir"])
    assert result.checkpoint is not None
    best = Path(summary["best_checkpoint"])
    assert best.parent == storage / "runs" / "smoke-e2e"
    assert {"model.pt", "optimizer.pt", "extra_state.pt"} <= {p.name for p in best.iterdir()}
    extra = torch.load(best / "extra_state.pt", weights_only=True)
    assert extra["epoch"] == 0
    spec = ModelSpec(name=SMALL_MODEL, in_channels=1, num_classes=10)
    assert extra["model"] == spec.model_dump() and checkpoint_model(best) == spec
    model = load_model(best)  # built from what extra_state.pt records, then the weights loaded strictly
    fresh = small_cnn(in_channels=1, num_classes=10)
    assert [(name, p.shape) for name, p in model.named_parameters()] == [(name, p.shape) for name, p in fresh.named_parameters()]
    weights = torch.load(best / "model.pt", map_location="cpu", weights_only=True)
    assert weights.keys() == model.state_dict().keys()  # the DDP wrapper's "module." prefix is not saved
    assert all(tensor.equal(model.state_dict()[name]) for name, tensor in weights.items())


def test_a_model_trained_on_shuffled_labels_fails_the_default_gate_and_shows_its_evidence(
    smoke_run, storage, tmp_path, shared_server, shared_ray,
):
    """Second run on the same root, from the CLI into a real Prefect API: a broken pipeline (every
    training label shuffled) cannot pass the default gate (the default preset's, not a test's) and
    fails it by a wide margin, about chance; the failed run keeps every artifact and publishes the
    evaluation reports marked as failed, and the failure paragraph names accuracy, gate and artifact keys.
    It joins the session's Ray cluster (``shared_ray``): the run's own local Ray is the smoke run's to prove."""
    summary_out = tmp_path / "summary-copy.json"
    out = subprocess.run(
        [
            sys.executable, "-m", "flows.mnist", *shuffled_labels_mirror(tmp_path / "shuffled"), *SMALL_MODEL_ARGS,
            "--train.epochs", "1", "--storage-root", str(storage), "--run-name", "gate", "--summary-out", str(summary_out), "--json",
        ],
        cwd=ROOT, env=api_env(shared_server.api, **join_env(shared_ray)), capture_output=True, text=True, timeout=900,
    )
    printed = json.loads(out.stdout[out.stdout.index("{") : out.stdout.rindex("}") + 1])
    with using_api(shared_server.api), get_client(sync_client=True) as client:
        flow_run = client.read_flow_run(printed["flow_run_id"])
        runs = FlowRunFilter(id=FlowRunFilterId(any_=[flow_run.id]))
        artifacts = {a.key: a for a in client.read_artifacts(flow_run_filter=runs)}
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run.id])))
    gate = OWN_GATES["idx"]  # evaluate.min_accuracy unset: MNIST's digits' own gate
    assert out.returncode == 1, out.stderr[-3000:]
    assert f"is below the gate {gate:.4f}; the gate came from: the data's own gate (idx data; evaluate.min_accuracy unset)" in out.stderr
    assert json.loads(summary_out.read_text()) == printed
    assert printed["status"] == "failed"
    stored = json.loads((storage / "runs" / "gate" / "summary.json").read_text())
    assert stored["config"]["model"]["name"] == SMALL_MODEL and stored["evaluation"]["min_accuracy"] == gate  # the default gate
    # Evaluation completed with the verdict; the promote stage recorded the run, then failed on the gate
    assert printed["stages"]["evaluate"]["status"] == "completed" and "cleanup" not in printed["stages"]
    assert printed["stages"]["promote"]["status"] == "failed" and "QualityGateError" in printed["stages"]["promote"]["error"]
    assert printed["test_accuracy"] < 0.5  # about chance
    run_dir = storage / "runs" / "gate"
    assert (run_dir / "evaluation" / "metrics.json").is_file()  # the failed gate kept every artifact
    assert Path(printed["best_checkpoint"]).is_dir()

    assert flow_run.state.is_failed()
    verdict = f"gate FAILED: {printed['test_accuracy']:.2%} < {gate:.2%}"
    for key in (KEYS["confusion"], KEYS["predictions"], KEYS["checkpoint"]):
        assert verdict in artifacts[key].data.split("\n", 1)[0], key  # in the report's title
        assert verdict in artifacts[key].description
    metrics = artifacts[KEYS["metrics"]]
    rows = json.loads(metrics.data) if isinstance(metrics.data, str) else metrics.data
    assert rows[0]["class"] == "all" and rows[0]["gate"] == verdict and verdict in metrics.description
    paragraph = next(log.message for log in logs if "failed in stage 'promote'" in log.message)
    assert verdict in paragraph and KEYS["confusion"] in paragraph and KEYS["metrics"] in paragraph
    # A failed gate is never promoted: the champion stays the first run's
    assert printed["promotion"]["promoted"] is False and printed["promotion"]["reason"].startswith("gate failed")
    assert json.loads((storage / "models" / CHAMPION / "champion").read_text())["run_name"] == "smoke-e2e"
    assert "not promoted: gate failed" in out.stderr


def _cli(storage: Path, run_name: str, *args: str, env: dict[str, str]) -> tuple[subprocess.CompletedProcess, dict]:
    out = subprocess.run(
        [sys.executable, "-m", "flows.mnist", "--preset", "smoke", *SMALL_MODEL_ARGS, "--storage-root", str(storage), "--run-name", run_name,
         "--summary-out", str(storage.parent / f"{run_name}.json"), *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out, json.loads((storage.parent / f"{run_name}.json").read_text())


def test_only_a_better_model_is_promoted_compared_in_the_ui_and_predict_scores_with_the_champion(smoke_run, storage, ray_cluster, shared_server):
    """After the first run (champion v1) and the failed gate: a worse run is not promoted; a better one
    on changed data (the champion scored again on its test set) is, and its cleanup keeps the data its
    model card names. The comparison table in the Prefect API lists all four runs; `flows.predict`
    on the champion's test split gives exactly the evaluation's predictions.

    The worse run trains in one process (``train.mode single``) on its own local Ray. The better one
    connects to an existing Ray cluster (``ray.address``, a head node from ``ray start``): its stages
    and its two Ray Train workers run there, and the cluster is still up after the run."""
    from pyarrow import parquet as pq

    address, cluster_env = ray_cluster
    champion = json.loads((storage / "models" / CHAMPION / "champion").read_text())
    api_url = shared_server.api
    env = api_env(api_url)
    worse_out, worse = _cli(
        storage, "worse", "--train.mode", "single", "--train.learning-rate", "1e-6", "--evaluate.min-accuracy", "0", env=env
    )
    better_out, better = _cli(
        storage, "better", "--train.epochs", "2", "--parquet.validation-every", "10", "--ray.address", address,
        "--cleanup.delete-parquet", "--cleanup.delete-raw", env=cluster_env | {"PREFECT_API_URL": api_url},
    )
    # The "latest" versions are the better run's: nothing else has run on the shared server since.
    table = httpx.get(f"{api_url}/artifacts/{CHAMPION}-run-comparison/latest").raise_for_status().json()
    picture = httpx.get(f"{api_url}/artifacts/{CHAMPION}-accuracy-over-runs/latest").raise_for_status().json()

    # The better run on the existing cluster: completed there (its gate passed), the cluster still up
    assert "Ray: local cluster" in worse_out.stdout and "Ray: the cluster at" not in worse_out.stdout
    assert f"Ray: the cluster at {address}" in better_out.stdout and "Ray: local cluster" not in better_out.stdout
    assert better["status"] == "completed"
    config = json.loads((storage / "runs" / "better" / "summary.json").read_text())["config"]
    assert config["ray"]["address"] == address
    assert config["train"]["mode"] == "distributed" and config["train"]["num_workers"] == 2
    probe = subprocess.run(
        [sys.executable, "-c", f"import ray; ray.init(address='{address}'); print(ray.cluster_resources()['CPU'])"],
        env=cluster_env, capture_output=True, text=True, timeout=120,
    )
    assert probe.returncode == 0 and probe.stdout.strip().endswith("2.0"), probe.stderr[-2000:]

    # Second run on the same data and root: download and conversion verified on storage and skipped
    assert worse["data"]["download_skipped"] is True and worse["data"]["conversion_skipped"] is True
    assert worse["test_accuracy"] < champion["test_accuracy"]
    assert worse["promotion"]["promoted"] is False and "does not beat champion v1" in worse["promotion"]["reason"]
    assert "not promoted: test accuracy" in worse_out.stdout
    assert better["test_accuracy"] > champion["test_accuracy"], "two epochs should beat one; the test cannot judge otherwise"
    promotion = better["promotion"]
    assert promotion["promoted"] is True and promotion["version"] == 2 and promotion["champion_rescored"] is True
    assert f"promoted: {CHAMPION} v2 is the champion" in better_out.stdout
    assert "python -m flows.predict" in better_out.stdout

    models = storage / "models" / CHAMPION
    pointer = json.loads((models / "champion").read_text())
    card = json.loads((models / "v2" / "model_card.json").read_text())
    assert pointer["version"] == 2 and pointer["run_name"] == card["run_name"] == "better"
    manifest = Path(better["data"]["dataset_dir"]) / "_manifest.json"
    # A card names its data relative to the storage root (absolute in cards written before that)
    v1_card = json.loads((models / "v1" / "model_card.json").read_text())
    assert str(storage / card["data"]["dataset_dir"]) == better["data"]["dataset_dir"] != str(storage / v1_card["data"]["dataset_dir"])
    assert card["data"]["manifest_hash"] == hashlib.sha256(manifest.read_bytes()).hexdigest()
    assert card["config"]["train"]["epochs"] == 2 and card["config"]["parquet"]["validation_every"] == 10
    assert card["flow_run_id"] == better["flow_run_id"]
    # cleanup asked to delete the raw files and the Parquet dataset: both are named by a model card, so kept
    cleanup = json.loads((storage / "runs" / "better" / "cleanup.json").read_text())
    assert set(cleanup["kept"]) == {better["data"]["raw_dir"], better["data"]["dataset_dir"]} and manifest.is_file()

    assert table["flow_run_id"] == better["flow_run_id"] == picture["flow_run_id"]
    rows = json.loads(table["data"]) if isinstance(table["data"], str) else table["data"]
    promoted = {row["run"]: row["promoted"] for row in rows}
    assert [row["run"] for row in rows][:2] == ["better", "worse"] and rows[-1]["run"] == "smoke-e2e"  # newest first
    assert promoted["better"] == "v2 (champion)" and promoted["worse"] == "no" and promoted["smoke-e2e"] == "v1"
    assert promoted.get("gate", "no: gate failed") == "no: gate failed"  # the failed gate's run, when it ran first
    assert rows[0]["test_accuracy"] == round(better["test_accuracy"], 4) and rows[0]["epochs"] == 2
    assert "data:image/png;base64," in picture["data"]

    predictions = storage.parent / "champion-predictions.parquet"
    out = subprocess.run(
        [sys.executable, "-m", "flows.predict", "--storage-root", str(storage),
         "--model", CHAMPION, "--input", str(Path(better["data"]["dataset_dir"]) / "test"), "--output", str(predictions)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"Accuracy: {better['test_accuracy']:.2%} on 1,000 labelled digits" in out.stdout
    ours = pq.read_table(predictions).sort_by("row_id")
    evaluation = pq.read_table(Path(better["run_dir"]) / "evaluation" / "predictions.parquet").sort_by("row_id")
    assert ours.column("pred").to_pylist() == evaluation.column("pred").to_pylist()
    assert ours.schema.metadata[b"version"] == b"2"


def _ray_env(temp: str) -> dict[str, str]:
    # Token authentication is about who may join a cluster, not what this test checks. It is set
    # only in the subprocesses' environment: Ray fixes a process's auth mode the first time it
    # reads it, so setting it in this process would break every later local Ray here.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    return env | {"RAY_AUTH_MODE": "disabled", "RAY_TMPDIR": temp}


@pytest.fixture
def ray_cluster():
    """A real Ray head node started with `ray start` on 127.0.0.1, stopped afterwards; yields (address, env)."""
    ray_bin = Path(sys.executable).with_name("ray")
    port = 6390
    # A short folder: Ray's Unix socket paths under it must stay below 108 bytes.
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    env = _ray_env(temp)
    started = subprocess.run(
        [str(ray_bin), "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1", "--num-cpus=2",
         "--include-dashboard=false", "--disable-usage-stats"],
        env=env, capture_output=True, text=True, timeout=180,
    )
    assert started.returncode == 0, started.stderr[-2000:]
    try:
        yield f"127.0.0.1:{port}", env
    finally:
        _stop_cluster(temp)
        shutil.rmtree(temp, ignore_errors=True)


def _processes() -> dict[int, tuple[int, list[str]]]:
    """pid -> (parent pid, command line) of every process on the machine, read from /proc."""
    found = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError):
            continue
        if stat[0] != "Z":  # a zombie has exited already
            found[int(entry)] = (int(stat[1]), [part.decode(errors="replace") for part in cmdline if part])
    return found


def _stop_cluster(temp: str, timeout_s: float = 30) -> None:
    """SIGKILL the head node whose session lives under ``temp``, as `ray stop --force` does: the
    processes naming that folder (GCS, raylet, monitors) and their children (agents, workers). Only
    those: `ray stop` would stop every Ray on the machine, other runs' local Rays included."""
    procs = _processes()
    ours = {pid for pid, (_, args) in procs.items() if any(temp + "/" in arg or arg.endswith(temp) for arg in args)}
    while children := {pid for pid, (ppid, _) in procs.items() if ppid in ours} - ours:
        ours |= children
    for pid in ours:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while (ours := ours & set(_processes())) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not ours, f"the Ray cluster under {temp} left processes {sorted(ours)} behind"
