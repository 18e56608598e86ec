"""One batch of Parquet rows made into training tensors, and the checks of what comes out: numpy only.

The functions a Ray Data task maps over a split (`prepare_batch`: reshape, per-row augmentation drawn
from (seed, epoch, row_id), normalization) and the transform stage's check of every batch
(`check_split`). `dataset.tensors.augment` imports torch only when a batch is augmented.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dataset.formats.parquet import images_from_column
from dataset.tensors.augment import augment as augment_images
from dataset.tensors.spec import MNIST_SHAPE


def to_chw(images: np.ndarray, shape: tuple[int, int, int]) -> np.ndarray:
    """(N, H*W*C) or (N, H, W, C) pixels as stored (height x width x channels) -> (N, C, H, W)."""
    channels, height, width = shape
    return images.reshape(-1, height, width, channels).transpose(0, 3, 1, 2)


def normalize(
    images: np.ndarray, mean: float | list[float], std: float | list[float], shape: tuple[int, int, int] = MNIST_SHAPE
) -> np.ndarray:
    """Pixels -> float32 (N, C, H, W), ``(x - mean) / std`` on the 0..1 scale; ``mean`` and ``std``: one
    number for every channel or one per channel.

    uint8 input (N, H*W*C) or (N, C, H, W) is scaled by 1/255 first (the seeds' ToTensor);
    float input is taken as already on the 0..1 scale. ``shape``: (C, H, W).
    """
    scaled = images.reshape(-1, *shape).astype(np.float32)
    if images.dtype == np.uint8:
        scaled /= np.float32(255.0)
    per_channel = (-1, 1, 1)  # (C, 1, 1): broadcast over rows, height and width
    return (scaled - np.asarray(mean, np.float32).reshape(per_channel)) / np.asarray(std, np.float32).reshape(per_channel)


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer on a uint64 array: a cheap, well-spread hash (wraps modulo 2**64)."""
    x = x + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def row_hash(row_ids: np.ndarray, seed: int, epoch: int, stream: int) -> np.ndarray:
    """A uint64 per row from (seed, epoch, stream, row_id): the same wherever and whenever it is computed."""
    parts = _mix64(np.array([seed, epoch, stream], dtype=np.uint64))
    key = _mix64(_mix64(parts[0:1] ^ parts[1:2] * _GOLDEN) ^ parts[2:3])
    return _mix64(np.asarray(row_ids).astype(np.uint64) ^ key)


def epoch_seed(seed: int, epoch: int) -> int:
    """The seed of epoch ``epoch``'s shuffle of the training rows (< 2**32, as Ray Data's shuffle needs)."""
    return int(row_hash(np.array([epoch]), seed, epoch, stream=0)[0] >> np.uint64(32))


def row_draws(row_ids: np.ndarray, seed: int, epoch: int) -> np.ndarray:
    """(N, 4) uniforms in [0, 1) per row for `random_affine`, fixed by (seed, epoch, row_id)."""
    bits = np.stack([row_hash(row_ids, seed, epoch, stream) for stream in (1, 2, 3, 4)], 1)
    return (bits >> np.uint64(11)).astype(np.float64) * 2.0**-53


def prepare_batch(
    batch: pa.Table,
    mean: float,
    std: float,
    augment: dict[str, float] | None = None,
    seed: int = 0,
    epoch: int = 0,
    shape: tuple[int, int, int] = MNIST_SHAPE,
) -> dict[str, np.ndarray]:
    """Parquet batch -> {"image": float32 (N,C,H,W), "label": int64 (N,), "row_id": int64 (N,)}.

    ``augment`` (training only): keyword arguments of `dataset.tensors.augment.augment` (shift_px, rotate_deg,
    scale); each row's transform is drawn from (seed, epoch, row_id), not from its batch.
    ``shape``: the dataset's (C, H, W).
    """
    row_ids = batch.column("row_id").to_numpy()
    images = to_chw(images_from_column(batch.column("image")), shape)
    if shape[0] == 1:
        images = images[:, 0]  # (N, H, W), as the seeds' digits always were
    if augment:
        images = augment_images(images, row_draws(row_ids, seed, epoch), **augment)
    return {
        "image": normalize(images, mean, std, shape),
        "label": batch.column("label").to_numpy().astype(np.int64),
        "row_id": row_ids.astype(np.int64),
    }


def drop_rows(batch: pa.Table, row_ids: np.ndarray) -> pa.Table:
    """``batch`` without the rows whose ``row_id`` is in ``row_ids`` (rows already trained on)."""
    keep = pc.invert(pc.is_in(batch.column("row_id"), value_set=pa.array(row_ids, type=pa.int64())))
    return batch.filter(keep)


CHECK_BATCH_BYTES = 16 << 20  # `check_split`'s batches: 4,096 MNIST digits, 341 64x64 RGB images


def check_rows(shape: tuple[int, int, int]) -> int:
    """Rows per batch `check_split` takes: about `CHECK_BATCH_BYTES` of float32 pixels."""
    return max(1, min(4096, CHECK_BATCH_BYTES // (4 * int(np.prod(shape)))))


def check_split(
    batches: Iterable[dict[str, np.ndarray]], expected_rows: int, name: str, shape: tuple[int, int, int] = MNIST_SHAPE,
    num_classes: int = 10,
) -> dict:
    """Check every numpy batch of one split (`split_batches`) against the dataset's (C, H, W) ``shape`` and
    ``num_classes``; return row count, label counts and pixel stats (overall, and per channel when
    there is more than one)."""
    shape = tuple(shape)
    channels = shape[0]
    rows, labels = 0, np.zeros(num_classes, dtype=np.int64)
    total, total_sq = np.zeros(channels), np.zeros(channels)
    for batch in batches:
        image, label = batch["image"], batch["label"]
        if image.dtype != np.float32 or image.shape[1:] != shape:
            raise ValueError(f"{name}: transform produced {image.dtype} {image.shape[1:]}, expected float32 {shape}")
        if not np.isfinite(image).all():
            raise ValueError(f"{name}: transform produced non-finite pixel values")
        if label.min(initial=0) < 0 or label.max(initial=0) > num_classes - 1:
            raise ValueError(f"{name}: labels outside 0..{num_classes - 1}")
        rows += len(label)
        total += image.sum(axis=(0, 2, 3), dtype=np.float64)
        total_sq += np.square(image, dtype=np.float64).sum(axis=(0, 2, 3))
        labels += np.bincount(label, minlength=num_classes)
    if rows != expected_rows:
        raise ValueError(f"{name}: transform yielded {rows} rows, the Parquet manifest says {expected_rows}")
    per_channel = rows * shape[1] * shape[2]
    mean = float(total.sum()) / (per_channel * channels) if rows else 0.0
    std = (float(total_sq.sum()) / (per_channel * channels) - mean**2) ** 0.5 if rows else 0.0
    out = {"rows": rows, "pixel_mean": round(mean, 5), "pixel_std": round(std, 5), "label_counts": labels.tolist()}
    if channels > 1:
        means = total / per_channel if rows else np.zeros(channels)
        stds = np.sqrt(np.maximum(total_sq / per_channel - means**2, 0)) if rows else np.zeros(channels)
        out |= {"channel_mean": [round(float(m), 5) for m in means], "channel_std": [round(float(v), 5) for v in stds]}
    return out
