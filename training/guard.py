"""What runs before every training step: the test-only fault hooks, then the hang check."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from training.checkpoints import wait_for_committed_reports
from training.faults import FaultInjector


class TrainingHangError(RuntimeError):
    """A rank did not reach a training step within ``train.hang_timeout_s``."""


class StepGuard:
    """What runs before every training step: test-only fault injection, then the hang check.

    The hang check is a gloo ``monitored_barrier`` with ``timeout_s``: rank 0 waits for every
    rank and, when one does not arrive, the error names it ("Ranks 1 failed to pass
    monitoredBarrier"), so a deadlocked or stalled worker fails the attempt instead of hanging
    the flow forever. It needs the gloo backend (CPU training); with NCCL only the process
    group timeout (``TorchConfig(timeout_s)``, set from the same field) applies.
    """

    def __init__(self, rank: int, world_size: int, timeout_s: float, fault_dir: str | None):
        self.rank, self.timeout_s = rank, timeout_s
        self.faults = FaultInjector(fault_dir, rank, settle=wait_for_committed_reports) if fault_dir else None
        self.monitored = (
            timeout_s > 0 and world_size > 1 and dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo"
        )

    def before_step(self, epoch: int, step: int) -> None:
        if self.faults:
            self.faults.check(epoch, step)
        if not self.monitored:
            return
        try:
            dist.monitored_barrier(timeout=timedelta(seconds=self.timeout_s), wait_all_ranks=True)
        except RuntimeError as exc:
            raise TrainingHangError(
                f"rank {self.rank}: a training worker did not reach step {step} of epoch {epoch} within "
                f"train.hang_timeout_s={self.timeout_s:g}s (stalled, deadlocked or died): {exc}"
            ) from exc
