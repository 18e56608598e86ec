"""The listing cache of an image folder (dataset/formats/listing.py): an unchanged folder is listed, not read again.

Real PNG folders in tmp_path (the tests' RGB workload, tests/support/images.py) and a real local
storage root. What was read is counted through the seams the cache saves: the hash
(`dataset.formats.listing.sha256_file`), the full decode (`dataset.formats.images.check_image`) and the header
read (`dataset.formats.folder_scan._read_image`), each wrapped to count and then do the real work.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from dataset.formats import folder, folder_scan, images, listing
from dataset.sources.interface import check_data, keep_checks
from pipeline_config import DownloadConfig, ParquetConfig
from storage_io import StorageLayout, read_json
from tasks.download import list_folder
from tasks.to_parquet import dataset_fingerprint
from tests.support.images import write_image_folder

LOG = logging.getLogger(__name__)
PER_CLASS = {"train": 4, "test": 2}  # 3 classes: 18 images


@pytest.fixture
def counted(monkeypatch):
    """{"hashed": n, "decoded": n, "opened": n}: the files read to be hashed, the images decoded in full
    and the images opened at all (header or decode) so far."""
    counts = {"hashed": 0, "decoded": 0, "opened": 0}
    real_hash, real_check, real_read = listing.sha256_file, images.check_image, folder_scan._read_image

    def hashed(path, *args, **kwargs):
        counts["hashed"] += 1
        return real_hash(path, *args, **kwargs)

    def decoded(data, *args, **kwargs):
        counts["decoded"] += 1
        return real_check(data, *args, **kwargs)

    def opened(*args, **kwargs):
        counts["opened"] += 1
        return real_read(*args, **kwargs)

    monkeypatch.setattr(listing, "sha256_file", hashed)
    monkeypatch.setattr(images, "check_image", decoded)
    monkeypatch.setattr(folder_scan, "_read_image", opened)
    return counts


def run_both(cfg: DownloadConfig, root: Path, counts: dict) -> tuple[dict, dict]:
    """check_data then list_folder, as a run does before its stages; (what they read, RawData.files)."""
    counts.update(hashed=0, decoded=0, opened=0)
    check_data(cfg, None, str(root))
    raw = list_folder(cfg, LOG, StorageLayout.create(str(root), "r"))
    read = dict(counts)
    assert read.pop("opened") == read["decoded"]  # a file decoded already is not opened for its header either
    return read, raw.files


def redraw(path: Path, seed: int) -> None:
    """Write another 20x20 RGB picture over ``path`` (other bytes)."""
    pixels = np.random.default_rng(seed).integers(0, 256, (20, 20, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)


def test_an_unchanged_folder_is_neither_hashed_nor_decoded_again_and_each_change_is_read(tmp_path, counted):
    data = write_image_folder(tmp_path / "images", PER_CLASS)
    cfg, root = DownloadConfig(source="folder", path=str(data)), tmp_path / "storage"

    first, files = run_both(cfg, root, counted)
    assert first == {"hashed": 18, "decoded": 18} and len(files) == 18
    assert run_both(cfg, root, counted) == ({"hashed": 0, "decoded": 0}, files)

    touched = data / "train" / "blue_cross" / "blue_cross-000.png"
    os.utime(touched, ns=(touched.stat().st_atime_ns, touched.stat().st_mtime_ns + 1_000_000_000))
    redraw(data / "test" / "red_square" / "red_square-001.png", seed=1)
    redraw(data / "train" / "green_disc" / "added.png", seed=2)
    (data / "train" / "red_square" / "red_square-003.png").unlink()
    read, changed = run_both(cfg, root, counted)
    assert read == {"hashed": 3, "decoded": 3}  # touched, redrawn, added; the removed one is gone
    assert "train/green_disc/added.png" in changed and "train/red_square/red_square-003.png" not in changed
    assert changed["test/red_square/red_square-001.png"] != files["test/red_square/red_square-001.png"]
    assert run_both(cfg, root, counted)[0] == {"hashed": 0, "decoded": 0}

    entries = read_json(listing.cache_path(str(root), str(data)))["files"]
    assert sorted(entries) == sorted(changed) and all(entry[4] == ["RGB", 20, 20] for entry in entries.values())
    assert not any(path.name.endswith(".json") for path in data.rglob("*"))  # nothing written in the user's folder


def test_a_check_at_a_looser_pixel_limit_is_not_reused_for_a_stricter_one(tmp_path, counted):
    data = write_image_folder(tmp_path / "images", PER_CLASS)
    root = str(tmp_path / "storage")
    for limit, decoded in ((10_000, 18), (20_000, 0), (10_000, 0), (400, 18), (10_000, 0)):
        counted["decoded"] = 0
        check_data(DownloadConfig(source="folder", path=str(data), max_image_pixels=limit), None, root)
        assert counted["decoded"] == decoded, limit
    with pytest.raises(folder.FolderError, match=r"blue_cross-000\.png: .*more than download.max_image_pixels \(399\)"):
        check_data(DownloadConfig(source="folder", path=str(data), max_image_pixels=399), None, root)


def test_a_file_cut_short_after_a_clean_check_is_refused_by_name(tmp_path, counted):
    data = write_image_folder(tmp_path / "images", PER_CLASS)
    cfg, root = DownloadConfig(source="folder", path=str(data)), str(tmp_path / "storage")
    check_data(cfg, None, root)
    cut = data / "test" / "green_disc" / "green_disc-000.png"
    cut.write_bytes(cut.read_bytes()[:-40])
    with pytest.raises(folder.FolderError, match=f"{cut}"):
        check_data(cfg, None, root)


def test_the_headers_read_by_the_check_give_the_conversion_its_shape_without_opening_a_file(tmp_path, counted):
    """What the model check, the flow's data check and the conversion ask (`image_shape`) comes from the
    headers `check_data` recorded; a changed file is opened again, and so is one that is now over a
    stricter pixel limit (whose own read names the limit). `image_shape` never writes the cache; what
    `check_data` learned is written once the run is past its checks (`keep_checks`)."""
    data = write_image_folder(tmp_path / "images", PER_CLASS)
    root = str(tmp_path / "storage")
    cfg = DownloadConfig(source="folder", path=str(data))
    check_data(cfg, None, root)
    layout = folder.check_folder(str(data))
    assert counted["opened"] == 18
    keep_checks(cfg, root)
    for image_size in (None, 32):
        counted["opened"] = 0
        assert folder_scan.image_shape(layout, image_size, root) == (3, image_size or 20, image_size or 20)
        assert counted["opened"] == 0
    assert folder_scan.image_shape(layout, None, None) == (3, 20, 20) and counted["opened"] == 18  # no root: no cache

    gray = data / "train" / "red_square" / "red_square-000.png"
    Image.fromarray(np.zeros((20, 24), dtype=np.uint8)).save(gray)  # now 24 wide, and gray
    counted["opened"] = 0
    with pytest.raises(folder.FolderError, match=rf"{gray}: 24x20 pixels, but .* is 20x20"):
        folder_scan.image_shape(layout, None, root)
    assert counted["opened"] >= 1
    where = listing.cache_path(root, str(data))
    assert read_json(where)["files"]["train/red_square/red_square-000.png"][4] == ["RGB", 20, 20]  # not written
    check_data(DownloadConfig(source="folder", path=str(data)), 16, root)  # resized: the sizes may differ
    keep_checks(cfg, root)
    assert read_json(where)["files"]["train/red_square/red_square-000.png"][4] == ["L", 24, 20]
    counted["opened"] = 0
    assert folder_scan.image_shape(layout, 16, root) == (3, 16, 16) and counted["opened"] == 0  # the others are still RGB
    with pytest.raises(folder.FolderError, match=r"-\d{3}\.png: 20x20 = 400 pixels, more than download.max_image_pixels \(399\)"):
        folder_scan.image_shape(layout, 16, root, max_pixels=399)
    assert counted["opened"] == 1


def test_a_cache_file_of_the_version_without_headers_is_still_used(tmp_path, counted):
    """A version 1 file (entries of four) written by an earlier release: no file is hashed or decoded again;
    the headers are read once and the file is written anew as version 2."""
    data = write_image_folder(tmp_path / "images", PER_CLASS)
    cfg, root = DownloadConfig(source="folder", path=str(data)), tmp_path / "storage"
    files = run_both(cfg, root, counted)[1]
    where = Path(listing.cache_path(str(root), str(data)))
    cache = json.loads(where.read_text())
    where.write_text(json.dumps({**cache, "version": 1, "files": {rel: e[:4] for rel, e in cache["files"].items()}}))
    counted.update(hashed=0, decoded=0, opened=0)
    check_data(cfg, None, str(root))
    assert list_folder(cfg, LOG, StorageLayout.create(str(root), "r")).files == files
    assert counted == {"hashed": 0, "decoded": 0, "opened": 18}
    assert json.loads(where.read_text()) == cache


@pytest.mark.parametrize("content", [
    b"{not json",
    b"[1, 2, 3]\n",
    json.dumps({"version": 1, "folder": "/somewhere/else", "files": {}}).encode(),
    json.dumps({"version": 99, "files": {}}).encode(),
    "bad entry",
], ids=["not-json", "a-list", "another-folder", "another-version", "a-bad-entry"])
def test_a_damaged_or_foreign_cache_file_is_ignored(tmp_path, counted, content):
    data = write_image_folder(tmp_path / "images", PER_CLASS)
    cfg, root = DownloadConfig(source="folder", path=str(data)), tmp_path / "storage"
    files = run_both(cfg, root, counted)[1]
    where = Path(listing.cache_path(str(root), str(data)))
    if content == "bad entry":  # one entry whose sha256 is not one: the whole file is distrusted
        cache = json.loads(where.read_text())
        cache["files"]["test/blue_cross/blue_cross-000.png"][2] = "not a sha256"
        content = json.dumps(cache).encode()
    where.write_bytes(content)
    assert run_both(cfg, root, counted) == ({"hashed": 18, "decoded": 18}, files)
    assert run_both(cfg, root, counted)[0] == {"hashed": 0, "decoded": 0}  # written anew


def test_the_fingerprint_is_the_same_with_and_without_the_cache_and_follows_an_image(tmp_path, counted):
    data = write_image_folder(tmp_path / "images", PER_CLASS)
    cfg, parquet = DownloadConfig(source="folder", path=str(data)), ParquetConfig()
    layout = StorageLayout.create(str(tmp_path / "storage"), "r")

    def fingerprint(with_cache: bool) -> str:
        return dataset_fingerprint(list_folder(cfg, LOG, layout if with_cache else None), parquet)

    before = fingerprint(False)
    assert fingerprint(True) == before and fingerprint(True) == before  # cold, then warm
    assert counted["hashed"] == 18 + 18 + 0
    redraw(data / "train" / "blue_cross" / "blue_cross-002.png", seed=3)
    after = fingerprint(True)
    assert after != before and after == fingerprint(False)


def test_a_bucket_folder_on_a_bucket_root_is_listed_not_read_again(tmp_path, s3_root, counted):
    """download.path and storage_root both s3:// (moto's S3 server on 127.0.0.1): sizes and LastModified
    from one listing of the bucket; the cache is an object under the root's listings/."""
    import boto3

    local = write_image_folder(tmp_path / "images", PER_CLASS)
    data = f"{s3_root}/images"
    bucket, _, prefix = data.removeprefix("s3://").partition("/")
    client = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])
    for path in sorted(local.rglob("*.png")):
        client.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(local).as_posix()}")
    cfg, layout = DownloadConfig(source="folder", path=data), StorageLayout.create(s3_root, "r")

    files = list_folder(cfg, LOG, layout).files
    assert counted["hashed"] == 18 and read_json(listing.cache_path(s3_root, data))["folder"] == data
    assert list_folder(cfg, LOG, layout).files == files and counted["hashed"] == 18
    rel = "test/blue_cross/blue_cross-001.png"
    redraw(local / rel, seed=4)
    client.upload_file(str(local / rel), bucket, f"{prefix}/{rel}")
    changed = list_folder(cfg, LOG, layout).files
    assert counted["hashed"] == 19 and changed[rel] != files[rel]


def test_the_benchmark_prints_its_table(capsys):
    from benchmarks.data import listing as bench

    assert bench.main(["--images", "20", "--repeat", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("20 RGB 64x64 PNGs, 10 classes") and "cache file" in lines[0]
    assert [line.split("  ")[0] for line in lines[2:]] == ["no cache", "cold cache (first run)", "warm cache, unchanged"]
