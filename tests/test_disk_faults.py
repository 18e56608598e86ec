"""A storage root that fills up or turns read-only in the middle of a stage.

Real filesystems, no mocks: each test mounts its own size-limited tmpfs (the suite runs as root
here and in CI, which ``mount`` needs), fills it or remounts it read-only, and checks that the
stage fails with a clear error naming the path, leaves the last good state as it was, and that
the same stage succeeds once the space is back.

Training: a checkpoint upload that runs out of space (a real pyarrow copy into a full tmpfs)
leaves a folder whose ``_checksums.json`` names files that are truncated; cleanup finds and
removes such folders, the training stage's error names the stage, the folder and the cause, and
it is not retried. The slow test trains for real (local Ray, Ray Train, 2 workers) on a root
that fills during the second epoch, then reruns the same run on a bigger root.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import re
import shutil
import subprocess
from pathlib import Path

import pyarrow.fs as pafs
import pytest
import torch
from ray.train import ControllerError, WorkerGroupError

from dataset.formats.parquet import ParquetDataset, verify_manifest
from dataset.sources.interface import RawData
from pipeline_config import CleanupConfig, ParquetConfig, TrainConfig, TransformConfig
from storage_io import StorageLayout, StorageWriteError, atomic_write_json, exists, join, storage_writes, upload_dir
from tasks.cleanup import cleanup, incomplete_checkpoints
from tasks.manifests import Evaluation
from tasks.to_parquet import dataset_fingerprint, to_parquet
from tasks.train import train
from tasks.transform import transform
from tests.support.digits import write_raw
from tests.support.parquet import read_split
from tests.support.runs import torchvision_resnet18_seed_style
from training.checkpoint.files import CHECKSUMS_FILE, MODEL_FILE, OPTIMIZER_FILE, SEEDS_MODEL, checkpoint_problem
from training.checkpoint.in_attempt import checkpoint_dir_name, discard_failed_upload, unused_checkpoint_dir
from training.checkpoint.model_files import load_state, save_checkpoint_files
from training.failures import is_infrastructure_failure, raise_storage_failure, storage_failure
from training.manifests import RAY_TRAIN_SNAPSHOT, CheckpointInfo, TrainedModel, UnreadableSnapshot

GOOD = ParquetConfig(rows_per_file=64, rows_per_group=64, validation_every=4)
OTHER = ParquetConfig(rows_per_file=128, rows_per_group=64, validation_every=4)  # another fingerprint


def mount_tmpfs(mount_point: Path, size: str) -> None:
    """Mount a ``size`` tmpfs at ``mount_point``: root only, so a developer who is not root skips these tests
    (CI runs as root, where a failed mount fails the test)."""
    if os.geteuid() != 0:
        pytest.skip("mounts a small tmpfs to fill it up, which needs root (CI runs these as root)")
    mount_point.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount_point)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.fail(f"these tests mount a small tmpfs and need root (CI runs as root): {done.stderr.strip()}")


@pytest.fixture
def small_fs(tmp_path):
    """A 3 MiB tmpfs at ``tmp_path/fs``, unmounted afterwards."""
    mount_point = tmp_path / "fs"
    mount_tmpfs(mount_point, "3m")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=True)


def fill(folder: Path) -> Path:
    """Write a filler file until the filesystem is full; return it."""
    filler = folder / "filler.bin"
    with open(filler, "wb") as handle:
        try:
            while True:
                handle.write(b"\0" * 65536)
                handle.flush()
        except OSError:
            pass
    return filler


def dataset_folders(layout: StorageLayout) -> list[str]:
    return sorted(p.name for p in (Path(layout.root) / "datasets").iterdir())


def test_a_full_storage_root_fails_the_conversion_cleanly_and_a_rerun_completes(tmp_path, small_fs):
    raw = RawData(**write_raw(tmp_path / "raw", n_train=600, n_test=200))  # ~0.6 MB of Parquet per build
    layout = StorageLayout.create(str(small_fs / "storage"), "full")
    good = to_parquet.fn(raw, GOOD, layout)
    before = dataset_folders(layout)

    filler = fill(small_fs)
    with pytest.raises(StorageWriteError, match=r"to-parquet: cannot write .*storage/datasets.*storage root is full") as info:
        to_parquet.fn(raw, OTHER, layout)
    assert "run again with the same --run-name" in str(info.value)
    assert dataset_folders(layout) == before  # no half-built staging folder left behind
    assert verify_manifest(Path(good.directory), good.fingerprint) is not None  # the last good build is intact

    filler.unlink()  # space is back: the same stage now completes
    other = to_parquet.fn(raw, OTHER, layout)
    assert not other.skipped and Path(other.directory).name == f"mnist-{dataset_fingerprint(raw, OTHER)}"
    assert verify_manifest(Path(other.directory), other.fingerprint) is not None
    assert read_split(Path(other.directory) / "train").num_rows == good.rows["train"]


def test_a_read_only_storage_root_fails_with_the_path_and_keeps_the_published_dataset(tmp_path, small_fs):
    raw = RawData(**write_raw(tmp_path / "raw", n_train=120, n_test=40))
    layout = StorageLayout.create(str(small_fs / "storage"), "ro")
    good = to_parquet.fn(raw, GOOD, layout)
    subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True)
    try:
        with pytest.raises(StorageWriteError, match=r"to-parquet: cannot write .*mounted read-only"):
            to_parquet.fn(raw, OTHER, layout)
        with pytest.raises(StorageWriteError, match=r"summary: cannot write .*: the storage root is mounted read-only"):
            with storage_writes("summary"):
                atomic_write_json(layout.summary_path, {"status": "failed"})
        assert dataset_folders(layout) == [Path(good.directory).name]
        assert verify_manifest(Path(good.directory), good.fingerprint) is not None
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(small_fs)], check=True)
    other = to_parquet.fn(raw, OTHER, layout)
    assert verify_manifest(Path(other.directory), other.fingerprint) is not None


# --- training checkpoints on a full storage root -------------------------------------------------


def write_checkpoint(folder: Path, width: int = 600) -> Path:
    """A checkpoint folder in the seeds' format; ``width`` 600 makes it about 4.3 MB (model 1.4, optimizer 2.9)."""
    folder.mkdir(parents=True, exist_ok=True)
    model = torch.nn.Linear(width, width)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, width)).sum().backward()
    optimizer.step()  # the optimizer state (two moments) now exists
    return save_checkpoint_files(folder, model, optimizer, {"epoch": 0})


