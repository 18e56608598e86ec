"""A storage root that fills up or turns read-only in the middle of a stage.

Real filesystems, no mocks: each test mounts its own size-limited tmpfs (the suite runs as root
here and in CI, which ``mount`` needs), fills it or remounts it read-only, and checks that the
stage fails with a clear error naming the path, leaves the last good state as it was, and that
the same stage succeeds once the space is back.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from pipeline_config import ParquetConfig
from tasks.common.storage import StorageLayout, StorageWriteError, atomic_write_json, storage_writes
from tasks.download import RawData
from tasks.to_parquet import dataset_fingerprint, to_parquet, verify_manifest
from tests.conftest import write_raw
from tests.test_parquet import read_split

GOOD = ParquetConfig(rows_per_file=64, rows_per_group=64, validation_every=4)
OTHER = ParquetConfig(rows_per_file=128, rows_per_group=64, validation_every=4)  # another fingerprint


@pytest.fixture
def small_fs(tmp_path):
    """A 3 MiB tmpfs at ``tmp_path/fs``, unmounted afterwards."""
    mount_point = tmp_path / "fs"
    mount_point.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount_point)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.fail(f"these tests mount a small tmpfs and need root (CI runs as root): {done.stderr.strip()}")
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
