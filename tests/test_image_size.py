"""``transform.image_size: auto``, the default (issue 66): tiny images enlarged to what the model needs, the size
chosen named in the transform's line, everything else kept as it was.

8x8 digits were trained at 8x8, where ResNet-18's stem leaves 2x2 for its convolutions (real 8x8 digits 96.11%,
the same at 32 px 99.81%). Real parts: Parquet folders of PNG pictures as the Hugging Face ``datasets`` library
writes them (converted without Ray), the download and to-parquet stages' own functions on a real storage root,
the bundled MNIST sample, the command line's checks before any work. What the enlarged images score against the
same images at 32 px is `benchmarks/data/tiny_images.py`'s, a full training run each (docs/performance.md).
"""

from __future__ import annotations

import numpy as np
import pytest

from dataset.tensors.spec import TransformSpec
from pipeline_config import DownloadConfig, ParquetConfig, PipelineConfig, TransformConfig
from pipeline_config.transform import AUTO_IMAGE_SIZE, AUTO_MIN_SIDE, auto_image_size
from tasks.download import download
from tasks.to_parquet import dataset_fingerprint, to_parquet
from tests.support.images import CLASSES
from tests.support.parquet_hf import shapes, write_table
from training.champion import unchanged


def hf_folder(root, size: int, gray: bool = True):
    """A Parquet folder of ``size`` x ``size`` pictures: train and test files, ClassLabel names."""
    for split, count, seed in (("train", 6, 0), ("test", 2, 1)):
        encoded, labels = shapes(count, seed, size=size, gray=gray)
        write_table(root / f"{split}.parquet", encoded, labels)
    return root


def test_auto_is_the_default_and_enlarges_only_images_under_its_least_side():
    assert TransformConfig().image_size == "auto" and PipelineConfig().transform.image_size == "auto"
    assert (AUTO_MIN_SIDE, AUTO_IMAGE_SIZE) == (16, 28)
    assert auto_image_size(8, 8) == 28 and auto_image_size(15, 40) == 28
    assert auto_image_size(16, 16) is None and auto_image_size(28, 28) is None and auto_image_size(64, 48) is None
    assert PipelineConfig.model_validate(PipelineConfig().model_dump(mode="json")).transform.image_size == "auto"
    with pytest.raises(ValueError):
        TransformConfig(image_size=2)  # an explicit size keeps its bounds


def test_tiny_images_are_converted_at_the_size_auto_chose_and_the_transform_line_names_it(tmp_path, layout):
    data = hf_folder(tmp_path / "digits8", 8)
    cfg = DownloadConfig(source="parquet", path=str(data))
    raw = download.fn(cfg, layout)
    dataset = to_parquet.fn(raw, ParquetConfig(), layout, "auto")
    assert dataset.image_shape == (1, 28, 28) and dataset.auto_from == (8, 8)  # before: (1, 8, 8)
    assert dataset_fingerprint(raw, ParquetConfig(), "auto", layout.root) == dataset.fingerprint == dataset_fingerprint(raw, ParquetConfig(), 28)
    spec = TransformSpec(dataset=dataset, config=TransformConfig(), checks={}, manifest="unused")
    assert spec.terminal_detail() == "; images enlarged from 8x8 to 28x28 (transform.image_size auto)"
    explicit = to_parquet.fn(raw, ParquetConfig(), layout, 28)  # the same dataset as --transform.image-size 28
    assert explicit.skipped and explicit.directory == dataset.directory and explicit.auto_from is None


def test_images_of_a_fair_size_keep_it_and_their_fingerprint(tmp_path, layout):
    data = hf_folder(tmp_path / "shapes20", 20, gray=False)
    raw = download.fn(DownloadConfig(source="parquet", path=str(data)), layout)
    dataset = to_parquet.fn(raw, ParquetConfig(), layout, "auto")
    assert dataset.image_shape == (3, 20, 20) and dataset.auto_from == (20, 20)
    assert dataset.fingerprint == dataset_fingerprint(raw, ParquetConfig(), None)  # the dataset it was before auto
    spec = TransformSpec(dataset=dataset, config=TransformConfig(), checks={}, manifest="unused")
    assert spec.terminal_detail() == "; images kept at 20x20 (transform.image_size auto)"


def test_mnist_keeps_its_28x28_digits_its_dataset_and_its_transform_line(layout):
    raw = download.fn(DownloadConfig(source="sample"), layout)
    dataset = to_parquet.fn(raw, ParquetConfig(), layout, "auto")
    assert dataset.image_shape == (1, 28, 28) and dataset.auto_from is None
    assert dataset.fingerprint == dataset_fingerprint(raw, ParquetConfig(), None)
    assert TransformSpec(dataset=dataset, config=TransformConfig(), checks={}, manifest="unused").terminal_detail() == ""


def test_auto_and_the_size_it_chose_are_the_same_recipe():
    """A champion trained before auto existed (image_size unset) or with the size auto chose: nothing new to train on
    when the data is the same (the data's fingerprint carries the size the images were converted to)."""
    ours = PipelineConfig().model_dump(mode="json")
    assert unchanged.differences(ours, PipelineConfig(transform={"image_size": None}).model_dump(mode="json")) == []
    assert unchanged.differences(ours, PipelineConfig(transform={"image_size": 28}).model_dump(mode="json")) == []


def test_tiny_images_pass_the_models_trial_before_any_work_enlarged(tmp_path):
    """7x7 pictures are too small for small_cnn (it halves them three times); auto enlarges them to 28x28 first, so
    the command line's checks pass where they refused the run (kept at 7x7, they still do)."""
    from flows.train import _CheckedTrainSettings
    from runner.harness import checked_settings

    data = hf_folder(tmp_path / "tiny7", 7)
    args = ["--download.source", "parquet", "--download.path", str(data), "--storage-root", str(tmp_path / "storage"),
            "--model.name", "training.model.catalog:small_cnn"]
    _, config, _ = checked_settings(args, _CheckedTrainSettings)
    assert config.transform.image_size == "auto"  # recorded as chosen: the card says auto, predict reads at the model's size
    with pytest.raises(ValueError, match="images of 7x7 pixels are too small"):
        checked_settings([*args, "--transform.image-size", "None"], _CheckedTrainSettings)


def test_predict_reads_images_at_the_models_size_for_a_card_of_auto(tmp_path):
    from PIL import Image

    from dataset.inputs.read import read_folder

    folder = tmp_path / "in" / CLASSES[0]
    folder.mkdir(parents=True)
    Image.fromarray(np.full((8, 8), 200, np.uint8), "L").save(folder / "a.png")
    table = read_folder(tmp_path / "in", (1, 28, 28), list(CLASSES), "auto")
    assert table.schema.field("image").type.byte_width == 28 * 28 and table.column("label").to_pylist() == [0]
