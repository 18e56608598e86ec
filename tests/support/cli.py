"""Command-line runs of the flows in a session of their own, as a terminal starts them, and their processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.models import SMALL_MODEL_ARGS, faults_dir, release
from training.worker.faults import paused

ROOT = Path(__file__).resolve().parent.parent.parent


class CliRun:
    """One ``python -m flows.mnist`` (or ``flows.tune``) run in its own session, its output in a file."""

    def __init__(
        self, tmp_path: Path, run_name: str, *args: str, env: dict[str, str] | None = None, command: list[str] | None = None,
        module: str = "flows.mnist",
    ):
        """``python -m <module> --preset smoke`` on the small model with ``args``, or ``command`` as given.

        The default command trains ``SMALL_MODEL`` (tests/support/models.py): these runs prove
        orchestration, not the network; ``args`` come after it, so a ``--model.name`` there wins.
        Run in the project folder.
        """
        self.root, self.run_name = tmp_path / "storage", run_name
        self.log = tmp_path / f"{run_name}-{time.monotonic_ns()}.log"
        command = command or [sys.executable, "-m", module, "--preset", "smoke", *SMALL_MODEL_ARGS,
                              "--storage-root", str(self.root), "--run-name", run_name, *args]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for_line(self, text: str, timeout_s: float = 300) -> None:
        self.wait_until(lambda: text in self.output(), f"{text!r}", timeout_s)

    def wait_for_pause(self, timeout_s: float = 300) -> str:
        """Until training has paused (``pause_env`` in the run's ``env``); the marker's path.

        The pause settles first: every report before it is committed, so the latest checkpoint is
        registered by the time the marker appears.
        """
        self.wait_until(lambda: paused(str(faults_dir(self.root, self.run_name))), "a paused training", timeout_s)
        return paused(str(faults_dir(self.root, self.run_name)))[0]

    def release(self) -> None:
        """Let the paused training go on."""
        release(self.root, self.run_name)

    def wait_until(self, condition, what: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            if self.proc.poll() is not None:
                pytest.fail(f"the run exited ({self.proc.returncode}) before {what}:\n{self.output()[-3000:]}")
            if time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"no {what} within {timeout_s}s:\n{self.output()[-3000:]}")
            time.sleep(0.2)

    def processes(self) -> set[int]:
        """The CLI, its descendants, and the temporary Prefect server it started (its own session)."""
        parents: dict[int, int] = {}
        commands: dict[int, str] = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
                commands[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
        found = {self.proc.pid}
        found |= {pid for pid, command in commands.items() if f"runner.prefect_server.process {self.proc.pid} " in command}
        grew = True
        while grew:
            children = {pid for pid, ppid in parents.items() if ppid in found} - found
            found |= children
            grew = bool(children)
        return found

    def finish(self, timeout_s: float) -> tuple[int, float]:
        """(exit code, seconds it took)."""
        start = time.monotonic()
        try:
            code = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"the run was still going {timeout_s}s later:\n{self.output()[-3000:]}")
        return code, time.monotonic() - start

    def kill(self) -> None:
        for pid in self.processes():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def summary(self) -> dict:
        return json.loads((self.root / "runs" / self.run_name / "summary.json").read_text())


def alive(pids: set[int]) -> set[int]:
    """The pids still running (a zombie waiting for its reaper counts as gone)."""
    running = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            running.add(pid)
    return running


def wait_gone(pids: set[int], timeout_s: float) -> set[int]:
    deadline = time.monotonic() + timeout_s
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.5)
    return alive(pids)
