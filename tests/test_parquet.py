"""Parquet conversion on tiny synthetic IDX files: schema, row ids, splits, manifest, skip and rebuild."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest

from dataset.formats.parquet import SCHEMA, convert, images_from_column, manifest_problem, to_table, verify_manifest
from dataset.sources.interface import RawData
from pipeline_config import ParquetConfig
from storage_io import MANIFEST
from tasks.to_parquet import dataset_fingerprint, to_parquet
from tests.support.digits import idx_bytes, synthetic_digits, write_raw
from tests.support.parquet import read_split

CFG = ParquetConfig(rows_per_file=64, rows_per_group=64, validation_every=4)


def test_table_round_trip_keeps_every_pixel():
    images, labels = synthetic_digits(10)
    table = to_table(np.arange(10), images.reshape(10, -1), labels.astype(np.int64))
    assert table.schema == SCHEMA
    back = images_from_column(table.slice(3, 4).column("image"))  # offset slice: no copy, right rows
    np.testing.assert_array_equal(back, images[3:7].reshape(4, -1))


def test_convert_splits_rows_with_stable_unique_ids(tmp_path):
    raw = write_raw(tmp_path / "raw", n_train=120, n_test=40)
    rows = convert(Path(raw["directory"]), tmp_path / "out", CFG)
    assert rows == {"train": 90, "val": 30, "test": 40}

    train, val, test = (read_split(tmp_path / "out" / s) for s in ("train", "val", "test"))
    ids = np.concatenate([t.column("row_id").to_numpy() for t in (train, val, test)])
    assert len(np.unique(ids)) == len(ids) == 160
    assert set(val.column("row_id").to_numpy() % 4) == {3}  # every 4th train row is validation
    assert test.column("row_id").to_numpy().min() == 120  # test ids follow the train ids

    images, labels = synthetic_digits(120, seed=1)
    got = images_from_column(train.column("image"))
    np.testing.assert_array_equal(got, images[train.column("row_id").to_numpy()].reshape(-1, 784))
    np.testing.assert_array_equal(train.column("label").to_numpy(), labels[train.column("row_id").to_numpy()])
    assert len(list((tmp_path / "out" / "train").glob("*.parquet"))) == 2  # 90 rows, 64 per file


def test_truncated_idx_file_is_named(tmp_path):
    raw = write_raw(tmp_path / "raw", n_train=20, n_test=10)
    images = Path(raw["directory"]) / "train-images-idx3-ubyte.gz"
    images.write_bytes(gzip.compress(gzip.decompress(images.read_bytes())[:-100]))
    with pytest.raises(ValueError, match="train-images-idx3-ubyte.gz.*truncated"):
        convert(Path(raw["directory"]), tmp_path / "out", CFG)


def test_mismatched_counts_are_named(tmp_path):
    raw = write_raw(tmp_path / "raw", n_train=20, n_test=10)
    labels = Path(raw["directory"]) / "t10k-labels-idx1-ubyte.gz"
    labels.write_bytes(gzip.compress(idx_bytes(np.zeros(9, dtype=np.uint8))))
    with pytest.raises(ValueError, match="10 images but .*t10k-labels-idx1-ubyte.gz has 9 labels"):
        convert(Path(raw["directory"]), tmp_path / "out", CFG)


def test_stage_publishes_skips_and_rebuilds_a_tampered_dataset(tmp_path, layout):
    raw = RawData(**write_raw(tmp_path / "raw"))
    first = to_parquet.fn(raw, CFG, layout)
    folder = Path(first.directory)
    assert not first.skipped and first.rows == {"train": 90, "val": 30, "test": 40}
    assert verify_manifest(folder, first.fingerprint) is not None
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")]  # no staging left

    second = to_parquet.fn(raw, CFG, layout)
    assert second.skipped and second.directory == first.directory

    victim = next((folder / "train").glob("*.parquet"))
    victim.write_bytes(victim.read_bytes()[:-50])  # a truncated file is detected ...
    assert verify_manifest(folder, first.fingerprint) is None
    assert manifest_problem(folder, first.fingerprint) == f"{victim}: sha256 does not match the manifest (truncated or modified)"
    third = to_parquet.fn(raw, CFG, layout)  # ... and the dataset is rebuilt, not used
    assert not third.skipped
    assert verify_manifest(folder, first.fingerprint) is not None
    assert read_split(folder / "train").num_rows == 90


def test_half_written_dataset_is_never_read(tmp_path, layout):
    raw = RawData(**write_raw(tmp_path / "raw"))
    folder = Path(layout.dataset_dir(dataset_fingerprint(raw, CFG)))
    (folder / "train").mkdir(parents=True)
    (folder / "train" / "part-00000.parquet").write_bytes(b"PAR1 half a file")  # no manifest
    result = to_parquet.fn(raw, CFG, layout)
    assert not result.skipped
    assert (folder / MANIFEST).is_file()
    assert read_split(folder / "train").num_rows == 90


def test_settings_change_the_fingerprint(tmp_path):
    raw = RawData(**write_raw(tmp_path / "raw"))
    assert dataset_fingerprint(raw, CFG) != dataset_fingerprint(raw, CFG.model_copy(update={"validation_every": 5}))


def _raw_with_copies(folder: Path) -> RawData:
    """The synthetic IDX files with test rows 0..39 copies of training rows 0..39, and training row 7 (every
    4th goes to validation: row_id 7 is a validation row) a copy of training row 0."""
    raw = write_raw(folder, n_train=120, n_test=40)
    train_x, _ = synthetic_digits(120, seed=1)
    train_x[7] = train_x[0]
    (folder / "train-images-idx3-ubyte.gz").write_bytes(gzip.compress(idx_bytes(train_x), mtime=0))
    (folder / "t10k-images-idx3-ubyte.gz").write_bytes(gzip.compress(idx_bytes(train_x[:40]), mtime=0))
    from storage_io import sha256_file

    return RawData(**(raw | {"files": {name: sha256_file(folder / name) for name in raw["files"]}}))


def test_test_and_validation_rows_that_copy_training_images_are_counted_named_and_kept_in_the_manifest(tmp_path, layout):
    """Issue 66: a test split of exact copies of training rows scored 100% with no word. Copies of images that went
    to validation (row_id % 4 == 3 here) are not training images, but row 7's is row 0's: 31 of the 40 test rows
    copy a training image."""
    from reporting.report_text import leakage_warning
    from storage_io import read_json

    raw = _raw_with_copies(tmp_path / "raw")
    dataset = to_parquet.fn(raw, CFG, layout)
    assert dataset.leakage == {"val": 1, "test": 31}
    line = dataset.terminal_detail()
    assert ("leakage: 31 of 40 test rows (row_id 120, 121, 122, 124, 125, ...) and 1 of 30 validation rows (row_id 7) "
            "are exact copies of training images: their scores overstate what the model learned") in line
    recorded = read_json(Path(dataset.directory) / MANIFEST)["leakage"]
    assert recorded == {"test": {"rows": 31, "row_ids": [120, 121, 122, 124, 125]}, "val": {"rows": 1, "row_ids": [7]}}
    again = to_parquet.fn(raw, CFG, layout)  # reused: the manifest's count, the same line
    assert again.skipped and again.leakage == dataset.leakage and line.split("; ", 1)[1] in again.terminal_detail()
    assert leakage_warning(again).startswith("31 of the 40 test images and 1 of the 30 validation images are exact copies")

    clean = to_parquet.fn(RawData(**write_raw(tmp_path / "clean")), CFG, layout)
    assert clean.leakage == {"val": 0, "test": 0} and "leakage" not in clean.terminal_detail() and leakage_warning(clean) == ""


def test_leakage_error_fails_the_stage_naming_the_copies_and_the_setting(tmp_path, layout):
    from tasks.to_parquet import LeakageError

    raw = _raw_with_copies(tmp_path / "raw")
    strict = CFG.model_copy(update={"leakage": "error"})
    assert dataset_fingerprint(raw, strict) == dataset_fingerprint(raw, CFG)  # the same data is the same dataset
    with pytest.raises(LeakageError, match=r"31 of 40 test rows .* exact copies of training images: .*; parquet.leakage is error"):
        to_parquet.fn(raw, strict, layout)
    assert "leakage" not in CFG.model_dump() and strict.model_dump()["leakage"] == "error"  # a default leaves fingerprints as they were


def test_a_file_replaced_keeping_its_size_and_time_is_read_again_before_its_old_dataset_is_reused(tmp_path, layout):
    """Issue 66: a user's file replaced by one of the same size and modification time kept the sha256 the listing cache
    had for it, so a forced retrain (``--no-promote.skip-unchanged``) reused the old dataset. Real parts: a Parquet folder
    (uncompressed, so two rows swapped keep the file's size), the download stage with its listing cache on the root."""
    import os

    import pyarrow as pa
    import pyarrow.parquet as pq

    from dataset.formats.listing import cache_path
    from pipeline_config import DownloadConfig
    from storage_io import sha256_file
    from tasks.download import download
    from tests.support.parquet_hf import hf_metadata, shapes

    def write(path: Path, order: list[int]) -> None:
        encoded, labels = shapes(4, seed=0)
        table = pa.table({"image": pa.array([encoded[i] for i in order], pa.binary()), "label": pa.array([labels[i] for i in order])})
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table.replace_schema_metadata(hf_metadata(["blue_cross", "green_disc", "red_square"])), path,
                       compression="none", use_dictionary=False)

    data = tmp_path / "hf"
    rows = list(range(12))
    write(data / "train.parquet", rows)
    write(data / "test.parquet", rows)
    cfg, parquet = DownloadConfig(source="parquet", path=str(data)), ParquetConfig()
    listed = download.fn(cfg, layout)
    first = to_parquet.fn(listed, parquet, layout)
    assert Path(cache_path(layout.root, str(data))).is_file()

    before = (data / "train.parquet").stat()
    write(data / "train.parquet", [1, 0, *rows[2:]])  # two images of two classes swapped: other data, same bytes count
    os.utime(data / "train.parquet", ns=(before.st_atime_ns, before.st_mtime_ns))
    after = (data / "train.parquet").stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    raw = download.fn(cfg, layout)  # the listing cache vouches for the old sha256: the premise of the case
    assert raw.files == listed.files and raw.files["train.parquet"] != sha256_file(data / "train.parquet")
    second = to_parquet.fn(raw, parquet, layout)
    assert not second.skipped and second.directory != first.directory  # before: the old dataset, reused
    assert ("1 file(s) changed keeping their size and modification time (train.parquet): their content read again"
            in second.terminal_detail())
    assert not Path(cache_path(layout.root, str(data))).exists()  # the cache that vouched for it is gone
    third = to_parquet.fn(download.fn(cfg, layout), parquet, layout)  # the next run: the new dataset, by its own sha256
    assert third.skipped and third.directory == second.directory and "changed keeping" not in third.terminal_detail()
