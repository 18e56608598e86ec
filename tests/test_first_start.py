"""The first start of the CLI on a fresh home: its temporary Prefect server and local Ray come up on a
busy machine, and a start that cannot succeed ends with one message, its log and exit code 3 (issue 32).

Real processes throughout: the CLI in a session of its own (``CliRun``), a fresh ``HOME`` (so a fresh
``~/.ray``, where Ray writes its auth token) and ``PREFECT_HOME`` (a fresh SQLite database: every
migration runs), and other busy processes, each in its own session as other people's work would be.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from runner.cluster.runtime import START_FAILED_EXIT_CODE
from runner.prefect_server.process import LOG_NAME
from tests.support.cli import CliRun, alive, wait_gone

# What a user's shell might set that would make the start not a first one (or not the default one).
NOT_FRESH = ["PREFECT_API_URL", "PREFECT_PROFILES_PATH", "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS",
             "PREFECT_API_DATABASE_CONNECTION_URL", "RAY_ADDRESS", "RAY_AUTH_MODE"]
SMALL_MODEL = ["--model.name", "training.model.catalog:small_cnn"]  # a tiny CNN: the run is about the start, not training


def fresh_home(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    home = tmp_path / "home"
    home.mkdir()
    return home, {"HOME": str(home), "PREFECT_HOME": str(home / ".prefect")}


def first_start(tmp_path: Path, run_name: str, *args: str, env: dict[str, str]) -> CliRun:
    """``python -m flows.mnist --preset smoke`` with ``args``, none of ``NOT_FRESH`` inherited unless in ``env``."""
    unset = [item for name in NOT_FRESH if name not in env for item in ("-u", name)]
    command = ["env", *unset, sys.executable, "-m", "flows.mnist", "--preset", "smoke",
               "--storage-root", str(tmp_path / "storage"), "--run-name", run_name, *args]
    return CliRun(tmp_path, run_name, env=env, command=command)


@contextmanager
def busy_cores(count: int = 2) -> Iterator[list[subprocess.Popen]]:
    """``count`` Python busy loops, each in its own session (the scheduler's share per session), killed afterwards."""
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True) for _ in range(count)]
    try:
        yield loops
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()


@pytest.mark.slow
@pytest.mark.spine
def test_a_first_start_on_a_fresh_home_completes_while_both_cores_are_busy(tmp_path):
    """The cores are busy through the start (the temporary server's migrations, Ray's start, the
    first stage); the run then finishes on a machine of its own, since what follows is not the start."""
    home, env = fresh_home(tmp_path)
    run = None
    try:
        with busy_cores(2) as loops:
            run = first_start(tmp_path, "first", *SMALL_MODEL, env=env)
            run.wait_for_line("[1/7] download done", timeout_s=600)
            assert all(loop.poll() is None for loop in loops), "the busy loops ran through the whole start"
        code, _ = run.finish(timeout_s=600)
    finally:
        if run is not None:
            run.kill()
    out = run.output()
    assert code == 0, out[-3000:]
    for number, stage in enumerate(["download", "to-parquet", "transform", "train", "evaluate", "promote", "cleanup"], 1):
        assert f"[{number}/7] {stage} done" in out, out[-3000:]
    assert re.search(r"Run first completed in", out), out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert run.summary()["status"] == "completed"
    assert (home / ".ray" / "auth_token").is_file()  # Ray's token authentication on a fresh ~/.ray
    # ... said once, by the run's Ray line (the token's file), not by Ray's own WARNING (runner.cluster.ray_init)
    assert "Token authentication is enabled" not in out, out[:3000]
    assert "(token: ~/.ray/auth_token)" in out, out[:3000]
    assert (home / ".prefect" / LOG_NAME).is_file()  # the temporary server's own output


@pytest.mark.slow  # each starts a real Prefect server and a local Ray (about 14 s): not in `make test-fast`
@pytest.mark.parametrize(
    "why, setting, reason",
    [
        ("too little time", {"PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "1"}, "did not answer within 1 s"),
        ("an unusable database", {"PREFECT_API_DATABASE_CONNECTION_URL": "sqlite+aiosqlite:////nonexistent/dir/prefect.db"},
         "exited with code"),
    ],
)
def test_a_start_that_cannot_succeed_prints_one_message_its_log_and_exits_3(tmp_path, why, setting, reason):
    home, env = fresh_home(tmp_path)
    run = first_start(tmp_path, "doomed", env={**env, **setting})
    try:
        code, seconds = run.finish(timeout_s=120)
        processes = run.processes()
    finally:
        run.kill()
    out = run.output()
    assert code == START_FAILED_EXIT_CODE == 3, out[-3000:]
    assert f"The temporary Prefect server did not start: it {reason}" in out, out
    assert "Traceback" not in out, out
    assert "PREFECT_API_URL" in out, out  # what to do
    if "1 s" in reason:
        assert "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS (now 1 s)" in out, out
    log = Path(re.search(r"its log +(\S+)", out).group(1))
    assert log == home / ".prefect" / LOG_NAME and log.is_file(), out
    assert f"CLI pid {run.proc.pid}: temporary Prefect server on 127.0.0.1:" in log.read_text()
    assert not wait_gone(processes, 10), f"left running: {alive(processes)}"
    assert seconds < 150, f"{why}: {seconds:.0f}s"  # not the 180 s startup timeout: it stopped waiting at once
