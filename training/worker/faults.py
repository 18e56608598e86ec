"""Test-only fault injection for the training loop: kill or stall one rank at a chosen step.

Off unless the environment variable ``MNIST_FAULT_INJECT`` is set in the process that starts
Ray (the CLI's shell, a test). It is deliberately not a config field, so nobody can trigger it
from the Prefect UI's run form or a deployment's parameters. Syntax: faults separated by ``;``,
each ``<action>:key=value:...``::

    MNIST_FAULT_INJECT="kill:rank=1:epoch=0:step=12"   # SIGKILL rank 1 at step 12 of epoch 0
    MNIST_FAULT_INJECT="stall:rank=1:step=3"           # rank 1 stops responding at step 3 (any epoch)
    MNIST_FAULT_INJECT="pause:epoch=1:step=2"          # rank 0 waits at step 2 of epoch 1 until released

A pause holds training still so a test can act while it is surely running (kill the driver,
Ctrl-C, SIGTERM, cancel from the UI) however fast the model trains: the rank writes its marker,
then waits until ``<run>/faults/<fault>.release`` exists (`release_pauses`) or `PAUSE_MAX_S` pass.

``rank`` defaults to 0; ``epoch`` and ``step`` left out match any. Each fault fires once per run:
before acting, the rank writes a marker ``<run>/faults/<fault>.fired`` on shared storage, so the
attempt Ray Train restarts after a kill runs through.
"""

from __future__ import annotations

import hashlib
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from storage_io import atomic_write_bytes, exists, join

FAULT_ENV = "MNIST_FAULT_INJECT"
# Test-only as well: when set (any non-empty value), every rank logs the row_ids it trains on
# under <run>/row_log/ so a test can prove each epoch saw every row exactly once.
ROW_LOG_ENV = "MNIST_RECORD_ROWS"
TEST_HOOK_ENVS = (FAULT_ENV, ROW_LOG_ENV)
ACTIONS = ("kill", "stall", "pause")
PAUSE_MAX_S = 600.0  # a pause nobody releases ends by itself: a forgotten test hook cannot hang a run forever


@dataclass(frozen=True)
class Fault:
    """One fault: what to do, on which rank, at which (epoch, step); None matches any."""

    action: str
    rank: int = 0
    epoch: int | None = None
    step: int | None = None

    @property
    def key(self) -> str:
        text = f"{self.action}:rank={self.rank}:epoch={self.epoch}:step={self.step}"
        return f"{self.action}-rank{self.rank}-{hashlib.sha256(text.encode()).hexdigest()[:10]}"

    def matches(self, rank: int, epoch: int, step: int) -> bool:
        return rank == self.rank and self.epoch in (None, epoch) and self.step in (None, step)


def parse_faults(spec: str | None) -> list[Fault]:
    """Parse ``MNIST_FAULT_INJECT``; raises ValueError naming the bad part."""
    faults = []
    for part in filter(None, (p.strip() for p in (spec or "").split(";"))):
        action, *pairs = part.split(":")
        if action not in ACTIONS:
            raise ValueError(f"{FAULT_ENV}: unknown action {action!r} in {part!r}; use one of {', '.join(ACTIONS)}")
        values: dict[str, int] = {}
        for pair in pairs:
            key, sep, value = pair.partition("=")
            if not sep or key not in ("rank", "epoch", "step") or not value.isdigit():
                raise ValueError(f"{FAULT_ENV}: cannot parse {pair!r} in {part!r}; use rank=N, epoch=N or step=N")
            values[key] = int(value)
        faults.append(Fault(action=action, **values))
    return faults


class FaultInjector:
    """Checks the configured faults at every training step of one rank."""

    def __init__(
        self, marker_dir: str | os.PathLike[str], rank: int, spec: str | None = None, settle: Callable[[], None] | None = None
    ):
        """``settle`` runs just before a fault fires: the training loop passes a wait until Ray Train
        has committed every report so far, so the test knows which checkpoint a restart resumes from."""
        self.faults = parse_faults(os.environ.get(FAULT_ENV) if spec is None else spec)
        self.marker_dir, self.rank, self.settle = str(marker_dir), rank, settle

    def __bool__(self) -> bool:
        return bool(self.faults)

    def check(self, epoch: int, step: int) -> None:
        """Fire a matching fault that has not fired yet in this run."""
        for fault in self.faults:
            marker = join(self.marker_dir, f"{fault.key}.fired")
            if not fault.matches(self.rank, epoch, step) or exists(marker):
                continue
            if self.settle is not None:
                self.settle()
            atomic_write_bytes(marker, f"{fault} fired at epoch {epoch} step {step}, pid {os.getpid()}\n".encode())
            print(f"[fault injection] {fault.action} rank {self.rank} at epoch {epoch} step {step}", flush=True)
            if fault.action == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if fault.action == "pause":
                release, deadline = join(self.marker_dir, f"{fault.key}.release"), time.monotonic() + PAUSE_MAX_S
                while not exists(release) and time.monotonic() < deadline:
                    time.sleep(0.2)
                continue
            while True:  # stall: stop responding, as a deadlocked worker would
                time.sleep(3600)


def paused(marker_dir: str) -> list[str]:
    """The markers of the pauses that have fired in the run whose faults folder is ``marker_dir`` (local folders)."""
    return sorted(str(path) for path in Path(marker_dir).glob("pause-*.fired"))


def release_pauses(marker_dir: str) -> None:
    """Let every fired pause of the run go on (a later attempt never pauses again: the marker stays)."""
    for marker in paused(marker_dir):
        atomic_write_bytes(marker.removesuffix(".fired") + ".release", b"released\n")
