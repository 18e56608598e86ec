"""The transform's settings made concrete for one dataset: normalization and augmentation.

``transform.mean``/``std`` unset: an image or Parquet folder is normalized by its training split's own
per-channel mean and standard deviation, measured here in one streamed pass over the split's
Parquet files (a row group at a time, so memory stays flat at any size); MNIST's IDX sources keep
the seeds' 0.5 / 0.5. ``transform.augment: auto`` becomes the choice for the data's source. Both
defaults are the source's (`dataset.sources.interface.defaults_for`, by the dataset's ``source``). The transform stage resolves the config once; training,
evaluation, the checkpoint and the model card (and so ``flows.predict``) all use the resolved one.
"""

from __future__ import annotations

import numpy as np
import pyarrow.dataset as pads

from dataset.formats.parquet import ParquetDataset, images_from_column
from dataset.sources.interface import defaults_for
from pipeline_config import TransformConfig
from storage_io import filesystem

MIN_STD = 1e-3  # a channel that never changes (a constant background) is not divided by zero


def channel_stats(dataset: ParquetDataset, split: str = "train") -> tuple[list[float], list[float]]:
    """Per-channel (mean, std) of ``split``'s pixels on the 0..1 scale, streamed from its Parquet files."""
    channels = dataset.image_shape[0]
    fs, path = filesystem(dataset.split_dir(split))
    files = pads.dataset(path, format="parquet", filesystem=fs)
    total, total_sq, count = np.zeros(channels), np.zeros(channels), 0
    for batch in files.to_batches(columns=["image"], batch_size=4096):
        pixels = images_from_column(batch.column("image")).reshape(-1, channels)  # stored height x width x channels
        total += pixels.sum(axis=0, dtype=np.float64)
        total_sq += np.square(pixels, dtype=np.float64).sum(axis=0)
        count += len(pixels)
    return from_sums(total, total_sq, count)


def from_sums(total: np.ndarray, total_sq: np.ndarray, count: int) -> tuple[list[float], list[float]]:
    """Per-channel (mean, std) on the 0..1 scale from sums of uint8 pixel values and their squares over ``count`` pixels."""
    if count == 0:
        return [0.5] * len(total), [0.5] * len(total)
    mean = total / count / 255.0
    std = np.sqrt(np.maximum(total_sq / count / 255.0**2 - mean**2, 0.0))
    return [round(float(m), 5) for m in mean], [round(float(max(s, MIN_STD)), 5) for s in std]


def resolve(cfg: TransformConfig, dataset: ParquetDataset) -> TransformConfig:
    """``cfg`` with mean, std (one number per channel) and augment made concrete for ``dataset``."""
    channels = dataset.image_shape[0]
    defaults = defaults_for(dataset.source)  # the source's: measured or the seeds' 0.5 / 0.5, its augmentation
    if defaults.measure_stats and (cfg.mean is None or cfg.std is None):
        measured = channel_stats(dataset)
        mean = measured[0] if cfg.mean is None else cfg.per_channel(channels)[0]
        std = measured[1] if cfg.std is None else cfg.per_channel(channels)[1]
    else:
        mean, std = cfg.per_channel(channels)
    augment = defaults.augment if cfg.augment == "auto" else cfg.augment
    return cfg.model_copy(update={"mean": mean, "std": std, "augment": augment})
