"""The small model orchestration tests train, and the test-only pause that holds training still.

Most end-to-end tests prove orchestration (stages, retries, stopping, storage, deployments, the
UI), not the network: they train ``training.model.catalog:small_cnn`` (``model.name``'s function form,
so every such run also proves a model given as ``package.module:function`` builds on the Ray
workers). ResNet-18 stays where the model is the point: the default recipe, the seeds'
checkpoint contract, the checkpoint-size-dependent disk test.

A small model can finish a run before a test gets to act on it, so tests that act while training
runs (Ctrl-C, SIGTERM, a killed driver or node, a cancel) set `pause_env` and wait in
`wait_for_pause` instead of racing the clock: rank 0 stops at the given step until released
(``training.worker.faults``, action ``pause``).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from training.worker.faults import FAULT_ENV, paused, release_pauses

SMALL_MODEL = "training.model.catalog:small_cnn"
SMALL_MODEL_ARGS = ("--model.name", SMALL_MODEL)


def pause_env(epoch: int = 1, step: int = 0, rank: int = 0) -> dict[str, str]:
    """The environment that makes rank ``rank`` pause at ``step`` of ``epoch`` (once per run)."""
    return {FAULT_ENV: f"pause:rank={rank}:epoch={epoch}:step={step}"}


def faults_dir(root: Path, run_name: str) -> Path:
    return Path(root) / "runs" / run_name / "faults"


def wait_for_pause(root: Path, run_name: str, timeout_s: float = 300, alive=None) -> str:
    """Wait until the run's training has paused (its marker written); return the marker's path.

    ``alive()``: False when the process running the flow has ended (the wait then fails at once).
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = paused(str(faults_dir(root, run_name)))
        if found:
            return found[0]
        if alive is not None and not alive():
            pytest.fail(f"the run {run_name} ended before its training paused")
        time.sleep(0.2)
    pytest.fail(f"the run {run_name} did not pause within {timeout_s}s")


def release(root: Path, run_name: str) -> None:
    """Let a paused run go on."""
    release_pauses(str(faults_dir(root, run_name)))
