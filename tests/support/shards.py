"""A training shard in memory, read as the training loop reads one (``iter_torch_batches``): for the loop's own tests."""

from __future__ import annotations

import torch


class Rows:
    """``rows`` random 1x28x28 images and labels (fixed by ``seed``), with row_ids 0..rows-1, in batches on a device.

    Not a Ray Data dataset: its prefetch threads would make device reads of their own, and the tests that count
    the loop's reads count only the loop's."""

    def __init__(self, rows: int, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        self.images = torch.randn(rows, 1, 28, 28, generator=generator)
        self.labels = torch.randint(0, 10, (rows,), generator=generator)

    def iter_torch_batches(self, *, batch_size: int, device: torch.device, pin_memory: bool = False):
        for start in range(0, len(self.labels), batch_size):
            end = start + batch_size
            yield {"image": self.images[start:end].to(device), "label": self.labels[start:end].to(device),
                   "row_id": torch.arange(start, min(end, len(self.labels))).to(device)}
