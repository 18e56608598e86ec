"""Each file read once: a folder's listing never follows a link into the folder or around it, counts a file reached
twice once, and names the links it followed out of the folder (issue 66, item 3).

Real folders in tmp_path with real symbolic links: the tests' RGB image folder (tests/support/images.py), the
Hugging Face style Parquet files (tests/support/parquet_hf.py), and the loopback S3 server for an ``s3://`` prefix.
Before this, pyarrow's recursive listing followed ``train/a/loop -> ..`` forty levels deep: 1,640 images listed
for 40, class b's listed under class a, and 82 Parquet files for 2.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from dataset.formats import folder, watching
from dataset.formats.parquet_files import check_layout, listing_notes
from dataset.sources.interface import source_for
from pipeline_config import DownloadConfig
from storage_io import atomic_write_bytes, list_files, list_tree
from tests.support.images import write_image_folder
from tests.support.parquet_hf import write_hf_dataset

LOG = logging.getLogger(__name__)

PER_CLASS = {"train": 20, "test": 2}


def two_classes(root: Path) -> Path:
    """An image folder of classes a and b, 20 training images each."""
    return write_image_folder(root, PER_CLASS, classes=("a", "b"))


def test_a_link_loop_in_an_image_folder_lists_each_image_once_under_its_own_class(tmp_path):
    root = two_classes(tmp_path / "shapes")
    os.symlink("..", root / "train" / "a" / "loop")  # train/a/loop -> train/
    assert len(list_files(root / "train")) == 40  # was 1,640
    os.symlink("../../..", root / "train" / "b" / "up")  # around the dataset folder itself (two loops: was exponential)

    layout = folder.check_folder(str(root))
    assert layout.classes == ["a", "b"] and len(layout.files["train"]) == 40
    assert [rel for rel, label in layout.files["train"] if label == 0] == [f"train/a/a-{i:03d}.png" for i in range(20)]
    assert not any("/loop/" in rel or "/up/" in rel for rel, _ in layout.files["train"])
    note = layout.skipped_note()
    assert f"train/a/loop (a link to {(root / 'train').resolve()}, a folder that holds it: a loop)" in note
    assert f"train/b/up (a link to {tmp_path.resolve()}, a folder that holds it: a loop)" in note


def test_a_folder_or_file_reached_twice_is_listed_once_at_its_real_path(tmp_path):
    root = two_classes(tmp_path / "shapes")
    os.symlink("../b", root / "train" / "a" / "b-again")  # a class folder linked into another class
    os.symlink("../b/b-000.png", root / "train" / "a" / "copy.png")  # an image linked into another class
    assert len(list_files(root / "train")) == 40  # was 61: b's 20 images twice, one of them three times
    tree = list_tree(root / "train")
    assert "a/copy.png" not in tree.files and not tree.links_out
    assert dict(tree.skipped) == {
        "a/b-again": f"a link to {(root / 'train' / 'b').resolve()}, a folder listed already",
        "a/copy.png": "a link to a file listed already",
    }
    layout = folder.check_folder(str(root))
    assert sum(label == 1 for _, label in layout.files["train"]) == 20  # b's images once, as b's


def test_a_link_out_of_the_folder_is_followed_once_and_named_in_the_conversion_line(tmp_path):
    root = two_classes(tmp_path / "shapes")
    extra = write_image_folder(tmp_path / "elsewhere", {"more": 5}, seed=3, classes=("a",)) / "more" / "a"
    os.symlink(extra, root / "train" / "a" / "more")
    os.symlink(extra, root / "train" / "a" / "more-again")  # the same folder by a second link: listed once
    os.symlink(tmp_path / "elsewhere", extra / "back")  # a loop inside the linked folder: not followed

    layout = folder.check_folder(str(root))
    labels = dict(layout.files["train"])
    assert len(labels) == 45 and all(labels[f"train/a/more/a-{i:03d}.png"] == 0 for i in range(5))
    assert layout.links_out == (f"train/a/more -> {extra.resolve()}",)
    note = layout.skipped_note()
    assert f"1 link(s) out of {root} followed: train/a/more -> {extra.resolve()}" in note
    assert f"train/a/more-again (a link to {extra.resolve()}, a folder listed already)" in note
    assert source_for(DownloadConfig(source="folder", path=str(root))).fetch(None, LOG).notes == [note]  # said by the conversion


def test_a_parquet_folder_with_a_link_loop_lists_each_file_once_and_names_the_links(tmp_path):
    root = write_hf_dataset(tmp_path / "hf", {"train": 3, "test": 1})
    os.symlink("..", root / "data" / "loop")  # data/loop -> the dataset folder
    assert list_files(root, ".parquet") == ["data/test-00000-of-00001.parquet", "data/train-00000-of-00001.parquet"]
    layout = check_layout(str(root))
    assert layout.files == ["data/train-00000-of-00001.parquet", "data/test-00000-of-00001.parquet"]  # was 82 files
    assert len(layout.rows["train"]) == 9 and len(layout.rows["test"]) == 3

    outside = write_hf_dataset(tmp_path / "more", {"validation": 1})
    os.symlink(outside / "data", root / "extra")
    assert check_layout(str(root)).files[-2:] == ["extra/validation-00000-of-00001.parquet", "data/test-00000-of-00001.parquet"]
    assert listing_notes(str(root)) == [
        f"1 link(s) out of {root} followed: extra -> {(outside / 'data').resolve()}",
        f"1 link(s) in {root} not followed: data/loop (a link to {root.resolve()}, a folder that holds it: a loop)",
    ]
    assert source_for(DownloadConfig(source="parquet", path=str(root))).fetch(None, LOG).notes == listing_notes(str(root))


def test_a_missing_folder_or_a_file_lists_nothing_and_a_dangling_link_is_left_out(tmp_path):
    assert list_files(tmp_path / "absent") == [] and list_tree(tmp_path / "absent").skipped == ()
    (tmp_path / "file").write_text("x")
    assert list_files(tmp_path / "file") == []
    (tmp_path / "d").mkdir()
    os.symlink(tmp_path / "gone", tmp_path / "d" / "dangling")
    assert list_tree(tmp_path / "d") == ([], (), ())


def test_an_s3_prefix_lists_each_key_once(tmp_path, s3_root):
    for rel in ("train/a/1.png", "train/a/2.png", "train/b/1.png"):
        atomic_write_bytes(f"{s3_root}/shapes/{rel}", b"x")
    assert list_files(f"{s3_root}/shapes/train") == ["a/1.png", "a/2.png", "b/1.png"]
    assert list_tree(f"{s3_root}/shapes/train", ".png").links_out == ()


def test_the_watcher_lists_a_folder_with_a_link_loop_as_a_run_reads_it(tmp_path):
    """The data-event watcher (`dataset.formats.watching`) compares listings: a loop must not multiply its files either."""
    root = two_classes(tmp_path / "shapes")
    before = watching.listing(str(root))
    os.symlink("..", root / "train" / "a" / "loop")
    after = watching.listing(str(root))
    assert len(after) == 44 and after == before  # was 1,644: the loop adds nothing to watch
    stat = (root / "train" / "b" / "b-000.png").stat()
    assert after["train/b/b-000.png"] == [stat.st_size, stat.st_mtime_ns]
