"""How a run stops before its end: Ctrl-C, SIGTERM, a cancel from Prefect, a Prefect API that is gone.

The CLI owns SIGINT and SIGTERM while a run lasts (``signals_stop_the_run``). A signal never
raises into the flow: it only records a stop request (``STOP``). The flow notices it while it
waits for a stage (``wait_for_stage``), cancels that stage's Ray task (in the training stage Ray
Train aborts its run: the workers stop, the checkpoints already written stay), writes the run's
summary as ``interrupted`` and ends the flow run Cancelled. Then the local Ray and the temporary
Prefect server stop, the server last, and the CLI exits 130 (SIGINT) or 143 (SIGTERM). A second
Ctrl-C exits at once.

Why not let Python raise KeyboardInterrupt: the stage runs in a Ray task, so an exception in the
CLI's main thread leaves training running to its end, and Prefect's own
SIGTERM bridge raised from inside Ray's C code, which surfaced as a ``SystemError``.

A served deployment's run is cancelled by Prefect's runner (Cancel in the UI): Prefect's own
SIGTERM bridge stays in charge there, and the summary records the run as ``cancelled``.
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from runner.console import resume_command
from runner.summary import RunSummary

EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}  # 128 + the signal's number, as shells report them
SIGNAL_NAMES = {signal.SIGINT: "Ctrl-C (SIGINT)", signal.SIGTERM: "SIGTERM"}

# How long a cancelled stage may take to wind down (Ray Train's abort takes about a second) before the
# flow records the stop anyway; well inside Prefect's 30 s cancellation grace period.
STAGE_STOP_WAIT_S = 15.0
POLL_S = 0.5


class StopRequest:
    """A process-wide request to stop the run, set from a signal handler or a watchdog thread."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.reason: str | None = None  # what the summary and the terminal say
        self._event = threading.Event()

    @property
    def requested(self) -> bool:
        return self._event.is_set()

    def request(self, reason: str, signum: int | None = None) -> bool:
        """Ask the run to stop; False when a stop was already asked for."""
        if self._event.is_set():
            return False
        self.signum, self.reason = signum, reason
        self._event.set()
        return True

    def exit_code(self) -> int | None:
        """130 after SIGINT, 143 after SIGTERM, None when no signal stopped the run."""
        return EXIT_CODES.get(self.signum) if self.signum is not None else None

    def reset(self) -> None:
        self.signum = self.reason = None
        self._event.clear()


STOP = StopRequest()
_cli_owns_signals = False


class FlowBodyEnd:
    """The flow function's end as a CLI watcher sees it: ``done`` once it returned or raised, with the
    run's summary. Prefect's engine then still reports the final state to the API, which is where a
    lost server made runs hang (`ApiWatch`)."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.summary: RunSummary | None = None

    def finish(self, summary: RunSummary | None) -> None:
        self.summary = summary
        self.done.set()


# The watched flow body's end, bound by the CLI's `ApiWatch` around its in-process flow call (the
# flow function runs in the same thread and context); unbound in a served run, which no CLI watches.
_WATCHED: contextvars.ContextVar[FlowBodyEnd | None] = contextvars.ContextVar("watched_flow_body", default=None)


def flow_body_done(summary: RunSummary | None) -> None:
    """Called by the flow body last: tell the CLI's watch (if any) that it ended, and with what."""
    end = _WATCHED.get()
    if end is not None:
        end.finish(summary)


class RunStopped(Exception):
    """The run stopped on request in ``stage`` (raised in the flow's own thread, never from a signal handler)."""

    def __init__(self, stage: str | None, reason: str):
        super().__init__(f"{reason}{f' during stage {stage}' if stage else ''}")
        self.stage, self.reason = stage, reason


def _tell(text: str) -> None:
    """Write to the terminal directly: inside the flow ``print`` is Prefect's (log_prints) and goes to the log."""
    sys.__stderr__.write(text)
    sys.__stderr__.flush()


def _on_signal(signum: int, frame: Any) -> None:
    if STOP.request(f"stopped by {SIGNAL_NAMES[signum]}", signum):
        again = "; press Ctrl-C again to exit at once" if signum == signal.SIGINT else ""
        _tell(f"\n{SIGNAL_NAMES[signum]}: stopping the run, keeping its checkpoints{again} ...\n")
    elif signum == signal.SIGINT:
        # Second Ctrl-C: leave now. Ray (started by this process) and the temporary Prefect
        # server (runner.prefect_server.process) watch this process and exit after it.
        _tell("\nsecond Ctrl-C: exiting now; the run folder keeps its last checkpoint\n")
        os._exit(EXIT_CODES[signal.SIGINT])


