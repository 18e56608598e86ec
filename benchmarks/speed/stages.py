"""What the training-stage benchmarks share: the stages before training, run as the flow runs them."""

from __future__ import annotations

import time
from pathlib import Path


def stage_inputs(config, work: Path, name: str):
    """Download, convert and transform for ``config`` under ``work/storage``; return (TransformSpec, layout).

    The run is named ``<name>-<nanoseconds>`` so repeated measurements never resume each other.
    """
    from storage_io import StorageLayout
    from tasks.download import download
    from tasks.to_parquet import to_parquet
    from tasks.transform import transform

    layout = StorageLayout.create(str(work / "storage"), f"{name}-{time.time_ns()}")
    raw = download.fn(config.download, layout)
    dataset = to_parquet.fn(raw, config.parquet, layout)
    return transform.fn(dataset, config.transform, layout), layout
