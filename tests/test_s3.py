"""An ``s3://`` storage root, against moto's S3 server started by the test on 127.0.0.1.

Every stage that touches storage runs here on the bucket: the storage primitives, the build lock
(a conditional PUT), the raw download, the Parquet conversion with its manifest (a truncated
object is detected and rebuilt), checkpoints refused when tampered or of another architecture,
cleanup with its refusals. The whole flow on a bucket (Ray Train checkpointing through a pyarrow
S3 filesystem, evaluation and promotion loading from S3) is the S3 case of the concurrent-runs
test in tests/test_storage.py: two whole flows at once on one bucket.
No test reaches the internet; nothing is mocked (moto is a real HTTP server speaking the S3 API).
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import boto3
import pyarrow.parquet as pq
import pytest

from dataset.formats.parquet import ParquetDataset
from dataset.sources.interface import RawData, check_data
from pipeline_config import CleanupConfig, DownloadConfig, ParquetConfig
from pipeline_config.settings import parse_cli
from storage_io import (
    MANIFEST,
    StorageLayout,
    atomic_write_bytes,
    atomic_write_json,
    exists,
    file_lock,
    filesystem,
    join,
    list_files,
    read_json,
    remove,
    run_lease,
    total_bytes,
)
from tasks.cleanup import check_deletable, cleanup
from tasks.download import download
from tasks.manifests import Evaluation
from tasks.to_parquet import to_parquet
from tests.support.digits import write_raw
from training.checkpoint.files import SEEDS_MODEL
from training.manifests import CheckpointInfo, TrainedModel

ROOT = Path(__file__).resolve().parent.parent
CFG = ParquetConfig(rows_per_file=64, rows_per_group=64, validation_every=4)


def objects(root: str) -> list[str]:
    """Every object under ``root`` in the bucket, listed with boto3 (not through the code under test)."""
    bucket, _, prefix = root.removeprefix("s3://").partition("/")
    client = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/")
    keys = (item["Key"] for page in pages for item in page.get("Contents", []))
    return sorted(key[len(prefix) + 1 :] for key in keys if not key.endswith("/"))  # not pyarrow's folder markers


def test_storage_primitives_on_s3(s3_root):
    path = join(s3_root, "runs", "r", "summary.json")
    assert path == f"{s3_root}/runs/r/summary.json"
    atomic_write_json(path, {"status": "completed"})
    assert read_json(path) == {"status": "completed"} and exists(path)
    atomic_write_bytes(join(s3_root, "runs", "r", "deep", "x.bin"), b"12345")
    assert list_files(join(s3_root, "runs")) == ["r/deep/x.bin", "r/summary.json"]
    assert total_bytes(join(s3_root, "runs", "r")) == 5 + len(json.dumps({"status": "completed"}, indent=2)) + 1
    assert read_json(join(s3_root, "missing.json")) is None
    remove(join(s3_root, "runs", "r"))
    assert objects(s3_root) == [] and not exists(path)


def test_contains_refuses_dotdot_other_prefixes_and_local_paths(s3_root):
    layout = StorageLayout.create(s3_root + "/", "r")
    assert layout.root == s3_root and layout.run_dir == f"{s3_root}/runs/r"
    assert layout.contains(f"{s3_root}/runs/r/checkpoint_000001")
    assert not layout.contains(s3_root)  # the root itself is never a deletion target
    assert not layout.contains(f"{s3_root}/runs/../../elsewhere")
    assert not layout.contains(f"{s3_root}-other/runs/r")  # a sibling prefix that shares the name's start
    assert not layout.contains("/tmp/runs/r")


def test_build_lock_is_exclusive_across_processes_and_a_dead_holders_lock_is_broken(s3_root):
    layout = StorageLayout.create(s3_root, "r")
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time\nfrom storage_io import StorageLayout, file_lock\n"
         f"lock = file_lock(StorageLayout.create({s3_root!r}, 'x'), 'dataset-abc'); lock.__enter__()\n"
         "print('held', flush=True)\ntime.sleep(600)"],
        cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        assert "locks/dataset-abc.lock" in objects(s3_root)
        with pytest.raises(TimeoutError, match="dataset-abc.lock"):
            with file_lock(layout, "dataset-abc", timeout_s=1.5):
                pass
    finally:
        holder.kill()  # dies holding the lock, like a crashed run
        holder.wait(timeout=30)
    with file_lock(layout, "dataset-abc", timeout_s=10):  # taken over: its holder is dead
        assert read_json(join(s3_root, "locks", "dataset-abc.lock"))["pid"] == os.getpid()
    assert "locks/dataset-abc.lock" not in objects(s3_root)


def test_threads_take_turns_on_the_s3_lock(s3_root):
    layout = StorageLayout.create(s3_root, "r")
    inside, overlaps = [], []

    def work():
        with file_lock(layout, "build", timeout_s=60):
            inside.append(1)
            overlaps.append(len(inside))
            time.sleep(0.3)
            inside.pop()

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert overlaps == [1, 1, 1]


def test_download_to_s3_then_reuse_without_uploading(s3_root):
    layout = StorageLayout.create(s3_root, "r")
    first = download.fn(DownloadConfig(source="sample"), layout)
    assert first.directory == f"{s3_root}/raw/sample" and not first.skipped
    assert objects(join(s3_root, "raw", "sample")) == sorted(first.files)
    second = download.fn(DownloadConfig(source="sample"), layout)
    assert second.skipped and second.files == first.files
    # A tampered raw object is detected by its checksum and fetched again.
    atomic_write_bytes(join(first.directory, "t10k-labels-idx1-ubyte.gz"), gzip.compress(b"tampered"))
    third = download.fn(DownloadConfig(source="sample"), layout)
    assert not third.skipped and third.files == first.files


def test_parquet_conversion_on_s3_reuses_a_verified_build_and_rebuilds_a_truncated_one(tmp_path, s3_root, caplog):
    local = RawData(**write_raw(tmp_path / "raw"))
    layout = StorageLayout.create(s3_root, "r")
    raw_dir = layout.raw_dir("mirror-test")
    for name in local.files:
        atomic_write_bytes(join(raw_dir, name), (tmp_path / "raw" / name).read_bytes())
    raw = local.model_copy(update={"directory": raw_dir})

    built = to_parquet.fn(raw, CFG, layout)
    assert built.directory.startswith(f"{s3_root}/datasets/mnist-") and not built.skipped
    keys = objects(built.directory)
    assert MANIFEST in keys and "train/part-00000.parquet" in keys and not any("staging" in k for k in keys)
    fs, where = filesystem(built.split_dir("train"))
    assert pq.read_table(where, filesystem=fs).num_rows == built.rows["train"] == 90
    assert to_parquet.fn(raw, CFG, layout).skipped

    victim = join(built.directory, "train", "part-00001.parquet")
    fs, where = filesystem(victim)
    with fs.open_input_stream(where, compression=None) as handle:
        data = handle.readall()
    atomic_write_bytes(victim, data[: len(data) // 2])  # a truncated upload
    rebuilt = to_parquet.fn(raw, CFG, layout)
    assert not rebuilt.skipped and "part-00001.parquet: sha256 does not match" in caplog.text
    assert pq.read_table(join(built.directory, "train").removeprefix("s3://"), filesystem=fs).num_rows == 90


def test_a_tampered_or_foreign_checkpoint_on_s3_is_refused_naming_the_object(tmp_path, s3_root):
    """The checks are the model's files', whatever the model: the small CNN keeps ResNet-18's 45 MB
    off the loopback server (tests/test_models.py and the unit tests check the same on ResNet-18 locally)."""
    import torch

    from storage_io import upload_dir
    from training.checkpoint.files import CHECKSUMS_FILE, MODEL_FILE, IntegrityError
    from training.checkpoint.model_files import load_model, save_checkpoint_files
    from training.model.catalog import ModelSpec

    spec = ModelSpec(name="training.model.catalog:small_cnn", in_channels=1, num_classes=10)
    model = spec.build()
    (tmp_path / "ours").mkdir()
    (tmp_path / "other").mkdir()
    save_checkpoint_files(tmp_path / "ours", model, torch.optim.AdamW(model.parameters()), {"epoch": 0, "model": spec.model_dump()})
    ours = join(s3_root, "runs", "r", "checkpoint_000000")
    upload_dir(tmp_path / "ours", ours)
    loaded = load_model(ours)  # intact: the same weights come back from the bucket
    assert all(torch.equal(value, model.state_dict()[name]) for name, value in loaded.state_dict().items())

    original = (tmp_path / "ours" / MODEL_FILE).read_bytes()
    tampered = bytearray(original)
    tampered[len(tampered) // 2] ^= 0xFF  # one byte changed in the stored object
    atomic_write_bytes(join(ours, MODEL_FILE), bytes(tampered))
    with pytest.raises(IntegrityError, match=f"{ours}/{MODEL_FILE} does not match its sha256 in {ours}/{CHECKSUMS_FILE}"):
        load_model(ours)
    atomic_write_bytes(join(ours, MODEL_FILE), original)
    remove(join(ours, CHECKSUMS_FILE))
    with pytest.raises(IntegrityError, match=f"{ours}/{CHECKSUMS_FILE} is missing"):
        load_model(ours)

    # A 3-channel stem with intact checksums, under a record that says 1 channel: another architecture
    other = spec.model_copy(update={"in_channels": 3}).build()
    save_checkpoint_files(tmp_path / "other", other, torch.optim.AdamW(other.parameters()), {"epoch": 0, "model": spec.model_dump()})
    foreign = join(s3_root, "runs", "r", "checkpoint_000001")
    upload_dir(tmp_path / "other", foreign)
    with pytest.raises(ValueError, match=f"{foreign}/{MODEL_FILE} does not hold a model.name={spec.name} with 1 input channel"):
        load_model(foreign)


def _run_tree(s3_root: str):
    layout = StorageLayout.create(s3_root, "run")
    ckpts = []
    for epoch, acc in enumerate([0.90, 0.97, 0.95]):
        path = join(layout.run_dir, f"checkpoint_{epoch}")
        atomic_write_bytes(join(path, "model.pt"), b"x" * 10)
        ckpts.append(CheckpointInfo(path=path, epoch=epoch, val_accuracy=acc))
    atomic_write_bytes(join(layout.raw_dir("sample"), "f.gz"), b"y" * 5)
    atomic_write_bytes(join(layout.dataset_dir("abc"), "part.parquet"), b"z" * 7)
    trained = TrainedModel(run_dir=layout.run_dir, model=SEEDS_MODEL, best_checkpoint=ckpts[1].path, best_val_accuracy=0.97,
                           checkpoints=ckpts, history=[], num_workers=1, cpus_per_worker=1.0)
    evaluation = Evaluation(checkpoint=ckpts[1].path, accuracy=0.9, precision=[], recall=[], confusion=[], rows=1,
                            metrics_path="m", predictions_path="p", passed_gate=True)
    raw = RawData(source="sample", url="file:///x/", directory=layout.raw_dir("sample"), files={}, skipped=False)
    dataset = ParquetDataset(directory=layout.dataset_dir("abc"), fingerprint="abc", rows={})
    return layout, raw, dataset, trained, evaluation


def test_cleanup_on_s3_deletes_what_the_dry_run_lists_and_keeps_the_evaluated_checkpoint(s3_root):
    layout, raw, dataset, trained, evaluation = _run_tree(s3_root)
    cfg = CleanupConfig(keep_checkpoints=1, delete_raw=True)
    before = objects(s3_root)
    dry = cleanup.fn(cfg.model_copy(update={"dry_run": True}), raw, dataset, trained, evaluation, layout)
    assert objects(s3_root) == before + ["runs/run/cleanup.json"]  # a dry run deletes nothing
    real = cleanup.fn(cfg, raw, dataset, trained, evaluation, layout)
    assert real.paths == dry.paths and real.bytes == dry.bytes == 10 + 10 + 5
    assert objects(s3_root) == ["datasets/mnist-abc/part.parquet", "runs/run/checkpoint_1/model.pt", "runs/run/cleanup.json"]


def test_cleanup_on_s3_refuses_dotdot_and_paths_outside_the_root(s3_root):
    layout, raw, dataset, trained, evaluation = _run_tree(s3_root)
    with pytest.raises(ValueError, match="outside the storage root"):
        check_deletable(f"{s3_root}/runs/../../other", layout, [])
    with pytest.raises(ValueError, match="which the evaluation used"):
        check_deletable(layout.run_dir, layout, [trained.checkpoints[1].path])
    escaping = raw.model_copy(update={"directory": f"{s3_root}/raw/../../elsewhere"})
    precious = s3_root.rsplit("/", 1)[0] + "/elsewhere/keep.txt"  # beside the root, in the same bucket
    atomic_write_bytes(precious, b"precious")
    before = objects(s3_root)
    with pytest.raises(ValueError, match="outside the storage root"):
        cleanup.fn(CleanupConfig(delete_raw=True, delete_parquet=True), escaping, dataset, trained, evaluation, layout)
    assert objects(s3_root) == before and exists(precious)  # refused before deleting anything


def test_cleanup_on_s3_leaves_what_another_live_run_reads(s3_root):
    from storage_io import lease_uses, paths_in_use

    layout, raw, dataset, trained, evaluation = _run_tree(s3_root)
    other = StorageLayout.create(s3_root, "manual-run")  # a live run reading the same dataset
    policy = CleanupConfig(delete_raw=True, delete_parquet=True)
    with run_lease(other):
        lease_uses(other, dataset.directory)
        assert paths_in_use(layout) == [dataset.directory]
        before = objects(s3_root)
        for dry_run in (True, False):  # the dry run refuses exactly like the real one
            with pytest.raises(ValueError, match=f"refusing to delete {dataset.directory}: another live run"):
                cleanup.fn(policy.model_copy(update={"dry_run": dry_run}), raw, dataset, trained, evaluation, layout)
        assert objects(s3_root) == before  # nothing deleted
    report = cleanup.fn(policy, raw, dataset, trained, evaluation, layout)  # that run ended: allowed now
    assert set(report.paths) == {raw.directory, dataset.directory}
    assert not any(key.startswith(("raw/", "datasets/")) for key in objects(s3_root))


def test_a_live_run_name_is_refused_on_s3(s3_root):
    from storage_io import RunInUseError

    layout = StorageLayout.create(s3_root, "nightly")
    with run_lease(layout):
        assert read_json(join(s3_root, "leases", "nightly.json"))["pid"] == os.getpid()
        other = subprocess.run(
            [sys.executable, "-c",
             "from storage_io import StorageLayout, run_lease\n"
             f"with run_lease(StorageLayout.create({s3_root!r}, 'nightly')): pass"],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
        )
        assert other.returncode != 0 and RunInUseError.__name__ in other.stderr
    assert "leases/nightly.json" not in objects(s3_root)


def test_bad_s3_roots_are_refused_before_any_work(s3_server, monkeypatch, tmp_path):
    with pytest.raises(ValueError, match="not an S3 bucket name"):
        parse_cli(["--storage-root", "s3://Bad_Bucket/x"]).pipeline_config()
    with pytest.raises(ValueError, match="train.mode=single .* s3:// storage_root"):
        parse_cli(["--storage-root", "s3://bucket/x", "--train.mode", "single"]).pipeline_config()
    for key, value in {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s", "AWS_ENDPOINT_URL": s3_server}.items():
        monkeypatch.setenv(key, value)
    out = subprocess.run(
        [sys.executable, "-m", "flows.mnist", "--preset", "smoke", "--storage-root", "s3://no-such-bucket/x"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env=os.environ | {"PREFECT_API_URL": ""},
    )
    assert out.returncode == 2, out.stderr
    assert "storage_root s3://no-such-bucket/x: bucket 'no-such-bucket' does not exist" in out.stderr


def test_an_s3_root_says_whether_the_endpoint_the_bucket_or_the_credentials_are_wrong(s3_server, s3_root, monkeypatch, tmp_path):
    """Each way an S3 root can be unusable gets its own message, within seconds (the real loopback server)."""
    import socket

    StorageLayout.create(s3_root, "ok").check_reachable()  # the bucket exists: no error

    with pytest.raises(ValueError, match=r"bucket 'no-such-bucket' does not exist at http://127\.0\.0\.1"):
        StorageLayout.create("s3://no-such-bucket/x", "r").check_reachable()

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{probe.getsockname()[1]}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", closed)
    started = time.monotonic()
    with pytest.raises(ValueError, match=f"cannot reach the S3 endpoint {closed}") as unreachable:
        StorageLayout.create(s3_root, "r").check_reachable()
    assert "does not exist" not in str(unreachable.value) and "AWS_ENDPOINT_URL" in str(unreachable.value)
    assert time.monotonic() - started < 30

    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server)  # back to the working endpoint, now without any credentials
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(ValueError, match="no S3 credentials found; set AWS_ACCESS_KEY_ID"):
        StorageLayout.create(s3_root, "r").check_reachable()



def test_an_image_folder_in_a_bucket_is_checked_read_and_converted_by_ray_data(tmp_path, s3_root, local_ray):
    """download.path s3://...: the folder's checks, its files' checksums and Ray Data's conversion read
    the bucket (the tests' own RGB workload, uploaded with boto3, not through the code under test)."""
    from dataset.formats import folder
    from tests.support.images import CLASSES, SIZE, write_image_folder

    local = write_image_folder(tmp_path / "images", {"train": 6, "test": 2})
    images = f"{s3_root}/images"
    bucket, _, prefix = images.removeprefix("s3://").partition("/")
    client = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])
    for path in sorted(local.rglob("*.png")):
        client.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(local).as_posix()}")

    cfg = DownloadConfig(source="folder", path=images)
    checked = check_data(cfg)
    assert checked.classes == list(CLASSES) and checked.shape == (None, None, None)  # images read by the conversion only
    listed = folder.check_folder(images)
    assert len(listed.files["train"]) == 18 and len(listed.files["test"]) == 6
    with pytest.raises(folder.FolderError, match=f"download.path {s3_root}/elsewhere: no such folder"):
        check_data(DownloadConfig(source="folder", path=f"{s3_root}/elsewhere"))

    layout = StorageLayout.create(str(tmp_path / "storage"), "r")
    raw = download.fn(cfg, layout)
    assert raw.source == "folder" and raw.directory == images and len(raw.files) == 24
    dataset = to_parquet.fn(raw, ParquetConfig(rows_per_file=64, rows_per_group=64, validation_every=3), layout)
    assert dataset.image_shape == (3, SIZE, SIZE) and dataset.classes == list(CLASSES)
    assert dataset.rows == {"train": 12, "val": 6, "test": 6}
    test = pq.read_table(Path(dataset.directory) / "test")
    assert sorted(test.column("label").to_pylist()) == [0, 0, 1, 1, 2, 2]
    assert objects(images) == sorted(p.relative_to(local).as_posix() for p in local.rglob("*.png"))  # only read


