"""What the data alone scores: the test split's rows per class and a nearest-centroid probe (`tasks.gate` judges them).

The probe reads the pixels the conversion wrote (Parquet, numpy only: no torch, no sklearn) in batches:
per-class pixel sums over at most `PROBE_TRAIN_ROWS` training rows, then the distance of every test image
to each class mean. Data too wide for that (classes x pixels over `PROBE_MAX_CELLS`) gets no probe. The
class counts read the test split's label column only. docs/design.md ("The gate") says why this probe.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pyarrow.parquet as pq
from pydantic import BaseModel

from dataset.formats.parquet import ParquetDataset, images_from_column
from storage_io import filesystem, join, list_files

PROBE_TRAIN_ROWS = 50_000  # training rows the centroids are made of (the first ones, in the dataset's order)
PROBE_MAX_CELLS = 20_000_000  # classes x pixels per image above which no probe runs (its centroids would not fit)
BATCH_ROWS = 4096


class Baseline(BaseModel):
    """The test split's rows per class and, when the probe ran, what the nearest-centroid probe scored on it."""

    test_counts: list[int]  # test rows of each class, in the dataset's class order
    probe: float | None = None  # the probe's accuracy on the test split; None: not run (too wide, no rows)
    probe_classes: int = 0  # the classes the probe could answer: those with training rows
    probe_answers: list[int] = []  # test rows the probe answered with each class

    @property
    def unrelated(self) -> float:
        """What the probe would score if its answers had nothing to do with the test labels: the sum over classes of
        its share of answers times the class's share of the test split (1/classes for even classes)."""
        if not self.rows or not self.probe_answers:
            return 0.0
        return sum(a * c for a, c in zip(self.probe_answers, self.test_counts, strict=True)) / self.rows**2

    @property
    def rows(self) -> int:
        return int(sum(self.test_counts))

    @property
    def majority(self) -> float:
        """The largest class's share of the test split: what always answering that class scores."""
        return max(self.test_counts) / self.rows if self.rows else 0.0


def class_counts(dataset: ParquetDataset) -> Baseline:
    """The test split's rows per class (its label column only; no probe)."""
    counts = np.zeros(dataset.num_classes, dtype=np.int64)
    for labels in _labels(dataset, "test"):
        counts += np.bincount(labels, minlength=dataset.num_classes)[: dataset.num_classes]
    return Baseline(test_counts=counts.tolist())


def centroid_probe(dataset: ParquetDataset) -> Baseline:
    """The test split's class counts and the nearest-centroid probe's accuracy on it (each class's mean
    training image; a test image gets the class of the nearest mean)."""
    counted = class_counts(dataset)
    k, width = dataset.num_classes, dataset.image_bytes
    if not counted.rows or k * width > PROBE_MAX_CELLS:
        return counted
    sums, counts, seen = np.zeros((k, width)), np.zeros(k), 0
    for images, labels in _batches(dataset, "train"):
        images, labels = images[: PROBE_TRAIN_ROWS - seen], labels[: PROBE_TRAIN_ROWS - seen]
        for label in np.unique(labels):
            chosen = images[labels == label]
            sums[label] += chosen.sum(axis=0, dtype=np.float64)
            counts[label] += len(chosen)
        seen += len(labels)
        if seen >= PROBE_TRAIN_ROWS:
            break
    present = counts > 0
    if not present.any():
        return counted
    centroids = (sums[present] / counts[present, None] / 255.0).astype(np.float32)
    names = np.flatnonzero(present)  # a class without training rows is never predicted
    squared = (centroids**2).sum(axis=1)
    correct, answers = 0, np.zeros(k, dtype=np.int64)
    for images, labels in _batches(dataset, "test"):
        pixels = images.astype(np.float32) / 255.0
        nearest = names[np.argmin(squared[None, :] - 2 * pixels @ centroids.T, axis=1)]  # |x|^2 is the same for every class
        correct += int((nearest[labels < k] == labels[labels < k]).sum())
        answers += np.bincount(nearest[labels < k], minlength=k)
    return counted.model_copy(update={
        "probe": correct / counted.rows, "probe_classes": int(present.sum()), "probe_answers": answers.tolist()})


def _batches(dataset: ParquetDataset, split: str) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(images as (N, bytes) uint8, labels) of ``split``, file by file, in batches of `BATCH_ROWS`."""
    for batch in _read(dataset, split, ["image", "label"]):
        yield images_from_column(batch.column(0)), batch.column(1).to_numpy().astype(np.int64)


def _labels(dataset: ParquetDataset, split: str) -> Iterator[np.ndarray]:
    for batch in _read(dataset, split, ["label"]):
        yield batch.column(0).to_numpy().astype(np.int64)


def _read(dataset: ParquetDataset, split: str, columns: list[str]):
    folder = dataset.split_dir(split)
    for name in list_files(folder, ".parquet"):
        fs, where = filesystem(join(folder, name))
        with fs.open_input_file(where) as handle:
            yield from pq.ParquetFile(handle).iter_batches(batch_size=BATCH_ROWS, columns=columns)
