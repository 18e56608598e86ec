"""Each rank's share of an epoch's training rows, and the rows every rank consumed (for the data position).

Each epoch's order and augmentation are fixed by (seed, epoch) (`dataset.tensors.transform.build_split`);
a restart with any world size rebuilds the interrupted epoch without the consumed rows
(`EpochShards`), so every row is trained on once per epoch and the rest come in the order they would have.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from dataset.tensors.resident import ResidentSplit, fits_on_device, resident_bytes
from dataset.tensors.spec import TransformSpec
from dataset.tensors.transform import build_split
from training.manifests import Position


def gather_rows(local: list[torch.Tensor]) -> torch.Tensor:
    """Every rank's consumed ``row_id``s since the epoch (or attempt) began, concatenated (a collective)."""
    mine = torch.cat(local) if local else torch.empty(0, dtype=torch.int64)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return mine
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return torch.cat(everyone)


class EpochShards:
    """Each rank's share of an epoch's training rows, in the epoch's (seed, epoch) order.

    Built per epoch, not once for the run, because the order depends on the epoch, without the
    rows ``start`` says an interrupted attempt already trained on when resuming that epoch, and
    split across the current world size (which may differ from the failed attempt's). Every rank
    cuts its own part (`build_split(part=...)`: every n-th row of the epoch's order, the same
    count for every rank), whether the split is held in memory or streamed in windows: no
    coordinator actor, nothing sent between ranks.
    """

    def __init__(self, transform: dict[str, Any] | TransformSpec, seed: int, epochs: int, start: Position, rank: int,
                 world_size: int, resident: ResidentSplit | None = None):
        self.seed, self.epochs, self.start, self.rank, self.world_size = seed, epochs, start, rank, world_size
        self.spec = TransformSpec.model_validate(transform)
        self.resident = resident  # the training split held on the device (`dataset.tensors.resident`), else Ray Data streams it

    def __call__(self, epoch: int):
        resuming = epoch == self.start.epoch and self.start.consumed is not None
        exclude = self.start.consumed.numpy() if resuming else None
        part = (self.rank, self.world_size) if self.world_size > 1 else None
        if self.resident is not None:  # the same rows in the same order, made on the device
            return self.resident.rows(self.seed, epoch, exclude=exclude, part=part)
        return build_split(self.spec, "train", self.seed, epoch, exclude=exclude, part=part)


def holds_on_device(choice: str, spec: TransformSpec, device: torch.device) -> bool:
    """Whether ``train.resident_data`` = ``choice`` holds the training and validation splits on ``device`` (a GPU, or
    the worker's memory on a CPU): ``auto`` when both fit (`dataset.tensors.resident.fits_on_device`), ``off`` never.

    On a CPU too: Ray Data's first execution of an epoch started worker processes that import torch, 4.4-5.2 s before
    the first step and about 360 MB at a small run's peak (docs/performance.md, "Data held by the training worker")."""
    if choice == "off":
        return False
    return all(fits_on_device(spec, split, device) for split in ("train", "val"))


def attempt_splits(cfg, device: torch.device, start: Position, rank: int, world_size: int) -> tuple[EpochShards, Any]:
    """(each epoch's training rows, this rank's validation rows) of one attempt (``cfg``: a LoopConfig): held on the
    device once for the attempt (`holds_on_device`) or streamed by Ray Data, the same rows either way.

    Ray Data's validation rows are this rank's share built once: a Ray Train dataset shard would start a split
    coordinator actor first (measured: 8.6 s for epoch 0's validation of 200 rows with it, against 0.2-0.4 s for
    every later epoch)."""
    spec = TransformSpec.model_validate(cfg.transform)
    part = (rank, world_size)
    if holds_on_device(cfg.resident_data, spec, device):
        train, val = (ResidentSplit.load(spec, split, device) for split in ("train", "val"))
        if rank == 0:
            mb = sum(resident_bytes(spec, split) for split in ("train", "val")) / 2**20
            where = f"on {device}" if device.type == "cuda" else "in this worker's memory"
            print(f"[data] train ({len(train):,} rows) and val ({len(val):,}) held {where} for this attempt "
                  f"(up to {mb:,.0f} MB; train.resident_data={cfg.resident_data})", flush=True)
        return EpochShards(spec, cfg.seed, cfg.epochs, start, rank, world_size, resident=train), val.rows(part=part)
    return EpochShards(spec, cfg.seed, cfg.epochs, start, rank, world_size), build_split(spec, "val", part=part)