def test_a_split_in_a_bucket_streams_in_windows_with_the_rows_held_in_memory(tmp_path, s3_root, local_ray):
    """A dataset on the S3 root over the in-memory budget: its row groups are planned and read from the
    bucket by Ray Data tasks, with the rows (and the epoch order's rules) of the in-memory path."""
    import numpy as np

    from dataset.tensors.spec import TransformSpec
    from dataset.tensors.transform import build_split
    from pipeline_config import TransformConfig

    local = RawData(**write_raw(tmp_path / "raw"))
    layout = StorageLayout.create(s3_root, "r")
    raw_dir = layout.raw_dir("mirror-stream")
    for name in local.files:
        atomic_write_bytes(join(raw_dir, name), (tmp_path / "raw" / name).read_bytes())
    dataset = to_parquet.fn(local.model_copy(update={"directory": raw_dir}), CFG, layout)
    plain = {"shift_px": 0, "rotate_deg": 0, "scale": 0}

    def rows(cfg: TransformConfig, split: str, **kwargs) -> np.ndarray:
        spec = TransformSpec(dataset=dataset, config=cfg, checks={}, manifest="")
        batches = build_split(spec, split, **kwargs).iter_batches(batch_format="numpy", batch_size=None)
        return np.concatenate([batch["row_id"] for batch in batches])

    streamed, held = TransformConfig(in_memory_mb=0, window_mb=0.02, **plain), TransformConfig(in_memory_mb=64, **plain)
    for split in ("val", "test"):
        np.testing.assert_array_equal(rows(streamed, split), rows(held, split))
    epoch = rows(streamed, "train", seed=3, epoch=1)
    assert sorted(epoch.tolist()) == sorted(rows(held, "train").tolist()) and len(epoch) == dataset.rows["train"]
    np.testing.assert_array_equal(rows(streamed, "train", seed=3, epoch=1, exclude=epoch[:10]), epoch[10:])