def upload_checkpoint(source: Path, destination: Path) -> OSError | None:
    """Copy a checkpoint folder the way Ray Train uploads one (pyarrow copy_files); the error, if it failed."""
    local = pafs.LocalFileSystem()
    local.create_dir(str(destination))
    try:
        pafs.copy_files(str(source), str(destination), source_filesystem=local, destination_filesystem=local, chunk_size=64 << 20)
    except OSError as exc:
        return exc
    return None


def test_a_failed_checkpoint_upload_leaves_debris_that_blocks_the_retry_until_removed(tmp_path, small_fs):
    source = write_checkpoint(tmp_path / "local", width=400)  # about 1.9 MB
    layout = StorageLayout.create(str(small_fs / "storage"), "run")
    run_dir = Path(layout.run_dir)
    filler = small_fs / "filler.bin"
    filler.write_bytes(b"\0" * (1500 << 10))  # 3 MiB root, 1.5 MB of it taken
    error = upload_checkpoint(source, run_dir / checkpoint_dir_name(1))
    assert error is not None and error.errno == errno.ENOSPC and error.filename is None  # pyarrow names no file
    partial = run_dir / "checkpoint_epoch-0001"
    assert partial.is_dir()

    found = incomplete_checkpoints(layout.run_dir)
    assert list(found) == [str(partial)]
    # pyarrow copies in no fixed order: the checksums may be absent, cut short, or whole next to a cut-short file.
    assert re.fullmatch(
        rf"no {CHECKSUMS_FILE}|{CHECKSUMS_FILE} is unreadable \(.*\)|\S+\.pt (is missing although {CHECKSUMS_FILE} names it"
        r"|does not match its sha256 \(truncated or modified\))",
        found[str(partial)],
    ), found

    filler.unlink()  # the space is back, but the partial copy still holds what the retry needs
    retry = run_dir / unused_checkpoint_dir(layout.run_dir, checkpoint_dir_name(1))
    assert retry.name == "checkpoint_epoch-0001_retry-1"
    assert upload_checkpoint(source, retry) is not None
    for folder in (partial, retry):
        discard_failed_upload(str(folder))  # what rank 0 does when the upload raises
    assert not partial.exists() and not retry.exists() and incomplete_checkpoints(layout.run_dir) == {}
    assert upload_checkpoint(source, partial) is None  # without the debris the same checkpoint fits
    assert checkpoint_problem(partial) is None