@contextmanager
def signals_stop_the_run() -> Iterator[StopRequest]:
    """While active (the CLI, main thread), SIGINT and SIGTERM ask the run to stop instead of raising."""
    global _cli_owns_signals
    STOP.reset()
    previous = {signum: signal.signal(signum, _on_signal) for signum in EXIT_CODES}
    _cli_owns_signals = True
    try:
        yield STOP
    finally:
        _cli_owns_signals = False
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@contextmanager
def keep_sigterm() -> Iterator[None]:
    """Inside the flow: put the CLI's SIGTERM handler back over the one Prefect's engine installs.

    Prefect's bridge raises ``TerminationSignal`` wherever the main thread is (inside Ray's C
    code here). Only when the CLI owns the signals; a served run keeps Prefect's bridge, which
    is how the runner cancels it.
    """
    if not _cli_owns_signals or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _on_signal)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def sigterm_handler_kept() -> Iterator[None]:
    """Around ``ray.init``: keep the SIGTERM handler that was there before it.

    ``ray.init`` installs its own (``sys.exit``) in the main thread. Over the CLI's handler it would
    turn SIGTERM back into an exception from inside Ray; over Prefect's bridge in a served run,
    Prefect no longer acknowledges the runner's cancel and the run ends Crashed, not Cancelled
    (prefect 3.9.1; docs/design.md).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        if before is not None:
            signal.signal(signal.SIGTERM, before)


def wait_for_stage(future: Any, stage: str) -> Any:
    """The stage's result; when a stop is requested meanwhile, cancel its Ray task and raise `RunStopped`.

    ``ray.cancel`` raises KeyboardInterrupt in the task; in the training stage Ray Train's own
    handler turns that into an abort of its run (workers and controller stop; checkpoints that
    were reported stay on storage).
    """
    import ray  # Ray: only where the cluster is used

    if STOP.requested:
        raise RunStopped(stage, STOP.reason or "stopped")
    ref = getattr(future, "wrapped_future", None)
    if not isinstance(ref, ray.ObjectRef):
        return future.result()
    # Waited on in Python (a concurrent.futures.Future Ray completes), not inside Ray's C code:
    # Prefect's SIGTERM bridge in a served run raises from here cleanly; from inside
    # ``ray.wait`` it surfaced as "SystemError: ... returned a result with an exception set".
    done = ref.future()
    try:
        while not concurrent.futures.wait([done], timeout=POLL_S).done:
            if STOP.requested:
                _cancel(ref)
                raise RunStopped(stage, STOP.reason or "stopped")
    except RunStopped:
        raise
    except BaseException:
        if prefect_is_cancelling():  # a served run cancelled from Prefect: the task may live on a remote cluster
            _cancel(ref)
        raise
    return future.result()


def _cancel(ref: Any) -> None:
    """Cancel a stage's Ray task and give it ``STAGE_STOP_WAIT_S`` to wind down."""
    import ray  # Ray: only where the cluster is used

    ray.cancel(ref, recursive=True)
    deadline = time.monotonic() + STAGE_STOP_WAIT_S
    while time.monotonic() < deadline and not ray.wait([ref], timeout=POLL_S)[0]:
        pass


def prefect_is_cancelling() -> bool:
    """True when Prefect's runner is cancelling this flow run (Cancel in the UI or API).

    Prefect's engine learns it from the runner's control channel before the SIGTERM arrives;
    that channel's intent is only exposed by a private module, so any failure reads as False.
    """
    try:
        from prefect._internal import control_listener  # only when a run is stopped

        return control_listener.get_intent() == "cancel"
    except Exception:  # noqa: BLE001 - a private API: absent or changed means "not known"
        return False


class ApiWatch:
    """Ends a CLI run whose Prefect API stopped answering for longer than ``wait_s``.

    Prefect's client retries a lost server with growing pauses, so a run whose server is gone
    for good finishes its stages and then hangs while reporting its last states. After ``wait_s`` without an answer
    this watch asks a run still in a stage to stop (its checkpoints stay), gives it
    ``STAGE_STOP_WAIT_S`` to write its summary, says that the orchestrator could not be told,
    and exits with the run's outcome (the summary its flow body ended with, also on storage): 0
    when it says completed, else 1. A server
    back within ``wait_s`` changes nothing (docs/design.md has the outages tried).
    """

    def __init__(self, api_url: str, wait_s: float, summary_path: str, argv: Sequence[str] | None = None, poll_s: float = 2.0):
        self.api_url, self.wait_s, self.summary_path, self.poll_s = api_url, wait_s, summary_path, poll_s
        self.argv = argv  # the CLI's options, for the command that resumes (console.resume_command)
        self.body = FlowBodyEnd()
        self._token: contextvars.Token | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="prefect-api-watch", daemon=True)

    def _answers(self) -> bool:
        import httpx  # httpx: only when a server is asked

        try:
            return httpx.get(f"{self.api_url.rstrip('/')}/health", timeout=min(5.0, self.poll_s * 2)).status_code == 200
        except httpx.HTTPError:
            return False

    def _run(self) -> None:
        down_since = None
        while not self._stop.wait(self.poll_s):
            if self._answers():
                down_since = None
                continue
            down_since = down_since or time.monotonic()
            if time.monotonic() - down_since >= self.wait_s:
                self._give_up(time.monotonic() - down_since)

    def _give_up(self, silent_s: float) -> None:
        if not self.body.done.is_set():
            STOP.request(f"stopped: the Prefect API did not answer for {silent_s:.0f} s")
            self.body.done.wait(STAGE_STOP_WAIT_S + 10)
        summary = self.body.summary  # the run's own, as its flow body ended
        status = summary.status if summary else None
        _tell(
            f"\nThe Prefect API at {self.api_url} has not answered for {silent_s:.0f} s (--lost-api-wait-s {self.wait_s:g}): "
            f"the orchestrator could not be told how this run ended. The run's outcome is '{status or 'unknown'}', "
            f"in {self.summary_path}. Exiting.\n"
        )
        if status != "completed" and summary and summary.run_name:
            _tell(f"To resume: {resume_command(summary.run_name, summary.storage_root, self.argv, summary.module)}\n")
        os._exit(0 if status == "completed" else 1)

    def __enter__(self) -> ApiWatch:
        self._token = _WATCHED.set(self.body)
        self._thread.start()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._stop.set()
        _WATCHED.reset(self._token)
