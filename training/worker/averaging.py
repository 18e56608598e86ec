"""The moving average of the weights, updated without waiting for the device.

``torch.optim.swa_utils.AveragedModel.update_parameters`` reads its update count, a tensor, on
every step (``n_averaged == 0``, ``n_averaged.to(device)``) and the recipe's decay needed it as a
number: on a GPU each read waits for the step to finish. `WeightAverage` counts updates in Python
and writes the count through to ``n_averaged`` (a CPU buffer), which it reads once, at the first
update after it was built or restored (`training.checkpoint.in_attempt.load_checkpoint` sets it). The state
dict, the averaging arithmetic and the checkpoints are AveragedModel's, unchanged. Every update is a few
``_foreach`` calls, whatever the number of layers: on a GPU the host's launches, not the arithmetic, set a
small model's step time (docs/performance.md, "On a GPU").
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.optim.swa_utils import AveragedModel


class WeightAverage(AveragedModel):
    """An exponential moving average of ``model`` (buffers included) whose decay after ``n`` updates is ``decay_at(n)``."""

    def __init__(self, model: torch.nn.Module, decay_at: Callable[[int], float]):
        super().__init__(model, use_buffers=True)
        self.decay_at = decay_at
        self.updates: int | None = None  # None: read n_averaged at the next update (built, or restored)
        self._groups: tuple | None = None  # (the source's tensors, then the float and the integer pairs as lists)

    def load_state_dict(self, *args, **kwargs):  # noqa: D102 - AveragedModel's, then the count is read again
        self.updates, self._groups = None, None
        return super().load_state_dict(*args, **kwargs)

    def _apply(self, *args, **kwargs):  # noqa: D102 - .to(), .cuda(): the averaged tensors may be new ones
        self._groups = None
        return super()._apply(*args, **kwargs)

    def _pairs(self, model: torch.nn.Module) -> tuple[list, list, list, list]:
        """(averaged floats, current floats, averaged integers, current integers), grouped once for ``model``'s
        tensors and again only when they are other tensors (the model was moved or rebuilt)."""
        current = [*model.parameters(), *model.buffers()]
        if self._groups is None or len(self._groups[0]) != len(current) or any(
                a is not b for a, b in zip(self._groups[0], current, strict=True)):
            averaged = [*self.module.parameters(), *self.module.buffers()]
            pairs = list(zip(averaged, current, strict=True))
            floats = [(a, c) for a, c in pairs if a.is_floating_point()]
            counts = [(a, c) for a, c in pairs if not a.is_floating_point()]  # BatchNorm's num_batches_tracked
            self._groups = (current, [a for a, _ in floats], [c for _, c in floats],
                            [a for a, _ in counts], [c for _, c in counts])
        return self._groups[1:]

    @torch.no_grad()
    def update_parameters(self, model: torch.nn.Module) -> None:
        """Average ``model``'s weights and buffers in: copied at the first update, then a dtype group at a time."""
        if self.updates is None:
            self.updates = int(self.n_averaged)  # once per attempt; a CPU buffer
        float_avg, float_cur, count_avg, count_cur = self._pairs(model)
        if self.updates == 0:
            torch._foreach_copy_([*float_avg, *count_avg], [*float_cur, *count_cur])
        else:
            d = self.decay_at(self.updates)
            if float_avg:  # one _foreach_lerp_ for the float weights, not a tensor at a time
                torch._foreach_lerp_(float_avg, float_cur, 1.0 - d)
            if count_avg:  # AveragedModel's arithmetic on the integer counters, as one group too
                mixed = torch._foreach_mul(count_avg, d)
                torch._foreach_add_(mixed, torch._foreach_mul(count_cur, 1.0 - d))
                torch._foreach_copy_(count_avg, mixed)
        self.updates += 1
        self.n_averaged.fill_(self.updates)
