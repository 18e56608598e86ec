"""``download.source=parquet``: a folder of Parquet files as the Hugging Face ``datasets`` library writes them.

Real Parquet files written with pyarrow in tmp_path (`tests.support.parquet_hf`: an Image feature's struct of
PNG bytes, a ClassLabel's names in the schema metadata, ``data/train-00000-of-00001.parquet``), a real storage
root, the real loopback S3 server for an ``s3://`` folder. The refusals go through the command line's own entry
(`flows.train.main`) in this process: exit 2, naming the field or the file, and nothing written. The end-to-end
test trains such a dataset through ``flows.train`` with a model of its own and scores it with ``flows.predict``.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from dataset.formats import watching
from dataset.formats.parquet import verify_manifest
from dataset.formats.parquet_files import ParquetSourceError, check_layout, split_of
from dataset.inputs.read import read_folder
from dataset.sources.interface import (
    RawData,
    best_config_data,
    check_data,
    defaults_for,
    keep_checks,
    known_before_work,
    source_class,
    source_for,
    source_of,
    watched,
)
from dataset.sources.writer import convert
from pipeline_config import DownloadConfig, ParquetConfig, PipelineConfig
from pipeline_config.sources import SOURCES
from storage_io import StorageLayout, atomic_write_bytes, read_json
from tests.support.images import CLASSES, SIZE
from tests.support.parquet_hf import png, shapes, write_hf_dataset, write_table

LOG = logging.getLogger(__name__)
TINY_NET = '''
from torch import nn


def tiny_net(in_channels: int, num_classes: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(in_channels, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(32, num_classes),
    )
'''


def config(path: Path | str, **download) -> DownloadConfig:
    return DownloadConfig(source="parquet", path=str(path), **download)


# --------------------------------------------------------------------------- the layout


@pytest.mark.parametrize(("rel", "split"), [
    ("data/train-00000-of-00001.parquet", "train"), ("default/train/0000.parquet", "train"), ("train/part-1.parquet", "train"),
    ("data/validation-00000-of-00001.parquet", "val"), ("valid.parquet", "val"), ("val/0.parquet", "val"),
    ("test.parquet", "test"), ("plain_text/test-00000-of-00002.parquet", "test"), ("data/other.parquet", None),
    ("trainer/x.parquet", None),
])
def test_the_split_is_read_from_the_file_or_folder_name(rel, split):
    assert split_of(rel) == split


def test_a_name_that_names_two_splits_is_refused():
    with pytest.raises(ParquetSourceError, match="names more than one split"):
        split_of("train/test-0.parquet")


def test_a_hub_dataset_is_checked_listed_fingerprinted_and_converted(tmp_path):
    root = write_hf_dataset(tmp_path / "hf-shapes", {"train": 10, "test": 4})
    storage = str(tmp_path / "storage")
    source = source_for(config(root))
    checked = source.check(None, storage)
    assert checked.classes == list(CLASSES)  # the ClassLabel's names, from the schema's Hugging Face metadata
    layout = check_layout(str(root))
    assert len(layout.rows["train"]) == 30 and len(layout.rows["test"]) == 12 and not layout.has_val
    assert checked.for_trial() == ((3, SIZE, SIZE), 3)
    assert source.check(16, storage, decode=False) == ((3, 16, 16), list(CLASSES))
    assert not (tmp_path / "storage").exists()  # the check holds what it learned; nothing written before the run goes on
    keep_checks(source.cfg, storage)
    assert list((tmp_path / "storage" / "listings").iterdir())  # the listing cache, on the storage root

    raw = source.fetch(StorageLayout.create(storage, "r"), LOG)
    assert raw.source == "parquet" and set(raw.files) == {"data/train-00000-of-00001.parquet", "data/test-00000-of-00001.parquet"}
    assert raw.options == {"image_column": "image", "label_column": "label"} and raw.deletable() == []  # the user's: never deleted
    again = source_of(raw)
    fingerprint = again.fingerprint(raw, ParquetConfig(), None)
    assert fingerprint == source_of(raw).fingerprint(raw, ParquetConfig(), None)
    assert fingerprint != again.fingerprint(raw, ParquetConfig(), 16)
    assert fingerprint != again.fingerprint(raw.model_copy(update={"options": {**raw.options, "label_column": "y"}}), ParquetConfig(), None)

    final = tmp_path / "storage" / "datasets" / f"hf-shapes-{fingerprint}"
    dataset = convert(again, raw, ParquetConfig(), str(final), fingerprint, LOG, None, 50_000_000, storage)
    assert dataset.source == "parquet" and dataset.image_shape == (3, SIZE, SIZE) and dataset.classes == list(CLASSES)
    assert dataset.rows == {"train": 27, "val": 3, "test": 12}  # one of each class's ten held out for validation
    assert verify_manifest(str(final), fingerprint) is not None
    manifest = read_json(final / "_manifest.json")
    assert manifest["image"] == {"channels": 3, "height": SIZE, "width": SIZE} and manifest["classes"] == list(CLASSES)
    test = pq.read_table(final / "test")
    encoded, labels = shapes(4, seed=1)  # the test split as written: its first picture, decoded, is its first row
    assert test.column("label").to_pylist() == labels
    import io

    from PIL import Image
    first = np.asarray(Image.open(io.BytesIO(encoded[0])).convert("RGB")).reshape(-1)
    assert np.array_equal(np.frombuffer(test.column("image")[0].as_py(), dtype=np.uint8), first)
    assert sorted(p.name for p in root.rglob("*")) == ["data", "test-00000-of-00001.parquet", "train-00000-of-00001.parquet"]


def test_split_folders_a_validation_split_string_labels_and_plain_binary(tmp_path):
    root = write_hf_dataset(tmp_path / "folders", {"train": 4, "validation": 2, "test": 2}, layout="folders")
    layout = check_layout(str(root))
    assert layout.has_val and len(layout.rows["val"]) == 6 and layout.files == ["default/train/0000.parquet", "default/validation/0000.parquet", "default/test/0000.parquet"]
    raw = source_for(config(root)).fetch(None, LOG)
    dataset = convert(source_of(raw), raw, ParquetConfig(), str(tmp_path / "out"), "f", LOG, None, None, None)
    assert dataset.rows == {"train": 12, "val": 6, "test": 6}

    encoded, labels = shapes(3, seed=0)
    names = [CLASSES[label] for label in labels]
    write_table(tmp_path / "named" / "train.parquet", encoded, names, names=None, struct=False)  # strings, plain binary
    write_table(tmp_path / "named" / "test.parquet", encoded[:3], names[:3], names=None, struct=False)
    assert check_layout(str(tmp_path / "named")).classes == sorted(set(names))
    write_table(tmp_path / "ints" / "train.parquet", encoded, labels, names=None)  # integers without names: 0, 1, 2
    write_table(tmp_path / "ints" / "test.parquet", encoded[:3], labels[:3], names=None)
    assert check_layout(str(tmp_path / "ints")).classes == ["0", "1", "2"]


def test_a_sixteen_bit_grayscale_image_is_scaled_to_eight_bits(tmp_path):
    deep = [png(np.full((8, 8), value, dtype=np.uint16)) for value in (65535, 32768, 0, 256)]  # PIL reads them as I;16
    write_table(tmp_path / "deep" / "train.parquet", deep, [0, 1, 0, 1], names=["a", "b"])
    write_table(tmp_path / "deep" / "test.parquet", deep[:2], [0, 1], names=["a", "b"])
    source = source_for(config(tmp_path / "deep"))
    assert source.check(None, None).for_trial() == ((1, 8, 8), 2)
    raw = source.fetch(None, LOG)
    convert(source_of(raw), raw, ParquetConfig(), str(tmp_path / "out"), "d", LOG, None, None, None)
    test = pq.read_table(tmp_path / "out" / "test").sort_by("row_id")
    assert [np.frombuffer(v.as_py(), dtype=np.uint8)[0] for v in test.column("image")] == [255, 128]


def test_each_source_has_its_module_defaults_and_cleanup_rule(tmp_path):
    assert {name: source_class(name).kind for name in SOURCES} == {
        "auto": "idx", "official": "idx", "mirror": "idx", "sample": "idx", "folder": "folder", "parquet": "parquet"}
    assert defaults_for("idx") == (False, "affine", "zeros") and defaults_for("folder") == defaults_for("parquet") == (True, "shifts", "border")
    idx = RawData(source="sample", url="file:///x/", directory=str(tmp_path / "raw" / "sample"), files={}, skipped=True)
    assert idx.deletable() == [str(tmp_path / "raw" / "sample")]
    assert RawData(source="folder", url="/x", directory="/x", files={}, skipped=False).deletable() == []
    assert best_config_data(config(tmp_path / "hf", image_column="img")) == {
        "source": "parquet", "path": str(tmp_path / "hf"), "image_column": "img", "label_column": "label"}
    assert best_config_data(DownloadConfig()) is None
    assert watched(DownloadConfig()) is None and watched(config(tmp_path)) == str(tmp_path)


def test_the_config_names_the_field():
    with pytest.raises(ValidationError, match="source=parquet needs download.path"):
        DownloadConfig(source="parquet")
    with pytest.raises(ValidationError, match="image_column"):
        DownloadConfig(source="parquet", path="/x", image_column="")
    named = PipelineConfig.model_validate({"download": {"source": "parquet", "path": "/data/Flowers HF"}})
    assert named.workload == "flowers-hf"  # named after the folder, as an image folder's run is


# --------------------------------------------------------------------------- refused before any work


def refused(tmp_path: Path, capsys, root: Path, *args: str) -> str:
    """`flows.train`'s command line on ``root``: exit 2 and nothing written on the storage root; its stderr."""
    from flows import train

    storage = tmp_path / "storage"
    code = train.main(["--storage-root", str(storage), "--workload", "hf", "--download.source", "parquet",
                       "--download.path", str(root), "--model.name", "training.model.catalog:small_cnn", *args])
    err = capsys.readouterr().err
    assert code == 2, err
    assert not storage.exists()
    return err


