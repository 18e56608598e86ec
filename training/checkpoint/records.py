"""What a training run records beside its checkpoints: ``history.jsonl`` (an epoch a line),
``train_attempts.jsonl`` (an attempt a line) and the test-only row log."""

from __future__ import annotations

import json
import os
import time
from typing import TYPE_CHECKING

from storage_io import append_line, atomic_write_bytes, join, read_lines
from training.manifests import Position

if TYPE_CHECKING:  # annotations only: a training run's records are read without torch (the run's watchers)
    import torch


HISTORY_FILE = "history.jsonl"


def read_history(path: str) -> list[dict]:
    """Every finished epoch's metrics from ``history.jsonl`` (empty when there is none)."""
    return read_lines(path)


def record_epoch(path: str, metrics: dict) -> list[dict]:
    """Add one epoch's metrics to ``history.jsonl``, replacing that epoch and any later one.

    The run's per-epoch record for the training curves and benchmarks. Ray Train V2's
    ``Result.metrics_dataframe`` holds only the kept checkpoints' metrics (num_to_keep of them),
    so it cannot be the history. An epoch rerun after a restart replaces what the failed attempt
    wrote from that epoch on. Rewritten whole (atomic rename, or one PUT on S3): one short line per epoch.
    """
    rows = [row for row in read_history(path) if row["epoch"] < metrics["epoch"]] + [metrics]
    atomic_write_bytes(path, "".join(json.dumps(row) + "\n" for row in rows).encode())
    return rows


def process_start_time() -> float | None:
    """Wall-clock time this process started (Linux: /proc/self/stat field 22 after the boot time), None elsewhere."""
    try:
        with open("/proc/self/stat") as handle:
            ticks = int(handle.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as handle:
            boot = next(int(line.split()[1]) for line in handle if line.startswith("btime"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def record_attempt(path: str, start: Position, world_size: int, local_world_size: int | None = None, **details: str) -> None:
    """Append one line per training attempt (Ray Train restart or Prefect retry) to ``train_attempts.jsonl``.

    ``time`` is when the attempt's model is ready; ``process_started_at`` when its (rank 0) worker
    process started, which splits a worker group's start (benchmarks/start/deployment_overhead.py).
    ``local_world_size``: the workers on rank 0's node (1 of 2: the group spans two nodes).
    ``details``: what else the attempt says of itself (``device``, ``precision``).
    """
    append_line(path, {"start_epoch": start.epoch, "start_step": start.step, "world_size": world_size, "time": time.time(),
                       "process_started_at": process_start_time(), **({"local_world_size": local_world_size} if local_world_size is not None else {}),
                       **details})


class RowLog:
    """Test-only record of the ``row_id``s a rank trained on, one JSON line per step.

    Written only when the driver sets ``MNIST_RECORD_ROWS`` (training.worker.faults); the exactly-once
    test reads it back. One file per rank and attempt: ``<run>/row_log/from-e<E>s<S>-w<W>-rank<R>.jsonl``.
    """

    def __init__(self, directory: str, start: Position, world_size: int, rank: int):
        self.path = join(directory, f"from-e{start.epoch}s{start.step}-w{world_size}-rank{rank}.jsonl")

    def write(self, epoch: int, step: int, row_ids: torch.Tensor) -> None:
        append_line(self.path, {"epoch": epoch, "step": step, "rows": row_ids.tolist()})
