"""The transform's manifest and the budget that decides how a split is read: light, no Ray Data, no torch.

`TransformSpec` is what the transform stage hands to training, evaluation and promotion; it lives
here, apart from the Ray Data pipeline (`dataset.tensors.transform`) and the augmentation (torch), so a stage
that only reads the manifest (promotion, cleanup) imports neither.
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import ray
from pydantic import BaseModel

from dataset.formats.parquet import ParquetDataset
from pipeline_config import TransformConfig
from storage_io import join, read_json


class TransformSpec(BaseModel):
    """What training and evaluation read: the checked dataset plus the transform settings."""

    dataset: ParquetDataset
    config: TransformConfig
    checks: dict[str, dict]
    manifest: str
    skipped: bool = False  # the checks were recorded for this very dataset and config by an earlier run
    # The in-memory budget the transform stage settled (`transform.in_memory_mb`, or `auto_in_memory_mb`),
    # so every process that reads a split (each training rank, evaluation) takes the same path.
    in_memory_mb: int | None = None
    streamed: tuple[str, ...] = ()  # the splits over that budget, read in windows

    def budget_mb(self) -> int:
        """Decoded MB a split may have to be held in memory: the settled budget, the config's, or `auto_in_memory_mb`."""
        for value in (self.in_memory_mb, self.config.in_memory_mb):
            if value is not None:
                return value
        return auto_in_memory_mb()

    def terminal_detail(self) -> str:
        """What the transform stage's closing terminal line adds after its name and seconds: the checks reused, the
        size ``transform.image_size: auto`` chose, the splits streamed."""
        parts = [" (checks of this dataset and config reused)" if self.skipped else ""]
        if self.dataset.auto_from is not None:
            (height, width), (_, size_h, size_w) = self.dataset.auto_from, self.dataset.image_shape
            chosen = f"enlarged from {width}x{height} to {size_w}x{size_h}" if (height, width) != (size_h, size_w) else f"kept at {width}x{height}"
            parts.append(f"; images {chosen} (transform.image_size auto)")
        if self.streamed:
            parts.append(f"; {', '.join(self.streamed)} streamed in windows (over the {self.budget_mb():,} MB in-memory budget)")
        return "".join(parts)


CHECKS_RECORD_PREFIX = "transform-checks-"


def _config_key(cfg: TransformConfig) -> dict:
    """The transform config as the checks record keys it; an image_size unset or auto is left out (so a record
    written before the field existed still matches: it is read by the conversion, not by the transform)."""
    dumped = cfg.model_dump(mode="json", exclude={"in_memory_mb", "window_mb"})  # how a split is read, not what comes out
    if dumped.get("image_size") in (None, "auto"):
        dumped.pop("image_size", None)
    return dumped


def checks_record_path(spec: TransformSpec) -> str:
    """Where the transform stage records its checks of ``spec.dataset`` under ``spec.config``.

    Beside the Parquet files (it goes when the dataset goes), one file per transform config, so
    a later run with the same verified dataset and config reuses the checks instead of running
    every split through Ray Data again.
    """
    config = json.dumps(_config_key(spec.config), sort_keys=True)
    return join(spec.dataset.directory, f"{CHECKS_RECORD_PREFIX}{hashlib.sha256(config.encode()).hexdigest()[:16]}.json")


def checks_record(spec: TransformSpec, checks: dict[str, dict]) -> dict:
    """What `checks_record_path` holds: the dataset's fingerprint, the config and the checks."""
    return {"fingerprint": spec.dataset.fingerprint, "config": _config_key(spec.config), "checks": checks}


def recorded_checks(spec: TransformSpec, splits: tuple[str, ...]) -> dict[str, dict] | None:
    """The checks an earlier run recorded for this dataset (same fingerprint, same rows) and config, else None."""
    record = read_json(checks_record_path(spec))
    if not isinstance(record, dict) or record != checks_record(spec, record.get("checks")):
        return None
    checks = record["checks"]
    if not isinstance(checks, dict) or set(checks) != set(splits):
        return None
    if any(not isinstance(checks[split], dict) or checks[split].get("rows") != spec.dataset.rows.get(split) for split in splits):
        return None
    return checks


MNIST_SHAPE = (1, 28, 28)  # what a caller that names no shape means: the seeds' digits


# The in-memory path's copies of a split (the reader's table, its shuffled copy, the blocks in the object
# store, float32 batches, in each process that reads it) measured about 20x the split's pixels summed over
# the run's processes (docs/performance.md, "Folders bigger than memory"). A split is held in memory while
# its pixels are at most this fraction of the smallest node's memory: at 20x, about 8% of the node.
IN_MEMORY_FRACTION = 1 / 256


def auto_in_memory_mb() -> int:
    """``transform.in_memory_mb`` when unset: `IN_MEMORY_FRACTION` of the memory Ray gives the smallest
    alive node (of this machine's physical memory when Ray is not running), in MB."""
    if ray.is_initialized():
        nodes = [n["Resources"].get("memory", 0) for n in ray.nodes() if n.get("Alive")]
        memory = min((m for m in nodes if m), default=0)
    else:
        memory = 0
    if not memory:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(memory * IN_MEMORY_FRACTION / 2**20)


def split_mb(spec: TransformSpec, split: str) -> float:
    """The split's decoded pixels in MB: rows x channels x height x width bytes (from the manifest)."""
    return spec.dataset.rows.get(split, 0) * int(np.prod(spec.dataset.image_shape)) / 2**20


def fits_in_memory(spec: TransformSpec, split: str) -> bool:
    """Whether the split's decoded pixels (`split_mb`) are at most the run's in-memory budget (`TransformSpec.budget_mb`)."""
    return split_mb(spec, split) <= spec.budget_mb()