def test_the_debris_finder_judges_only_checkpoints_ray_train_does_not_know(tmp_path):
    run_dir = tmp_path / "runs" / "run"
    good = write_checkpoint(run_dir / "checkpoint_epoch-0000", width=8)
    truncated = write_checkpoint(run_dir / "checkpoint_epoch-0001", width=8)
    (truncated / MODEL_FILE).write_bytes((truncated / MODEL_FILE).read_bytes()[:100])
    unlisted = write_checkpoint(run_dir / "checkpoint_epoch-0002", width=8)
    (unlisted / CHECKSUMS_FILE).unlink()
    missing = write_checkpoint(run_dir / "checkpoint_epoch-0002_step-000040", width=8)
    (missing / OPTIMIZER_FILE).unlink()
    kept_by_ray = write_checkpoint(run_dir / "checkpoint_epoch-0003", width=8)
    (kept_by_ray / MODEL_FILE).write_bytes(b"damaged, but Ray Train's: not for cleanup to judge")
    named = write_checkpoint(run_dir / "checkpoint_epoch-0004", width=8)
    (named / CHECKSUMS_FILE).unlink()
    (run_dir / "evaluation").mkdir()  # not a checkpoint folder
    atomic_write_json(run_dir / RAY_TRAIN_SNAPSHOT, {
        "checkpoint_results": [{"checkpoint_dir_name": "checkpoint_epoch-0000", "metrics": {}}],
        "latest_checkpoint_result": {"checkpoint_dir_name": "checkpoint_epoch-0003", "metrics": {}},
        "pending_training_results": [],
    })

    found = incomplete_checkpoints(str(run_dir), known=[str(named)])
    assert found == {
        str(truncated): "model.pt does not match its sha256 (truncated or modified)",
        str(unlisted): f"no {CHECKSUMS_FILE}",
        str(missing): f"optimizer.pt is missing although {CHECKSUMS_FILE} names it",
    }
    assert checkpoint_problem(good) is None
    with pytest.raises(FileNotFoundError, match=f"optimizer.pt although {CHECKSUMS_FILE} names it"):
        load_state(missing, OPTIMIZER_FILE)

    (run_dir / RAY_TRAIN_SNAPSHOT).write_text("{not json")
    with pytest.raises(UnreadableSnapshot, match=RAY_TRAIN_SNAPSHOT):
        incomplete_checkpoints(str(run_dir))


def test_cleanup_removes_incomplete_checkpoints_and_lists_them(tmp_path):
    layout = StorageLayout.create(str(tmp_path / "root"), "run")
    run_dir = Path(layout.run_dir)
    best = write_checkpoint(run_dir / "checkpoint_epoch-0001", width=8)
    debris = write_checkpoint(run_dir / "checkpoint_epoch-0002", width=8)
    (debris / MODEL_FILE).write_bytes(b"")  # cut short
    outside = write_checkpoint(tmp_path / "elsewhere" / "checkpoint_epoch-0002", width=8)
    (outside / MODEL_FILE).write_bytes(b"")
    trained = TrainedModel(
        run_dir=layout.run_dir, model=SEEDS_MODEL, best_checkpoint=str(best), best_val_accuracy=0.9,
        checkpoints=[CheckpointInfo(path=str(best), epoch=1, val_accuracy=0.9)], history=[], num_workers=2, cpus_per_worker=0.5,
    )
    evaluation = Evaluation(
        checkpoint=str(best), accuracy=0.9, precision=[], recall=[], confusion=[], rows=1,
        metrics_path="m", predictions_path="p", passed_gate=True,
    )
    raw = RawData(source="sample", url="file:///x/", directory=str(tmp_path / "raw"), files={}, skipped=False)
    dataset = ParquetDataset(directory=str(tmp_path / "data"), fingerprint="abc", rows={})
    size = sum(f.stat().st_size for f in debris.iterdir())

    dry = cleanup.fn(CleanupConfig(dry_run=True), raw, dataset, trained, evaluation, layout)
    assert dry.paths == [str(debris)] and debris.exists()  # listed, not deleted
    real = cleanup.fn(CleanupConfig(), raw, dataset, trained, evaluation, layout)
    assert real.paths == [str(debris)] and real.bytes == size
    assert real.incomplete_checkpoints == {str(debris): "model.pt does not match its sha256 (truncated or modified)"}
    assert json.loads(Path(real.report_path).read_text())["incomplete_checkpoints"] == real.incomplete_checkpoints
    assert not debris.exists() and checkpoint_problem(best) is None
    assert outside.exists()  # outside the run folder: never looked at


