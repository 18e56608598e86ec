"""The training recipe: the one-cycle learning rate, AdamW and the moving average of the weights.

Shared by every process that trains: Ray Train workers (`training.worker.loop`), single mode
(`training.single_process`), Tune trials (which run the same loop) and the benchmarks' plain loops.
The weights that are validated and saved as ``model.pt`` are the moving average's (`inference_model`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch.optim.swa_utils import AveragedModel

from training.checkpoint.model_files import unwrap
from training.worker.averaging import WeightAverage


def one_cycle_lr(progress: float, peak: float, warmup: float = 0.2, floor: float = 1e-3) -> float:
    """Learning rate at ``progress`` in [0, 1]: linear warm-up to ``peak``, then cosine to ``peak*floor``."""
    progress = min(max(progress, 0.0), 1.0)
    if progress < warmup:
        return peak * (floor + (1 - floor) * progress / warmup)
    decay = (progress - warmup) / (1 - warmup)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * decay)))


def make_optimizer(model: torch.nn.Module, learning_rate: float, weight_decay: float) -> torch.optim.AdamW:
    """The recipe's AdamW, with PyTorch's fused kernel: one pass over the weights a step.

    The default (per-tensor) AdamW step took about a third as long as a whole forward and backward
    pass of ResNet-18 at batch 64 on a 2-core CPU; the fused one about a twentieth (docs/performance.md).
    """
    return torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=weight_decay, fused=True)


def ema_decay_at(decay: float, updates: int) -> float:
    """EMA decay after ``updates`` averaging steps: warms up as (1+n)/(10+n), capped at ``decay``.

    Without the warm-up a short run's average would still be mostly its random initial weights.
    """
    return min(decay, (1.0 + updates) / (10.0 + updates))


def make_ema(model: torch.nn.Module, decay: float) -> AveragedModel | None:
    """An EMA copy of the unwrapped model (buffers included), or None when ``decay`` is 0.

    A `training.worker.averaging.WeightAverage`: averaged a dtype group at a time (one ``_foreach_lerp_`` for
    the float weights; per tensor it cost about as much as the default AdamW step), its update count
    kept in Python so no step waits for the device to read it.
    """
    if decay <= 0:
        return None
    return WeightAverage(unwrap(model), decay_at=functools.partial(ema_decay_at, decay))


def inference_model(model: torch.nn.Module, ema: AveragedModel | None) -> torch.nn.Module:
    """The weights to validate and ship: the EMA when there is one, else the model itself."""
    return ema.module if ema is not None else unwrap(model)


# Sized in optimizer steps, not only in fractions of the run, so a short run is not starved
# (the recipe benchmark, docs/performance.md): the warm-up is a fifth of the run but at most
# WARMUP_MAX_STEPS; the weight average spans at most a tenth of the run (EMA_RUN_SHARE), so at
# 150 steps it does not still remember the first third of training.
WARMUP_SHARE = 0.2
WARMUP_MAX_STEPS = 200
EMA_RUN_SHARE = 0.1
LR_FLOOR = 0.1


@dataclass(frozen=True)
class Plan:
    """The learning-rate schedule and the weight average of one run, sized by its optimizer steps (`plan_for`)."""

    peak: float
    total_steps: int
    warmup_steps: int
    ema_decay: float
    floor: float = LR_FLOOR

    def lr(self, step: float) -> float:
        """Learning rate at optimizer step ``step`` (0-based; fractions allowed): warm-up, then cosine."""
        return one_cycle_lr(step / self.total_steps, self.peak, warmup=self.warmup_steps / self.total_steps, floor=self.floor)


def plan_for(cfg, total_steps: int) -> Plan:
    """``cfg`` (a TrainConfig)'s plan for a run of ``total_steps`` optimizer steps in all.

    The decay of the weight average is ``train.ema_decay`` or less: at most ``1 - 1 / (EMA_RUN_SHARE * steps)``,
    an average over about a tenth of the run (0.99 needs 1,000 steps; 0.93 at 150)."""
    total = max(1, int(total_steps))
    warmup = min(round(WARMUP_SHARE * total), WARMUP_MAX_STEPS)
    decay = cfg.ema_decay if cfg.ema_decay <= 0 else min(cfg.ema_decay, max(0.0, 1.0 - 1.0 / (EMA_RUN_SHARE * total)))
    return Plan(peak=cfg.learning_rate, total_steps=total, warmup_steps=warmup, ema_decay=round(decay, 6), floor=LR_FLOOR)
