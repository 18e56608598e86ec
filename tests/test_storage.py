"""Storage shared by concurrent runs: the dataset build lock, run leases, and cleanup around live runs.

Fast tests use real files and real processes (a second Python process holds the lock or the
lease); the slow test runs two real flows at once on one storage root.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pipeline_config import DEFAULT_WORKLOAD, registry_model_name
from storage_io import (
    RunInUseError,
    StorageLayout,
    basename,
    file_lock,
    join,
    lease_path,
    lease_uses,
    list_files,
    live_leases,
    paths_in_use,
    read_json,
    run_lease,
)
from tasks.cleanup import check_deletable, cleanup
from tests.support.digits import real_digits_mirror
from tests.support.models import SMALL_MODEL, SMALL_MODEL_ARGS
from tests.support.prefect_server import api_env

ROOT = Path(__file__).resolve().parent.parent


def hold_in_child(code: str) -> subprocess.Popen:
    """A second process that runs ``code`` (which takes a lock or lease), prints 'held', then waits for stdin."""
    child = subprocess.Popen(
        [sys.executable, "-c", code + "\nprint('held', flush=True)\nimport sys; sys.stdin.read()"],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    assert child.stdout.readline().strip() == "held"
    return child


def release(child: subprocess.Popen) -> None:
    child.stdin.close()
    child.wait(timeout=30)


def test_dataset_lock_makes_a_second_builder_wait(tmp_path):
    layout = StorageLayout.create(str(tmp_path / "storage"), "a")
    child = hold_in_child(
        "from storage_io import StorageLayout, file_lock\n"
        f"layout = StorageLayout.create({str(tmp_path / 'storage')!r}, 'b')\n"
        "lock = file_lock(layout, 'dataset-x'); lock.__enter__()"
    )
    try:
        with pytest.raises(TimeoutError, match="dataset-x.lock, held by another run"):
            with file_lock(layout, "dataset-x", timeout_s=1):
                pass
        acquired = threading.Event()

        def wait_for_lock():
            with file_lock(layout, "dataset-x", timeout_s=60):
                acquired.set()

        waiter = threading.Thread(target=wait_for_lock)
        waiter.start()
        time.sleep(1.0)
        assert not acquired.is_set()  # still held by the other process
    finally:
        release(child)
    waiter.join(timeout=30)
    assert acquired.is_set()  # taken as soon as the other process let go


def test_a_live_run_name_is_refused_and_a_dead_ones_lease_is_taken_over(tmp_path):
    storage = str(tmp_path / "storage")
    layout = StorageLayout.create(storage, "nightly")
    child = hold_in_child(
        "from storage_io import StorageLayout, run_lease\n"
        f"lease = run_lease(StorageLayout.create({storage!r}, 'nightly')); lease.__enter__()"
    )
    try:
        with pytest.raises(RunInUseError, match=f"run 'nightly' is already running on {storage} \\(pid {child.pid}"):
            with run_lease(layout):
                pass
        assert read_json(lease_path(layout))["pid"] == child.pid  # the live lease is untouched
    finally:
        child.kill()  # dies without removing its lease, like a crashed driver
        child.wait(timeout=30)
    assert Path(lease_path(layout)).is_file()
    with run_lease(layout) as path:  # the stale lease of a dead process is taken over
        assert read_json(path)["pid"] == os.getpid()
    assert not Path(lease_path(layout)).exists()  # and removed when the run ends


def test_cleanup_never_deletes_what_another_live_run_reads(run_tree):
    layout, raw, dataset, trained, evaluation = run_tree
    from pipeline_config import CleanupConfig

    other = StorageLayout.create(layout.root, "manual-run")
    child = hold_in_child(
        "from storage_io import StorageLayout, run_lease, lease_uses\n"
        f"layout = StorageLayout.create({layout.root!r}, 'manual-run')\n"
        f"lease = run_lease(layout); lease.__enter__(); lease_uses(layout, {dataset.directory!r})"
    )
    try:
        assert set(live_leases(layout)) == {"manual-run"}
        assert paths_in_use(layout) == [dataset.directory]
        with pytest.raises(ValueError, match="another live run on this storage root reads"):
            check_deletable(Path(dataset.directory), layout, [], paths_in_use(layout))
        policy = CleanupConfig(delete_raw=True, delete_parquet=True)
        with pytest.raises(ValueError, match=f"refusing to delete {dataset.directory}"):
            cleanup.fn(policy.model_copy(update={"dry_run": True}), raw, dataset, trained, evaluation, layout)
        with pytest.raises(ValueError, match=f"refusing to delete {dataset.directory}"):
            cleanup.fn(policy, raw, dataset, trained, evaluation, layout)
        assert Path(dataset.directory).exists() and Path(raw.directory).exists()  # nothing deleted
    finally:
        release(child)
    assert not Path(lease_path(other)).exists()
    report = cleanup.fn(policy, raw, dataset, trained, evaluation, layout)  # the other run ended: allowed now
    assert set(report.paths) == {raw.directory, dataset.directory} and not Path(dataset.directory).exists()


def test_lease_records_the_folders_a_run_reads(tmp_path):
    layout = StorageLayout.create(str(tmp_path / "storage"), "r1")
    with run_lease(layout) as path:
        lease_uses(layout, "/s/raw/x", "/s/datasets/y")
        lease_uses(layout, "/s/datasets/y")
        assert read_json(path)["uses"] == ["/s/datasets/y", "/s/raw/x"]
        other = StorageLayout.create(str(tmp_path / "storage"), "r2")
        assert paths_in_use(other) == ["/s/datasets/y", "/s/raw/x"]
        assert paths_in_use(layout) == []  # a run's own lease never blocks it


@pytest.mark.slow
@pytest.mark.spine
def test_two_runs_at_once_on_s3_share_one_dataset_build_and_keep_their_runs_apart(tmp_path, s3_root, shared_server):
    """A scheduled run overlapping a manual one: same storage root, same data, started together.

    The root is a bucket on moto's S3 server on 127.0.0.1 (tests/conftest.py), and the build lock a
    conditional PUT instead of fcntl; the runs start in an empty working folder, and every file of
    both whole flows is checked in the bucket (`check_whole_flow_on_s3`). On a local root, the same
    overlap (one run builds the dataset, the other waits on the fcntl lock and reuses it) is part of
    tests/test_fault_tolerance.py's worker-kill test, and four promotions at once of tests/test_promotion.py.
    Both runs report to the session's Prefect server, as runs of deployments do: two CLI runs
    without PREFECT_API_URL would each start a temporary server on the same default SQLite database.
    Each run starts a local Ray of its own, not the session's cluster (``shared_ray``): runs on one
    cluster take turns (`runner.cluster.cluster_slot`; tests/test_shared_cluster.py), so there one would end
    before the other began and the S3 build lock would never be waited on. (Before the turns, the two
    runs deadlocked on the session's 2-CPU cluster: each sized its training placement group from the
    cluster's CPUs as if it had the cluster alone, both groups were placed, and neither run's Ray Data
    tasks could start; tests/test_fault_tolerance.py's worker kills, the same two runs on a local root.)
    """
    storage = s3_root
    flags = real_digits_mirror(tmp_path / "mirror", train_per_class=60, test_per_class=20)
    common = [*flags, *SMALL_MODEL_ARGS, "--storage-root", storage, "--train.epochs", "1",
              "--train.global-batch-size", "64", "--evaluate.min-accuracy", "0"]
    cwd = tmp_path / "cwd"  # on S3, nothing may land in the working folder instead of the bucket
    cwd.mkdir()
    env = api_env(shared_server.api, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    runs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "flows.mnist", *common, "--run-name", name],
            cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for name in ("scheduled", "manual")
    }
    outputs = {name: proc.communicate(timeout=900)[0] for name, proc in runs.items()}
    for name, proc in runs.items():
        assert proc.returncode == 0, outputs[name][-4000:]
    summaries = {name: read_json(join(storage, "runs", name, "summary.json")) for name in runs}
    assert all(s["status"] == "completed" for s in summaries.values())
    datasets = {s["data"]["dataset_dir"] for s in summaries.values()}
    assert len(datasets) == 1  # one shared dataset ...
    assert sorted(s["data"]["conversion_skipped"] for s in summaries.values()) == [False, True]  # ... built once
    files = list_files(storage)
    built = {f.split("/")[1] for f in files if f.startswith("datasets/")}
    assert built == {basename(next(iter(datasets)))}  # no second copy, no staging folder left
    for name in runs:
        assert any(f.startswith(f"runs/{name}/checkpoint_") for f in files), name
        assert summaries[name]["best_checkpoint"].startswith(join(storage, "runs", name))
    assert not [f for f in files if f.startswith("leases/")]  # both leases released
    assert not [f for f in files if f.startswith("locks/")]  # the S3 build lock is an object, deleted on release
    # Both passed their gate and finished together: they took turns on the model's lock, so the
    # champion is the better of the two (the first on a tie) and every version it names is whole.
    model = registry_model_name(DEFAULT_WORKLOAD, SMALL_MODEL)  # mnist-small-cnn
    champion = read_json(join(storage, "models", model, "champion"))
    promoted = sorted(s["promotion"]["version"] for s in summaries.values() if s["promotion"]["promoted"])
    assert promoted in ([1], [1, 2]) and champion["version"] == promoted[-1]
    assert champion["test_accuracy"] == max(s["test_accuracy"] for s in summaries.values())
    assert champion["run_name"] in runs
    for version in promoted:
        card = read_json(join(storage, "models", model, f"v{version}", "model_card.json"))
        assert f"models/{model}/v{version}/model.pt" in files and card["version"] == version
    check_whole_flow_on_s3(storage, summaries, files, champion, model)
    assert list(cwd.iterdir()) == []


def check_whole_flow_on_s3(root: str, summaries: dict[str, dict], files: list[str], champion: dict, model_name: str) -> None:
    """Every artifact of both runs is in the bucket (once tests/test_s3.py's whole-flow test):
    Ray Train's checkpoints written through pyarrow's S3 filesystem, the run files, the evaluation,
    the model rebuilt from what the checkpoint records and loaded from the bucket, and the champion
    (a whole version, its card recording the model) with exactly the checkpoint's weights."""
    from training.champion import registry_files
    from training.checkpoint.model_files import checkpoint_model, load_model
    from training.model.catalog import ModelSpec

    spec = ModelSpec(name=SMALL_MODEL, in_channels=1, num_classes=10)
    for name, summary in summaries.items():
        assert summary["data"]["rows"] == {"train": 570, "val": 30, "test": 200}, summary["data"]["rows"]
        assert summary["data"]["raw_dir"].startswith(f"{root}/raw/")
        assert summary["data"]["dataset_dir"].startswith(f"{root}/datasets/mnist-")
        best = summary["best_checkpoint"]
        assert best.startswith(f"{root}/runs/{name}/checkpoint_")  # Ray Train wrote it through pyarrow's S3 filesystem
        checkpoint_key = best.removeprefix(root + "/")
        assert {f"{checkpoint_key}/model.pt", f"{checkpoint_key}/optimizer.pt", f"{checkpoint_key}/extra_state.pt"} <= set(files)
        for file in ("summary.json", "history.jsonl", "train_attempts.jsonl", "transform.json",
                     "evaluation/metrics.json", "evaluation/predictions.parquet"):
            assert f"runs/{name}/{file}" in files, file
        assert f"models/{model_name}/runs/{name}.json" in files
        metrics = read_json(join(root, "runs", name, "evaluation", "metrics.json"))
        assert summary["test_accuracy"] == metrics["accuracy"] and metrics["rows"] == 200
    # The champion's checkpoint: the model its extra_state.pt records (read from the bucket), rebuilt and loaded from it
    best = summaries[champion["run_name"]]["best_checkpoint"]
    assert checkpoint_model(best) == spec
    model = load_model(best)  # downloaded from the bucket, checksums verified, loaded strictly into spec.build()
    fresh = spec.build()
    assert [(n, p.shape) for n, p in model.named_parameters()] == [(n, p.shape) for n, p in fresh.named_parameters()]
    # Promoted in the bucket: a whole version (card uploaded last), then the champion pointer, which
    # names its version relative to the storage root (absolute in pointers written before that)
    version_dir = champion["path"] if champion["path"].startswith("s3://") else join(root, champion["path"])
    assert version_dir == f"{root}/models/{model_name}/v{champion['version']}"
    assert {f"models/{model_name}/v{champion['version']}/model_card.json", f"models/{model_name}/champion"} <= set(files)
    assert registry_files.version_model(version_dir) == spec  # the card in the bucket records the model
    champion_model = load_model(version_dir, registry_files.version_model(version_dir))  # the card says what to build
    weights = model.state_dict()
    assert champion_model.state_dict().keys() == weights.keys()
    assert all(tensor.equal(weights[name]) for name, tensor in champion_model.state_dict().items())


def test_an_empty_aws_endpoint_url_is_unset(monkeypatch):
    """Issue 66: ``AWS_ENDPOINT_URL=""`` was taken as an endpoint and every S3 call said "Invalid endpoint: ".
    Empty is unset, as the AWS SDKs read it: the check names AWS's own endpoint (unreachable here, or the
    bucket or the credentials refused where it is reachable), never an empty one."""
    from storage_io.filesystem import S3Settings

    for key, value in {"AWS_ENDPOINT_URL": "", "AWS_REGION": " ", "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    settings = S3Settings()
    assert settings.endpoint_url is None and settings.region is None and "endpoint_override" not in settings.pyarrow_kwargs()
    settings.boto3_client()  # refused before: ValueError("Invalid endpoint: ")
    with pytest.raises(ValueError, match=r"^storage_root s3://no-such-bucket-66/x: ") as refused:
        StorageLayout.create("s3://no-such-bucket-66/x", "r").check_reachable()
    assert "Invalid endpoint" not in str(refused.value)