def good(tmp_path: Path, name: str = "hf", **per_class) -> Path:
    return write_hf_dataset(tmp_path / name, per_class or {"train": 3, "test": 1})


def test_a_missing_folder_files_or_split_is_refused_naming_the_path(tmp_path, capsys):
    assert f"download.path {tmp_path / 'absent'}: no such folder" in refused(tmp_path, capsys, tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    assert "no Parquet files (*.parquet)" in refused(tmp_path, capsys, tmp_path / "empty")
    root = good(tmp_path)
    (root / "data" / "test-00000-of-00001.parquet").unlink()
    assert f"download.path {root}: no test split" in refused(tmp_path, capsys, root)
    good(tmp_path, "other")
    shutil.copy(tmp_path / "other" / "data" / "train-00000-of-00001.parquet", tmp_path / "other" / "data" / "extra.parquet")
    assert f"{tmp_path / 'other'}/data/extra.parquet: its split is not in its name" in refused(tmp_path, capsys, tmp_path / "other")


def test_columns_of_another_name_or_type_are_refused_naming_the_field(tmp_path, capsys):
    root = good(tmp_path)
    train = f"{root}/data/train-00000-of-00001.parquet"  # train is checked first
    assert f"download.image_column 'picture': {train} has no such column" in refused(
        tmp_path, capsys, root, "--download.image-column", "picture")
    assert "download.label_column 'y': " in refused(tmp_path, capsys, root, "--download.label-column", "y")
    bad = write_table(tmp_path / "typed" / "train.parquet", [b"x"], [0.5], names=None)  # float labels
    write_table(tmp_path / "typed" / "test.parquet", [b"x"], [0.5], names=None)
    assert f"download.label_column 'label': in {bad} it is double" in refused(tmp_path, capsys, tmp_path / "typed")
    (root / "data" / "validation.parquet").write_bytes(b"PAR1 not really")
    assert f"{root}/data/validation.parquet: not a readable Parquet file" in refused(tmp_path, capsys, root)


def test_bad_images_are_refused_naming_the_file_and_row(tmp_path, capsys):
    encoded, labels = shapes(2, seed=0)
    damaged = [*encoded]
    damaged[1] = b"not a picture"
    damaged[4] = encoded[4][: len(encoded[4]) // 2]  # cut short
    path = write_table(tmp_path / "hf" / "train.parquet", damaged, labels)
    write_table(tmp_path / "hf" / "test.parquet", encoded, labels)
    assert f"{path} row 1: not a readable image" in refused(tmp_path, capsys, tmp_path / "hf")
    damaged[1] = encoded[1]
    write_table(path, damaged, labels)
    assert f"{path} row 4: " in refused(tmp_path, capsys, tmp_path / "hf")
    write_table(path, encoded, labels)
    out = refused(tmp_path, capsys, tmp_path / "hf", "--download.max-image-pixels", "100")
    assert f"{path} row 0: 20x20 = 400 pixels, more than download.max_image_pixels (100)" in out
    write_table(path, [*encoded[:-1], png(np.zeros((24, 24, 3), dtype=np.uint8))], labels)
    assert f"{path} row 5: 24x24 pixels, but row 0 is 20x20; set transform.image_size" in refused(tmp_path, capsys, tmp_path / "hf")


def test_labels_that_cannot_train_are_refused(tmp_path, capsys):
    encoded, labels = shapes(2, seed=0)
    path = write_table(tmp_path / "hf" / "train.parquet", encoded, [*labels[:-1], 7])
    write_table(tmp_path / "hf" / "test.parquet", encoded, labels)
    assert f"{path} row 5: label 7 in download.label_column 'label' is not one of the 3 classes" in refused(
        tmp_path, capsys, tmp_path / "hf")
    write_table(path, encoded, [0] * len(encoded))
    assert "the train split has one class (blue_cross)" in refused(tmp_path, capsys, tmp_path / "hf")
    write_table(path, encoded[:3], labels[:3])  # one row a class, no validation files
    assert "the validation split would be empty" in refused(tmp_path, capsys, tmp_path / "hf")
    write_table(path, encoded, labels)
    write_table(tmp_path / "hf" / "validation.parquet", [], [])
    assert "the validation split would be empty: its files (validation.parquet) hold no rows" in refused(
        tmp_path, capsys, tmp_path / "hf")


def test_files_whose_labels_would_mean_other_classes_are_refused_naming_both(tmp_path, capsys):
    """Issue 66: string labels in the train file and integers in the test file were read as indices into the sorted
    names (labels flipped, a 50% model promoted); a test file whose ClassLabel names come in another order trained to
    0.00% (only the first file's names were read). Both are refused before any work, naming the two files."""
    encoded, labels = shapes(2, seed=0)
    train = write_table(tmp_path / "mixed" / "train.parquet", encoded, [CLASSES[label] for label in labels], names=None)
    test = write_table(tmp_path / "mixed" / "test.parquet", encoded, labels, names=None)
    assert f"download.label_column 'label': {train} holds strings, {test} integers" in refused(tmp_path, capsys, tmp_path / "mixed")

    train = write_table(tmp_path / "order" / "train.parquet", encoded, labels)  # ClassLabel names in CLASSES' order
    reordered = ["red_square", "blue_cross", "green_disc"]
    test = write_table(tmp_path / "order" / "test.parquet", encoded, [reordered.index(CLASSES[label]) for label in labels],
                       names=reordered)
    assert (f"the ClassLabel names of {train} (blue_cross, green_disc, red_square) and of {test} (red_square, blue_cross, "
            "green_disc) differ in order") in refused(tmp_path, capsys, tmp_path / "order")
    write_table(test, encoded, labels, names=["blue_cross", "green_disc", "yellow_star"])
    assert f"and of {test} (blue_cross, green_disc, yellow_star) differ; " in refused(tmp_path, capsys, tmp_path / "order")
    write_table(test, encoded, labels, names=None)  # integers without names beside a ClassLabel: read with its names
    assert check_layout(str(tmp_path / "order")).classes == list(CLASSES)


# --------------------------------------------------------------------------- predict, watch, s3


def test_predict_reads_a_hub_split_by_its_class_names(tmp_path):
    encoded, labels = shapes(2, seed=3)
    write_table(tmp_path / "in" / "test-00000.parquet", encoded, labels)  # ClassLabel names = the model's classes
    table = read_folder(tmp_path / "in", (3, SIZE, SIZE), list(CLASSES))
    assert table.column("label").to_pylist() == labels and table.column("row_id").to_pylist() == list(range(6))
    reordered = ["red_square", "blue_cross", "green_disc"]  # another order in the file: mapped by name
    write_table(tmp_path / "in" / "test-00000.parquet", encoded, [reordered.index(CLASSES[label]) for label in labels], names=reordered)
    assert read_folder(tmp_path / "in", (3, SIZE, SIZE), list(CLASSES)).column("label").to_pylist() == labels
    write_table(tmp_path / "in" / "test-00001.parquet", encoded, [CLASSES[label] for label in labels], names=None)
    both = read_folder(tmp_path / "in", (1, 12, 12), list(CLASSES), image_size=12)  # resized, gray, ids across files
    assert both.column("row_id").to_pylist() == list(range(12)) and len(both.column("image")[0].as_py()) == 144
    write_table(tmp_path / "in" / "test-00001.parquet", encoded, ["cat"] * 6, names=None)
    with pytest.raises(ValueError, match=r"test-00001.parquet row 0: label 'cat' is not one of the model's classes"):
        read_folder(tmp_path / "in", (3, SIZE, SIZE), list(CLASSES))


def test_the_watcher_watches_a_parquet_folder(tmp_path):
    from deployments.reacting import watched_config

    root = good(tmp_path)
    (root / "README.md").write_text("not data")
    assert set(watching.listing(str(root))) == {"data/train-00000-of-00001.parquet", "data/test-00000-of-00001.parquet"}
    file = tmp_path / "hf.yaml"
    file.write_text(json.dumps({"workload": "hf", "download": {"source": "parquet", "path": str(root)}}))
    watched = watched_config(file)
    assert watched.download.path == str(root) and watched.promote.skip_unchanged
    file.write_text(json.dumps({"download": {"source": "sample"}}))
    with pytest.raises(ValueError, match="set download.source: folder and download.path, the folder to watch"):
        watched_config(file)


def test_an_s3_folder_is_listed_and_converted_and_its_images_checked_by_the_conversion(tmp_path, s3_root):
    local = write_hf_dataset(tmp_path / "hf", {"train": 3, "test": 1})
    for path in local.rglob("*.parquet"):
        atomic_write_bytes(f"{s3_root}/hf/{path.relative_to(local).as_posix()}", path.read_bytes())
    remote = source_for(config(f"{s3_root}/hf"))
    checked = remote.check(None, None)  # footers and labels read; images first by the conversion
    assert checked.classes == list(CLASSES) and checked.for_trial() is None
    assert not known_before_work(remote.cfg)
    assert remote.check(None, None, decode=False) == ((None, None, None), list(CLASSES))
    raw = remote.fetch(None, LOG)
    dataset = convert(source_of(raw), raw, ParquetConfig(), str(tmp_path / "out"), "s", LOG, None, 50_000_000, None)
    assert dataset.rows == {"train": 6, "val": 3, "test": 3} and dataset.image_shape == (3, SIZE, SIZE)
    with pytest.raises(ParquetSourceError, match=f"download.path {s3_root}/absent: no such folder"):
        source_for(config(f"{s3_root}/absent")).check(None, None)


def test_the_check_before_work_is_the_sources_for_the_cli_and_the_flow(tmp_path):
    root = good(tmp_path)
    checked = check_data(config(root), None, None)  # what runner.harness and runner.pipeline_run call, for any source
    assert checked.classes == list(CLASSES) and checked.for_trial() == ((3, SIZE, SIZE), 3)
    assert check_data(DownloadConfig(source="sample")).for_trial() == ((1, 28, 28), 10)  # MNIST's, from the format


# --------------------------------------------------------------------------- end to end


@pytest.mark.slow
@pytest.mark.spine
def test_a_hub_parquet_dataset_trains_end_to_end_and_predicts(tmp_path, shared_server, shared_ray):
    """A Parquet dataset as `datasets` writes one, trained through ``python -m flows.train`` with a model of its
    own (a module in the user's folder, on the session's Ray and Prefect), then scored by ``flows.predict`` with
    the champion: the classes from the ClassLabel metadata in the manifest and the card, the predictions
    reproducing the evaluation's accuracy, the user's files untouched."""
    from tests.support.prefect_server import api_env
    from tests.support.ray_cluster import join_env

    (tmp_path / "my_models.py").write_text(TINY_NET)
    root = write_hf_dataset(tmp_path / "hf-shapes", {"train": 40, "test": 15})
    before = {p: p.read_bytes() for p in root.rglob("*.parquet")}
    env = {k: v for k, v in api_env(shared_server.api).items() if not k.startswith(("PIPELINE_", "PYTHONPATH"))}
    env |= join_env(shared_ray)

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900, check=False)

    out = run("flows.train", "--download.source", "parquet", "--download.path", "hf-shapes", "--model.name", "my_models:tiny_net",
              "--train.epochs", "20", "--train.global-batch-size", "16", "--evaluate.min-accuracy", "0.8")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "workload hf-shapes (from the folder's name" in out.stdout + out.stderr
    (run_dir,) = (tmp_path / "storage" / "runs").iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["data_source"] == "parquet" and summary["workload"] == "hf-shapes"
    assert summary["data"]["rows"] == {"train": 114, "val": 6, "test": 45}
    assert summary["evaluation"]["classes"] == list(CLASSES) and summary["test_accuracy"] >= 0.8
    (dataset_dir,) = (tmp_path / "storage" / "datasets").iterdir()
    assert read_json(dataset_dir / "_manifest.json")["classes"] == list(CLASSES)
    card = json.loads((tmp_path / "storage" / "models" / "hf-shapes-tiny-net" / "v1" / "model_card.json").read_text())
    assert card["data"]["classes"] == list(CLASSES) and card["architecture"]["in_channels"] == 3
    assert {p: p.read_bytes() for p in root.rglob("*.parquet")} == before  # read where it is, never changed

    (tmp_path / "score").mkdir()
    shutil.copy(root / "data" / "test-00000-of-00001.parquet", tmp_path / "score")
    scored = run("flows.predict", "--model", "hf-shapes-tiny-net", "--input", "score")
    assert scored.returncode == 0, scored.stdout[-3000:] + scored.stderr[-3000:]
    assert f"Accuracy: {summary['test_accuracy']:.2%} on 45 labelled images" in scored.stdout
    (predictions,) = (tmp_path / "storage" / "predictions").glob("hf-shapes-tiny-net-v1-*.parquet")
    assert set(pq.read_table(predictions).column("pred_class").to_pylist()) <= set(CLASSES)
