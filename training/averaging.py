"""The moving average of the weights, updated without waiting for the device.

``torch.optim.swa_utils.AveragedModel.update_parameters`` reads its update count, a tensor, on
every step (``n_averaged == 0``, ``n_averaged.to(device)``) and the recipe's decay needed it as a
number: on a GPU each read waits for the step to finish. `WeightAverage` counts updates in Python
and writes the count through to ``n_averaged`` (a CPU buffer), which it reads once, at the first
update after it was built or restored (`training.checkpoints.load_checkpoint` sets it). The state
dict, the averaging arithmetic and the checkpoints are AveragedModel's, unchanged.
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

    def load_state_dict(self, *args, **kwargs):  # noqa: D102 - AveragedModel's, then the count is read again
        self.updates = None
        return super().load_state_dict(*args, **kwargs)

    @torch.no_grad()
    def update_parameters(self, model: torch.nn.Module) -> None:
        """Average ``model``'s weights and buffers in: copied at the first update, then lerped a dtype group at a time."""
        if self.updates is None:
            self.updates = int(self.n_averaged)  # once per attempt; a CPU buffer
        averaged = [*self.module.parameters(), *self.module.buffers()]
        current = [t.detach() for t in (*model.parameters(), *model.buffers())]
        if self.updates == 0:
            torch._foreach_copy_(averaged, current)
        else:
            d = self.decay_at(self.updates)
            floats = [(a, c) for a, c in zip(averaged, current, strict=True) if torch.is_floating_point(a)]
            if floats:  # one _foreach_lerp_ for the float weights, not a tensor at a time
                torch._foreach_lerp_([a for a, _ in floats], [c for _, c in floats], 1.0 - d)
            for a, c in zip(averaged, current, strict=True):
                if not torch.is_floating_point(a):  # BatchNorm's num_batches_tracked
                    a.copy_(a * d + c * (1.0 - d))
        self.updates += 1
        self.n_averaged.fill_(self.updates)
