"""Small real datasets for the gate's tests: splits written in the dataset's Parquet layout (what the conversion
writes), with a manifest the registry's data hash reads; 8x8 digits made from the bundled MNIST sample (also as
an image folder), and noise images where nothing can be learned."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from dataset.formats.idx import read_idx
from dataset.formats.parquet import ParquetDataset, to_table
from storage_io import MANIFEST
from tests.support.cli import ROOT

SAMPLE = ROOT / "data" / "mnist-sample"
TRAIN_ROWS, TEST_ROWS = 1257, 540


def sample_digits(count: int) -> tuple[np.ndarray, np.ndarray]:
    """The bundled sample's first ``count`` test digits (28x28 uint8) and labels."""
    return read_idx(SAMPLE / "t10k-images-idx3-ubyte.gz")[:count], read_idx(SAMPLE / "t10k-labels-idx1-ubyte.gz")[:count]


def digits_8x8() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(train images, train labels, test images, test labels): 8x8 uint8 digits from the bundled sample, the
    28x28 digit's central 24x24 averaged over 3x3 blocks and kept to 17 gray levels (as the classic set)."""
    def small(images: np.ndarray) -> np.ndarray:
        blocks = images[:, 2:26, 2:26].astype(np.float32).reshape(-1, 8, 3, 8, 3).mean(axis=(2, 4))
        return (np.round(blocks / 255 * 16) * (255 / 16)).clip(0, 255).astype(np.uint8)

    rng = np.random.default_rng(0)
    train_x, train_y = read_idx(SAMPLE / "train-images-idx3-ubyte.gz"), read_idx(SAMPLE / "train-labels-idx1-ubyte.gz")
    test_x, test_y = read_idx(SAMPLE / "t10k-images-idx3-ubyte.gz"), read_idx(SAMPLE / "t10k-labels-idx1-ubyte.gz")
    train, test = rng.choice(len(train_x), TRAIN_ROWS, replace=False), rng.choice(len(test_x), TEST_ROWS, replace=False)
    return small(train_x[train]), train_y[train].astype(np.int64), small(test_x[test]), test_y[test].astype(np.int64)


def write_digit_folder(root: Path) -> Path:
    """The 8x8 digits as an image folder: ``train/<digit>/*.png``, ``test/<digit>/*.png``."""
    from PIL import Image

    train_x, train_y, test_x, test_y = digits_8x8()
    for split, images, labels in (("train", train_x, train_y), ("test", test_x, test_y)):
        for i, (image, label) in enumerate(zip(images, labels, strict=True)):
            folder = root / split / str(label)
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(image, "L").save(folder / f"{i:05d}.png")
    return root


def digit_dataset(directory: Path, shuffle_train_labels: bool = False) -> ParquetDataset:
    """The 8x8 digits in the dataset's Parquet layout (what the conversion writes), as a folder's dataset."""
    train_x, train_y, test_x, test_y = digits_8x8()
    if shuffle_train_labels:
        train_y = np.random.default_rng(1).permutation(train_y)
    for split, images, labels in (("train", train_x, train_y), ("test", test_x, test_y)):
        (directory / split).mkdir(parents=True)
        pq.write_table(to_table(np.arange(len(labels)), images.reshape(len(images), -1), labels), directory / split / "part-0.parquet")
    (directory / MANIFEST).write_text(json.dumps({"fingerprint": "digits"}))  # what the registry's data hash reads
    return ParquetDataset(
        directory=str(directory), fingerprint="digits", rows={"train": TRAIN_ROWS, "val": 0, "test": TEST_ROWS},
        image_shape=(1, 8, 8), classes=[str(d) for d in range(10)], source="folder",
    )


def parquet_dataset(
    directory: Path, splits: dict[str, tuple[np.ndarray, np.ndarray]], classes: list[str], shape: tuple[int, int, int],
) -> ParquetDataset:
    """``splits``: split name -> (uint8 images, int labels), written as ``<split>/part-0.parquet``; a folder's dataset."""
    rows, start = {"train": 0, "val": 0, "test": 0}, 0
    for split, (images, labels) in splits.items():
        (directory / split).mkdir(parents=True)
        ids = np.arange(start, start + len(labels))
        pq.write_table(to_table(ids, images.reshape(len(images), -1), np.asarray(labels)), directory / split / "part-0.parquet")
        rows[split], start = len(labels), start + len(labels)
    (directory / MANIFEST).write_text(json.dumps({"fingerprint": directory.name}))  # what the registry's data hash reads
    return ParquetDataset(directory=str(directory), fingerprint=directory.name, rows=rows, image_shape=shape,
                          classes=classes, source="folder")


def noise(counts: list[int], seed: int, shape: tuple[int, int, int] = (1, 8, 8)) -> tuple[np.ndarray, np.ndarray]:
    """(images, labels): ``counts[i]`` images of class i whose pixels are uniform noise, nothing to tell the classes
    apart (a model of it can learn nothing), in a random order."""
    rng = np.random.default_rng(seed)
    labels = rng.permutation(np.repeat(np.arange(len(counts)), counts))
    return rng.integers(0, 256, size=(len(labels), int(np.prod(shape))), dtype=np.uint8), labels


def noise_dataset(directory: Path, train: list[int], test: list[int], classes: list[str]) -> ParquetDataset:
    """Noise images (`noise`) with ``train[i]`` / ``test[i]`` rows of class i."""
    return parquet_dataset(directory, {"train": noise(train, 1), "test": noise(test, 2)}, classes, (1, 8, 8))


def confusion_with(counts: list[int], correct: int) -> np.ndarray:
    """A 2-class confusion matrix with ``counts`` test rows per class and ``correct`` of them right, both classes
    getting some right (so only the accuracy decides)."""
    first = min(counts[0] - 1, correct - 1)
    second = correct - first
    return np.array([[first, counts[0] - first], [counts[1] - second, second]])