def test_checkpoint_names_are_deterministic_and_never_reuse_a_folder(tmp_path):
    assert checkpoint_dir_name(3) == "checkpoint_epoch-0003"
    assert checkpoint_dir_name(3, 120) == "checkpoint_epoch-0003_step-000120"
    run_dir = str(tmp_path)
    assert unused_checkpoint_dir(run_dir, "checkpoint_epoch-0003") == "checkpoint_epoch-0003"
    (tmp_path / "checkpoint_epoch-0003").mkdir()  # left by an attempt whose report never registered
    (tmp_path / "checkpoint_epoch-0003_retry-1").mkdir()
    assert unused_checkpoint_dir(run_dir, "checkpoint_epoch-0003") == "checkpoint_epoch-0003_retry-2"


def test_a_full_disk_inside_ray_trains_errors_becomes_the_stages_error_and_is_not_retried(tmp_path, small_fs):
    run_dir = str(small_fs / "runs" / "run")
    folder = f"{run_dir}/checkpoint_epoch-0001"
    enospc = upload_checkpoint(write_checkpoint(tmp_path / "local"), Path(folder))  # a real one from a real full tmpfs
    assert enospc is not None
    peer_lost = RuntimeError("Connection closed by peer [127.0.0.1]:29500")  # rank 1 when rank 0 is gone

    # Rank 0's own error: the folder it was uploading, carried to the driver by pickling.
    with pytest.raises(StorageWriteError) as rank0:
        with storage_writes("train", folder):
            raise enospc
    shipped = pickle.loads(pickle.dumps(rank0.value))
    assert shipped.errno == errno.ENOSPC
    error = WorkerGroupError("rank 0 and 1 failed", {0: shipped, 1: peer_lost})
    with pytest.raises(StorageWriteError, match=rf"^train: cannot write under {folder}: the storage root is full") as raised:
        raise_storage_failure(error, run_dir)
    assert raised.value.errno == errno.ENOSPC and raised.value.__cause__ is error
    assert not is_infrastructure_failure(raised.value) and not is_infrastructure_failure(error)  # Prefect does not retry
    assert is_infrastructure_failure(WorkerGroupError("lost", {1: peer_lost}))  # a lost peer alone still is retried

    # Ray Train's bare OSError (no file name): named by the run folder.
    bare = storage_failure(WorkerGroupError("rank 0 failed", {0: enospc}), run_dir)
    assert str(bare).startswith(f"train: cannot write under {run_dir}: the storage root is full")
    # Only the text survived (an error flattened into a message).
    text = storage_failure(RuntimeError(f"upload failed: {enospc}"), run_dir)
    assert str(text).startswith(f"train: cannot write under {run_dir}: the storage root is full")
    # The controller's snapshot write on a read-only root names its file.
    readonly = OSError(errno.EROFS, "Read-only file system", f"{run_dir}/checkpoint_manager_snapshot.json")
    assert str(storage_failure(ControllerError(readonly), run_dir)).startswith(
        f"train: cannot write {run_dir}/checkpoint_manager_snapshot.json: the storage root is mounted read-only"
    )
    # Anything else is left as it is.
    assert storage_failure(WorkerGroupError("bug", {0: ValueError("bad shape")}), run_dir) is None
    assert raise_storage_failure(ValueError("bad shape"), run_dir) is None


def checkpoint_folders(run_dir: Path) -> list[str]:
    return sorted(p.name for p in run_dir.glob("checkpoint_*") if p.is_dir())  # not Ray Train's snapshot file


