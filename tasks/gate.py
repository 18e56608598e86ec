"""The evaluation stage's gate: the test accuracy a run must reach, and where that number comes from.

In order, the first that applies:

1. ``evaluate.min_accuracy`` set (a flag, a preset, a config file, the deployment's form): that number,
   named as set by the user.
2. Data of a kind with a gate of its own (`pipeline_config.evaluation.OWN_GATES`: MNIST's IDX digits,
   97.5%): that gate.
3. A champion of the run's registry name: the champion's test accuracy, less three standard errors on
   this run's test split (`lower_bound`). A later run is held to the model it would replace, within
   what the test set's size can tell apart; promotion still needs it to beat the champion outright.
4. The data's own baseline, for a workload's first run: what a nearest-centroid classifier on the raw
   training pixels scores on the test split (`centroid_probe`), less three standard errors, and never
   below the test split's majority-class share. A network that does not beat the mean image of each
   class learned less than averaging the training set does; a model below the majority share learned
   nothing at all.

The probe reads the pixels the conversion wrote (Parquet, numpy only: no torch, no sklearn) in
batches: per-class pixel sums over at most `PROBE_TRAIN_ROWS` training rows, then the distance of every
test image to each class mean. Data too wide for that (classes x pixels over `PROBE_MAX_CELLS`) gets the
majority share only. docs/design.md ("The gate") says why these and not others.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import pyarrow.parquet as pq
from pydantic import BaseModel

from dataset.parquet import ParquetDataset, images_from_column
from pipeline_config import EvaluateConfig
from pipeline_config.evaluation import OWN_GATES
from storage_io import filesystem, join, list_files
from training import registry_files

Z = 3.0  # standard errors: the margin every derived gate leaves for the test set's noise
PROBE_TRAIN_ROWS = 50_000  # training rows the centroids are made of (the first ones, in the dataset's order)
PROBE_MAX_CELLS = 20_000_000  # classes x pixels per image above which no probe runs (its centroids would not fit)
BATCH_ROWS = 4096


class Gate(BaseModel):
    """The accuracy a run is held to and, in a phrase, where it came from (what the summary names)."""

    min_accuracy: float
    origin: str


def gate_for(cfg: EvaluateConfig, dataset: ParquetDataset, root: str, registry_name: str | None) -> Gate:
    """The run's gate (see the module's docstring); ``registry_name``: whose champion a later run is held to
    (None: promotion is off, so no champion)."""
    if cfg.min_accuracy is not None:
        return Gate(min_accuracy=cfg.min_accuracy, origin="evaluate.min_accuracy, as set")
    own = OWN_GATES.get(dataset.source)
    if own is not None:
        return Gate(min_accuracy=own, origin=f"the data's own gate ({dataset.source} data; evaluate.min_accuracy unset)")
    test_rows = int(dataset.rows.get("test", 0))
    champion = _champion(root, registry_name)
    if champion is not None:
        accuracy = float(champion["test_accuracy"])
        return Gate(
            min_accuracy=round(lower_bound(accuracy, test_rows), 4),
            origin=f"its champion {registry_name} v{champion['version']} ({accuracy:.2%}) less {Z:g} standard errors",
        )
    probe, majority = centroid_probe(dataset)
    if probe is None:
        return Gate(min_accuracy=round(majority, 4), origin=f"the data's baseline: the majority class share {majority:.2%}")
    gate = max(lower_bound(probe, test_rows), majority)
    return Gate(
        min_accuracy=round(gate, 4),
        origin=(f"the data's baseline: a nearest-centroid probe scored {probe:.2%}, less {Z:g} standard errors "
                f"(majority class {majority:.2%})"),
    )


def lower_bound(accuracy: float, n: int, z: float = Z) -> float:
    """The Wilson score interval's lower end: the lowest accuracy ``z`` standard errors allow for ``accuracy``
    scored on ``n`` images. Unlike p - z*sqrt(p(1-p)/n) it stays below 1 at p = 1 (a perfect probe on
    45 test images gives 0.83, on 10,000 gives 0.999)."""
    if n <= 0:
        return 0.0
    centre = accuracy + z * z / (2 * n)
    spread = z * math.sqrt(accuracy * (1 - accuracy) / n + z * z / (4 * n * n))
    return max(0.0, (centre - spread) / (1 + z * z / n))


def _champion(root: str, registry_name: str | None) -> dict | None:
    if not registry_name:
        return None
    try:
        return registry_files.read_champion(root, registry_name)
    except registry_files.RegistryDamaged:
        return None  # promotion names the damage; the data's baseline holds meanwhile


def centroid_probe(dataset: ParquetDataset) -> tuple[float | None, float]:
    """(nearest-centroid accuracy on the test split, or None when the data is too wide for it; the test
    split's majority-class share)."""
    k, width = dataset.num_classes, dataset.image_bytes
    test_counts = np.zeros(k, dtype=np.int64)
    for _, labels in _batches(dataset, "test"):
        test_counts += np.bincount(labels, minlength=k)[:k]
    total = int(test_counts.sum())
    majority = float(test_counts.max() / total) if total else 0.0
    if not total or k * width > PROBE_MAX_CELLS:
        return None, majority
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
        return None, majority
    centroids = (sums[present] / counts[present, None] / 255.0).astype(np.float32)
    names = np.flatnonzero(present)  # a class without training rows is never predicted
    squared = (centroids**2).sum(axis=1)
    correct = 0
    for images, labels in _batches(dataset, "test"):
        pixels = images.astype(np.float32) / 255.0
        nearest = names[np.argmin(squared[None, :] - 2 * pixels @ centroids.T, axis=1)]  # |x|^2 is the same for every class
        correct += int((nearest == labels).sum())
    return correct / total, majority


def _batches(dataset: ParquetDataset, split: str) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(images as (N, bytes) uint8, labels) of ``split``, file by file, in batches of `BATCH_ROWS`."""
    folder = dataset.split_dir(split)
    for name in list_files(folder, ".parquet"):
        fs, where = filesystem(join(folder, name))
        with fs.open_input_file(where) as handle:
            for batch in pq.ParquetFile(handle).iter_batches(batch_size=BATCH_ROWS, columns=["image", "label"]):
                yield images_from_column(batch.column(0)), batch.column(1).to_numpy().astype(np.int64)
