"""How the training loop takes its rows: a few steps' worth at a time from the shard, cut into steps on the device.

A shard is a Ray Dataset (streamed, or in-memory blocks) or the rows a training worker holds itself
(`dataset.tensors.resident`); both answer ``iter_torch_batches``. The loop (`training.worker.loop`) trains and validates on
`batches`.
"""

from __future__ import annotations

import math

import torch

# Ray Data hands the loop a few hundred rows at a time and the loop cuts them into steps on the device:
# each batch Ray Data makes costs the training process about 2 ms of host time whatever its size
# (measured on an H200, docs/performance.md "On a GPU"), as much as a quarter of a small model's step.
FEED_ROWS = 512  # rows per batch taken from Ray Data, at most (rounded down to whole steps, at least one)
FEED_BYTES = 32 << 20  # ... and at most this many bytes of float32 images
MIN_TRAIN_ROWS = 2  # a training step on fewer rows fails in BatchNorm when the last block is 1x1


def feed_rows(batch_size: int, image_shape: tuple[int, ...] | None) -> int:
    """Rows per batch taken from Ray Data for steps of ``batch_size`` rows: whole steps, up to `FEED_ROWS` rows
    and `FEED_BYTES` of ``image_shape`` float32 images (unknown shape: `FEED_ROWS` alone)."""
    steps = max(1, FEED_ROWS // batch_size)
    if image_shape:
        steps = max(1, min(steps, FEED_BYTES // (4 * math.prod(image_shape) * batch_size)))
    return steps * batch_size


def batches(attempt, shard, training: bool = False):
    """The shard's batches of ``attempt.batch_size`` rows on the attempt's device, in the shard's order
    (``attempt``: a `training.worker.loop.Attempt`; ``shard``: anything with Ray Data's ``iter_torch_batches``: a Ray
    Dataset, or the rows a worker holds, `dataset.tensors.resident`).

    Ray Data delivers `feed_rows` rows at a time (on a GPU from pinned host memory, copies that need not
    wait), cut here into steps. ``training``: a last batch of fewer than `MIN_TRAIN_ROWS` rows joins the
    step before it (every rank's share has the same count, so every rank does the same), or is left out
    when it is the epoch's only one; validation scores every row in batches as they come.
    """
    spec = attempt.cfg.transform or {}
    shape = (spec.get("dataset") or {}).get("image_shape")
    size = attempt.batch_size
    held = None  # the last step cut, yielded once the next one shows it is not to be merged with a short tail
    for chunk in shard.iter_torch_batches(batch_size=feed_rows(size, shape), device=attempt.device,
                                          pin_memory=attempt.device.type == "cuda"):
        rows = len(chunk["label"])
        for start in range(0, rows, size):
            piece = {name: column[start:start + size] for name, column in chunk.items()} if rows > size else chunk
            if training and len(piece["label"]) < MIN_TRAIN_ROWS:  # the epoch's last rows: only the last piece is short
                if held is not None:
                    held = {name: torch.cat([held[name], piece[name]]) for name in held}
                continue
            if held is not None:
                yield held
            held = piece
    if held is not None:
        yield held
