"""Stopping a CLI run from outside, the way a person or an operator does, against the real processes.

Each test starts ``python -m flows.mnist`` (the small model) in a session of its own (as a
terminal does), waits for a line of its output or, to act while training surely runs, for its
training to pause (the test-only pause hook, tests/support/models.py), sends a signal (Ctrl-C
goes to the whole process group, like the terminal's), and checks the exit code, the time it
took, the run's summary.json and that no process of the run is left: the CLI's descendants
(local Ray, its workers) and the temporary Prefect server, which runs in a session of its own
(runner/prefect_server/process.py).
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runner import console, hooks
from runner.stopping import EXIT_CODES, StopRequest
from runner.summary import RunSummary
from tests.support.cli import CliRun, wait_gone
from tests.support.digits import real_digits_mirror
from tests.support.models import SMALL_MODEL_ARGS, pause_env
from tests.support.prefect_server import PrefectServer

ROOT = Path(__file__).resolve().parent.parent
STOP_BUDGET_S = 30  # the bound, and Prefect's cancellation grace period


def small_mirror(tmp_path: Path) -> list[str]:
    """600 real digits on a file:// mirror (the flags that use it): the runs that train a whole epoch
    before they are stopped do it on a sixth of the bundled sample; what they prove is the stopping."""
    return real_digits_mirror(tmp_path / "mirror", train_per_class=60, test_per_class=20)


# --------------------------------------------------------------------------- fast


def test_stop_request_keeps_the_first_reason_and_maps_signals_to_shell_exit_codes():
    stop = StopRequest()
    assert not stop.requested and stop.exit_code() is None
    assert stop.request("stopped by Ctrl-C (SIGINT)", signal.SIGINT)
    assert not stop.request("stopped by SIGTERM", signal.SIGTERM)  # the first one wins
    assert stop.requested and stop.reason == "stopped by Ctrl-C (SIGINT)" and stop.exit_code() == 130
    assert EXIT_CODES[signal.SIGTERM] == 143


def test_stopped_lines_name_the_stage_the_checkpoint_and_the_resume_command():
    summary = {
        "run_name": "r1", "storage_root": "/data", "run_dir": "/data/runs/r1", "epochs": 30, "status": "interrupted",
        "stopped": {"stage": "train", "status": "interrupted", "checkpoint_kept": {"path": "/data/runs/r1/checkpoint_x", "epoch": 2, "mid_epoch": False}},
        "stages": {"download": {"status": "completed"}, "train": {"status": "interrupted"}},
    }
    lines = console.stopped_lines(RunSummary.model_validate(summary), "stopped by Ctrl-C (SIGINT)", 75)
    assert lines[0].startswith("Run r1 stopped by Ctrl-C (SIGINT) in stage train after 1m15s")
    assert "/data/runs/r1/checkpoint_x (epoch 3 of 30 done)" in lines[1]
    assert "python -m flows.mnist --run-name r1 --storage-root /data" in lines[-1]
    first_epoch = console.stopped_lines(RunSummary.model_validate({**summary, "stopped": {**summary["stopped"], "checkpoint_kept": None}}), "x", 9)
    assert "none recorded by Ray Train yet (training starts over); finished stages are kept" in first_epoch[1]
    early = console.stopped_lines(RunSummary(run_name="r2"), "stopped by SIGTERM", 3)
    assert "before its first stage" in early[0] and "--run-name r2" in early[-1]


def test_the_resume_command_keeps_the_runs_options_and_the_way_it_was_started(tmp_path):
    def resume_command_in_a_child(argv: list[str]) -> str:  # this process may be make's own child (make test)
        code = f"from runner.console import resume_command; print(resume_command('r1', '/data', {argv!r}))"
        return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()

    python = Path(sys.executable)
    shown = str(python.relative_to(ROOT)) if python.is_relative_to(ROOT) else str(python)
    argv = ["--preset", "smoke", "--run-name", "old", "--storage-root=/elsewhere", "--train.epochs", "2"]
    assert resume_command_in_a_child(argv) == f"{shown} -m flows.mnist --preset smoke --train.epochs 2 --run-name r1 --storage-root /data"
    assert console.resume_command("r1", "/data") == "python -m flows.mnist --run-name r1 --storage-root /data"  # a served run
    # As the recipe of a make target (`make run`, `make smoke`): the make command that resumes.
    (tmp_path / "Makefile").write_text(
        "smoke:\n\t" + sys.executable + " -c \"from runner.console import resume_command; "
        "print(resume_command('r1', '/my data', ['--preset', 'smoke']))\"\n"
    )
    done = subprocess.run(["make", "-s", "smoke"], cwd=tmp_path, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.stdout.strip() == "make run ARGS='--preset smoke --run-name r1 --storage-root '\"'\"'/my data'\"'\"''", done


def test_a_failure_between_stages_is_not_reported_as_before_any_stage():
    summary = {"run_name": "r", "storage_root": "/s", "run_dir": "/s/runs/r",
               "stages": {"download": {"status": "completed"}, "to-parquet": {"status": "completed"}}}
    text = hooks.failure_summary("fox", "OSError: [Errno 28] No space left on device", RunSummary.model_validate(summary))["text"]
    assert "after stage 'to-parquet'" in text and "before any stage" not in text
    assert "before any stage started" in hooks.failure_summary("fox", "bad", None)["text"]


@pytest.mark.slow  # starts a real Prefect server and a local Ray before it refuses (about 14 s)
def test_too_many_workers_are_refused_before_anything_is_created(tmp_path):
    run = CliRun(tmp_path, "too-many", "--train.num-workers", "128", "--train.global-batch-size", "256")
    code, _ = run.finish(180)
    assert code == 2, run.output()  # a configuration the cluster cannot hold: exit 2, like any bad value (issue 46)
    assert "train.num_workers=128" in run.output() and "to resume" not in run.output()  # nothing started: no resume line
    assert not run.root.exists() or not any(run.root.iterdir()), sorted(p.name for p in run.root.iterdir())


# --------------------------------------------------------------------------- slow: they train


@pytest.mark.slow
@pytest.mark.spine
def test_ctrl_c_stops_training_keeps_the_checkpoint_and_the_same_command_resumes(tmp_path):
    # Paused at the first step of epoch 2 (index 1): epoch 1's checkpoint is committed by then.
    data = [*small_mirror(tmp_path), "--evaluate.min-accuracy", "0"]  # 2 epochs on 570 digits: no gate to meet
    run = CliRun(tmp_path, "interrupted", *data, "--train.epochs", "2", env=pause_env(epoch=1, step=0))
    run.wait_for_pause()
    pids = run.processes()
    os.killpg(run.proc.pid, signal.SIGINT)  # the terminal sends Ctrl-C to the whole foreground group
    code, seconds = run.finish(STOP_BUDGET_S + 30)
    out = run.output()
    print(f"Ctrl-C to exit: {seconds:.1f}s")
    assert code == 130, out[-3000:]
    assert seconds < STOP_BUDGET_S, out[-3000:]
    assert not wait_gone(pids, timeout_s=10)
    summary = run.summary()
    assert summary["status"] == "interrupted" and summary["stopped"]["stage"] == "train"
    assert summary["stages"]["train"]["status"] == "interrupted"
    kept = summary["stopped"]["checkpoint_kept"]
    assert kept and kept["epoch"] == 0 and Path(kept["path"]).is_dir()  # the checkpoint of the epoch before the pause
    assert "Traceback" not in out and "ConnectError" not in out
    resume = re.search(r"^  to resume +(.+?) \(verified stages are skipped", out, re.M)
    assert resume, out[-3000:]
    command = shlex.split(resume.group(1))  # the printed command, run as printed
    assert command[1:] == ["-m", "flows.mnist", "--preset", "smoke", *SMALL_MODEL_ARGS, *data, "--train.epochs", "2",
                           "--run-name", "interrupted", "--storage-root", str(run.root)], command

    again = CliRun(tmp_path, "interrupted", command=command)  # no pause in its environment (and that pause has fired)
    code, _ = again.finish(600)
    assert code == 0, again.output()[-3000:]
    resumed = again.summary()
    assert resumed["status"] == "completed" and resumed["stopped"] is None
    assert resumed["resumed_from_epoch"] == kept["epoch"] + 1  # went on from the kept checkpoint


@pytest.mark.slow
def test_sigkill_leaves_nothing_behind_and_the_same_run_started_again_stops_on_sigterm_with_143(tmp_path):
    """``kill -9`` of the CLI, then the same command started again and stopped by SIGTERM (an
    operator's kill, systemd, Docker) while it trains.

    After the SIGKILL the temporary Prefect server goes at once and every other process of the run
    within two minutes: Ray's dashboard and runtime-env agents wait about a minute for the killed
    GCS before they exit. The second run fills that minute: the killed run's name is free again
    (its lease names a dead process), and SIGTERM stops it with 143, no system error, nothing left."""
    killed = CliRun(tmp_path, "killed")
    killed.wait_for_line("Ray: local cluster", timeout_s=180)
    pids = killed.processes()
    server = [pid for pid in pids if pid != killed.proc.pid and "runner.prefect_server.process" in Path(f"/proc/{pid}/cmdline").read_text(errors="replace")]
    assert server, "the temporary Prefect server was not found among the run's processes"
    os.kill(killed.proc.pid, signal.SIGKILL)
    killed.proc.wait(timeout=10)  # reaped: a zombie's pid would still hold the run's lease
    start = time.monotonic()
    assert not wait_gone(set(server), timeout_s=10), "the temporary Prefect server outlived the CLI"

    run = CliRun(tmp_path, "killed", "--train.epochs", "2", env=pause_env(epoch=0, step=1))
    run.wait_for_pause()  # inside fit(), training
    run_pids = run.processes()
    os.kill(run.proc.pid, signal.SIGTERM)
    code, seconds = run.finish(STOP_BUDGET_S + 30)
    out = run.output()
    print(f"SIGTERM to exit: {seconds:.1f}s")
    assert code == 143 and seconds < STOP_BUDGET_S, out[-3000:]
    assert "SystemError" not in out and "Traceback" not in out
    assert "Run killed stopped by SIGTERM in stage train" in out
    assert not wait_gone(run_pids, timeout_s=10)
    summary = run.summary()
    assert summary["status"] == "interrupted" and summary["stopped"]["reason"] == "stopped by SIGTERM"

    left = wait_gone(pids, timeout_s=max(0.0, 120 - (time.monotonic() - start)))  # Ray's agents give a dead GCS a while
    print(f"every process of the killed run gone {time.monotonic() - start:.1f}s after the SIGKILL")
    assert not left, {pid: Path(f"/proc/{pid}/cmdline").read_text(errors="replace")[:120] for pid in left}


@pytest.mark.slow
def test_a_prefect_api_gone_for_good_ends_the_run_within_the_bounded_wait(tmp_path):
    wait_s = 10
    server = PrefectServer(tmp_path / "prefect-home").start()
    try:
        run = CliRun(tmp_path, "api-lost", *small_mirror(tmp_path), "--train.epochs", "3", "--lost-api-wait-s", str(wait_s),
                     env={"PREFECT_API_URL": server.api, **pause_env(epoch=1, step=0)})
        run.wait_for_pause()  # never released: training outlasts any wait
    finally:
        server.stop()  # for good: nothing answers on its port again
    code, seconds = run.finish(wait_s + 90)
    out = run.output()
    print(f"server stopped to exit: {seconds:.1f}s")
    assert "the orchestrator could not be told" in out, out[-3000:]
    summary = run.summary()
    # Training (held paused) outlasts the wait, so the run stopped in it, with the reason on record.
    assert summary["status"] == "interrupted" and summary["stopped"]["stage"] == "train", summary.get("stopped")
    assert "Prefect API did not answer" in summary["stopped"]["reason"]
    assert code == 1
    assert seconds < wait_s + 60  # the wait, the stage's wind-down (15 s at most), and the health polls