@pytest.mark.slow
def test_a_root_that_fills_during_training_fails_naming_the_checkpoint_and_the_same_run_resumes(tmp_path, local_ray):
    """Real training on a 200 MB root: epoch 0's checkpoint (about 135 MB) fits, epoch 1's does not.

    A run this short (a few optimizer steps) has no weight average (`training.worker.recipe.plan_for`), so a checkpoint
    is ResNet-18's weights and AdamW's two moments: three copies of about 45 MB.

    Ray Train's restart (max_failures=1) resumes from epoch 0 and fails the same way; the stage's
    error names the checkpoint folder; no partial folder is left; the same run on the root grown
    to 1 GB resumes from epoch 1 and completes.
    """
    mount_point = tmp_path / "fs"
    mount_tmpfs(mount_point, "200m")
    try:
        layout = StorageLayout.create(str(mount_point / "storage"), "fills-up")
        raw = RawData(**write_raw(tmp_path / "raw", n_train=100, n_test=20))
        dataset = to_parquet.fn(raw, ParquetConfig(rows_per_file=64, rows_per_group=64, validation_every=5), layout)
        spec = transform.fn(dataset, TransformConfig(), layout)
        cfg = TrainConfig(num_workers=2, epochs=2, global_batch_size=32, num_to_keep=1, max_failures=1, hang_timeout_s=0)
        run_dir = Path(layout.run_dir)

        with pytest.raises(StorageWriteError) as info:
            train.fn(spec, cfg, layout)
        message = str(info.value)
        assert message.startswith(f"train: cannot write under {run_dir / 'checkpoint_epoch-0001'}: the storage root is full"), message
        assert isinstance(info.value.__cause__, WorkerGroupError) and not is_infrastructure_failure(info.value)
        attempts = [json.loads(line)["start_epoch"] for line in (run_dir / "train_attempts.jsonl").read_text().splitlines()]
        assert attempts == [0, 1]  # Ray Train's restart resumed from epoch 0's checkpoint and met the same disk
        assert checkpoint_folders(run_dir) == ["checkpoint_epoch-0000"]  # no partial epoch 1
        assert checkpoint_problem(run_dir / "checkpoint_epoch-0000") is None
        assert incomplete_checkpoints(layout.run_dir) == {}
        assert shutil.disk_usage(mount_point).used < 150 << 20  # epoch 1's partial copy gave its space back

        subprocess.run(["mount", "-o", "remount,size=1g", str(mount_point)], check=True)
        trained = train.fn(spec, cfg, layout)  # the same run name: resumes
        assert trained.resumed_from_epoch == 1 and [a["start_epoch"] for a in trained.attempts] == [0, 1, 1]
        assert [row["epoch"] for row in trained.history] == [0, 1]
        assert Path(trained.best_checkpoint).parent == run_dir and checkpoint_problem(trained.best_checkpoint) is None
        names = checkpoint_folders(run_dir)
        assert "checkpoint_epoch-0001" in names and all(checkpoint_problem(run_dir / n) is None for n in names)
        assert incomplete_checkpoints(layout.run_dir) == {}
        # The seeds' contract on a 2-worker DDP checkpoint: model.pt loads, strict and with no `module.`
        # prefix, into a one-channel torchvision ResNet-18 built the seeds' way.
        torchvision_resnet18_seed_style().load_state_dict(torch.load(Path(trained.best_checkpoint) / MODEL_FILE, weights_only=True))
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=True)


def test_debris_on_an_s3_root_is_found_and_removed_the_same_way(tmp_path, s3_root):
    run_dir = join(s3_root, "runs", "run")
    source = write_checkpoint(tmp_path / "local", width=8)
    good, cut = join(run_dir, checkpoint_dir_name(0)), join(run_dir, checkpoint_dir_name(1, 40))
    upload_dir(source, good, last=CHECKSUMS_FILE)
    upload_dir(source, cut, only={CHECKSUMS_FILE, MODEL_FILE})  # the upload stopped before optimizer.pt
    assert incomplete_checkpoints(run_dir) == {cut: f"extra_state.pt is missing although {CHECKSUMS_FILE} names it"}
    assert unused_checkpoint_dir(run_dir, checkpoint_dir_name(1, 40)) == "checkpoint_epoch-0001_step-000040_retry-1"
    discard_failed_upload(cut)
    assert not exists(join(cut, MODEL_FILE)) and incomplete_checkpoints(run_dir) == {}
    assert checkpoint_problem(good) is None
