"""Each rank's share of an epoch's training rows, and the rows every rank consumed (for the data position).

Each epoch's order and augmentation are fixed by (seed, epoch) (`dataset.transform.build_split`);
a restart with any world size rebuilds the interrupted epoch without the consumed rows
(`EpochShards`), so every row is trained on once per epoch and the rest come in the order they would have.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from dataset.transform import TransformSpec, build_split
from training.checkpoints import Position


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

    def __init__(self, transform: dict[str, Any] | TransformSpec, seed: int, epochs: int, start: Position, rank: int, world_size: int):
        self.seed, self.epochs, self.start, self.rank, self.world_size = seed, epochs, start, rank, world_size
        self.spec = TransformSpec.model_validate(transform)

    def __call__(self, epoch: int):
        resuming = epoch == self.start.epoch and self.start.consumed is not None
        exclude = self.start.consumed.numpy() if resuming else None
        part = (self.rank, self.world_size) if self.world_size > 1 else None
        return build_split(self.spec, "train", self.seed, epoch, exclude=exclude, part=part)
