"""What runs around every training step: the test-only fault hooks, the hang check, the preemption check."""

from __future__ import annotations

import math
from datetime import timedelta

import ray.train
import torch.distributed as dist

from training.checkpoint.in_attempt import wait_for_committed_reports
from training.worker.faults import FaultInjector


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


def preempted(attempt, step: int, run_step: int | None = None) -> bool:
    """Whether a node of this worker group is being preempted and no just-in-time checkpoint was saved yet
    (``attempt``: a `training.worker.loop.Attempt`, whose ``preemption_check`` and ``saved_for_preemption`` it reads).

    Asked every ``attempt.preemption_check`` steps of the run (``run_step``: the run's step count, unset: ``step``,
    the epoch's), at the same steps on every rank (the call is a barrier through Ray Train's synchronization
    actor, rank 0's answer is everyone's: a round trip, which is why it is not asked every step, `preemption_cadence`).
    Ray marks a node draining when it is preempted or its
    ``ray start`` gets SIGTERM; the node keeps running until the drain deadline, so the ranks save
    a mid-epoch checkpoint (with the data position) at once and train on. When the node goes, Ray
    Train restarts from that checkpoint, on the preemption budget (``train.max_preemption_failures``).
    """
    counted = step if run_step is None else run_step
    if not attempt.preemption_check or attempt.saved_for_preemption or (counted + 1) % attempt.preemption_check:
        return False
    info = ray.train.get_preemption_info()
    if info is None:
        return False
    attempt.saved_for_preemption = True
    if ray.train.get_context().get_world_rank() == 0:
        print(f"[preemption] nodes {info.preempted_node_ids} (ranks {info.preempted_ranks}) are being preempted: "
              f"checkpoint after step {step + 1}", flush=True)
    return True


def preemption_cadence(every_steps: int, every_s: float, step_s: float) -> int:
    """Steps between preemption checks after an epoch whose steps took ``step_s`` seconds (the ranks' mean, so
    every rank gets the same answer): about ``every_s`` seconds apart (``train.preemption_check_s``), never
    more often than ``every_steps`` (``train.preemption_check_steps``, the first epoch's cadence); 0: never."""
    if not every_steps:
        return 0
    if every_s <= 0 or step_s <= 0:
        return every_steps
    return max(every_steps, math.ceil(every_s / step_s))
