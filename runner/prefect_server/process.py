"""The temporary Prefect server the CLI starts: in a session of its own, and gone when the CLI is.

Prefect's ``SubprocessASGIServer`` runs uvicorn in the CLI's process group, so the terminal's
Ctrl-C reached the server at once and the flow could no longer record how it stopped; and after
a SIGKILL of the CLI the server lived on (re-parented to PID 1) until killed by hand. Here:

* ``OwnedServer`` starts the same uvicorn command in a new session (no terminal signals) through
  this module, and the CLI stops it itself, last (``runner.cluster.runtime.prefect_api``);
* ``python -m runner.prefect_server.process <parent pid> <uvicorn args>`` watches the parent: when it is
  gone (its parent pid changes), the server stops itself, so nothing outlives the run.

A parent-death signal (``PR_SET_PDEATHSIG``) would fire when the *thread* that started the server
ends, and the CLI starts it from a helper thread (side by side with Ray), hence the watcher.

Its start (``OwnedServer.start``, in place of Prefect's) is made for a first start on a busy
machine: a fresh SQLite database runs all of Prefect's migrations first, which took 6-31 s on 2
busy cores (docs/operations.md), against Prefect's 20 s default. So it waits
``STARTUP_TIMEOUT_S`` unless ``PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS`` is set in the
environment or the profile, by the clock (Prefect counts 0.1 s per poll, whatever a poll took),
fails at once when the server exits, and only counts a health answer on the server's own port
(Prefect kept a stale one: a port first taken by Ray's dashboard ended in "401 Unauthorized").
The server's output goes to ``server_log_path()`` so a failure has a log to point at.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

PARENT_POLL_S = 0.5
STOP_GRACE_S = 5.0  # after SIGTERM to itself, uvicorn's graceful shutdown gets this long

# How long the CLI's temporary server may take to answer, unless the user set Prefect's
# PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS (default 20), which a first start on a busy small
# machine can pass (docs/design.md); a server that exits fails at once anyway.
STARTUP_TIMEOUT_S = 180
TIMEOUT_SETTING = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"
LOG_NAME = "temporary-server.log"  # in PREFECT_HOME, beside the server's database
LOG_ROTATE_BYTES = 5_000_000  # a larger log moves to <name>.1 at the next start
RAY_DASHBOARD_PORT = 8265  # Ray's default dashboard port, inside Prefect's port range: never the server's


class ServerStartError(RuntimeError):
    """The temporary Prefect server did not come up; ``reason`` says how, ``log_path`` holds its output."""

    def __init__(self, reason: str, log_path: Path, timeout_s: float, timed_out: bool = False):
        super().__init__(f"the temporary Prefect server did not start: {reason} (its log: {log_path})")
        self.reason, self.log_path, self.timeout_s, self.timed_out = reason, log_path, timeout_s, timed_out


def startup_timeout_s() -> int:
    """Seconds the temporary server may take to start: the user's own setting, else ``STARTUP_TIMEOUT_S``."""
    from prefect.settings import get_current_settings  # read when called, after PREFECT_* are set

    ephemeral = get_current_settings().server.ephemeral
    if "startup_timeout_seconds" in ephemeral.model_fields_set:  # set in the environment or the profile
        return ephemeral.startup_timeout_seconds
    return STARTUP_TIMEOUT_S


def server_log_path() -> Path:
    """Where the temporary server's output goes: PREFECT_HOME/temporary-server.log (the temp folder if unwritable)."""
    from prefect.settings import get_current_settings  # read when called, after PREFECT_* are set

    home = Path(get_current_settings().home).expanduser()
    try:
        home.mkdir(parents=True, exist_ok=True)
        path = home / LOG_NAME
        with open(path, "ab"):
            pass
        return path
    except OSError:
        return Path(tempfile.gettempdir()) / f"prefect-{LOG_NAME}"


def watch_parent(parent_pid: int) -> None:
    """Stop this process (SIGTERM, then exit) once ``parent_pid`` is no longer its parent."""
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_S)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(STOP_GRACE_S)
    os._exit(1)


def owned_server_class() -> type:
    """A ``SubprocessASGIServer`` whose uvicorn runs under this module (imported late: Prefect's server is heavy)."""
    from prefect.server.api.server import SubprocessASGIServer  # read when called, after PREFECT_* are set

    class OwnedServer(SubprocessASGIServer):
        log_path: Path | None = None  # set by start()

        def __init__(self, port: int | None = None):
            super().__init__(port)
            if not hasattr(self, "given_up"):
                self.given_up = threading.Event()  # set from another thread: start() stops waiting

        def find_available_port(self) -> int:
            while (port := super().find_available_port()) == RAY_DASHBOARD_PORT:
                pass
            return port

        def start(self, timeout: int | None = None) -> None:
            if not self.running:
                _start_and_wait(self, timeout or startup_timeout_s())

        def _run_uvicorn_command(self) -> subprocess.Popen[Any]:
            return _start_owned(self)

    return OwnedServer


def _start_and_wait(server: Any, timeout_s: float) -> None:
    """Start ``server`` and wait, by the clock, until its own port answers /health; ``ServerStartError`` if not."""
    import httpx  # httpx: only when a server is asked

    server.log_path = server_log_path()
    _rotate(server.log_path)
    deadline = time.monotonic() + timeout_s
    server.running = True
    try:
        if server.port is None:
            server.port = server.find_available_port()
        server.server_process = server._run_uvicorn_command()
        atexit.register(server.stop)
        with httpx.Client(timeout=5.0) as client:
            while True:
                code = server.server_process.poll()
                if code == 3 and not server.is_port_available(server.port):
                    # uvicorn's exit code for "address already in use" (and for a failed startup, when
                    # the port is still free): another port, as Prefect does
                    server.port = server.find_available_port()
                    server.server_process = server._run_uvicorn_command()
                    continue
                if code is not None:
                    raise ServerStartError(f"it exited with code {code} while starting", server.log_path, timeout_s)
                if _healthy(client, server.api_url) and server.server_process.poll() is None:
                    return
                if server.given_up.is_set():
                    raise ServerStartError("its start was abandoned", server.log_path, timeout_s)
                if time.monotonic() > deadline:
                    reason = f"it did not answer within {timeout_s:g} s"
                    raise ServerStartError(reason, server.log_path, timeout_s, timed_out=True)
                time.sleep(0.1)
    except BaseException as exc:
        server.stop()  # nothing half-started stays behind
        _log_line(server.log_path, f"stopped the server: {getattr(exc, 'reason', None) or type(exc).__name__}")
        raise


def _healthy(client: Any, api_url: str) -> bool:
    """Whether ``api_url`` answers /health as a Prefect server does (200 and ``true``)."""
    import httpx  # httpx: only when a server is asked

    try:
        response = client.get(f"{api_url}/health")
        return response.status_code == 200 and response.json() is True
    except (httpx.HTTPError, ValueError):
        return False


def _log_line(log_path: Path, text: str) -> None:
    """A line of the CLI's own in the server's log: ``--- <time> CLI pid <pid>: <text>``."""
    now = datetime.now().astimezone().isoformat(timespec="seconds")
    try:
        with open(log_path, "a") as log:
            log.write(f"--- {now} CLI pid {os.getpid()}: {text}\n")
    except OSError:
        pass


def _rotate(log_path: Path) -> None:
    try:
        if log_path.stat().st_size > LOG_ROTATE_BYTES:
            log_path.replace(log_path.with_name(log_path.name + ".1"))
    except OSError:
        pass


def _start_owned(server: Any) -> subprocess.Popen[Any]:
    """Prefect's own uvicorn command and environment (``SubprocessASGIServer._run_uvicorn_command``), under the watcher.

    Its output (uvicorn's and the server's own log lines) is appended to ``server.log_path``, after a header line.
    """
    import prefect  # read when called, after PREFECT_* are set
    from prefect.settings import get_current_settings  # read when called, after PREFECT_* are set

    # Its Prometheus metrics at /api/metrics (flow and task runs by state, ...): what a scrape of the run's Prefect finds.
    server_env = {"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1",
                  "PREFECT_SERVER_METRICS_ENABLED": "true"}
    uvicorn_args = [
        "--app-dir", str(prefect.__module_path__.parent),
        "--factory", "prefect.server.api.server:create_app",
        "--host", "127.0.0.1", "--port", str(server.port),
        "--log-level", "error", "--lifespan", "on",
    ]
    log_path = server.log_path or server_log_path()
    _log_line(log_path, f"temporary Prefect server on 127.0.0.1:{server.port}")
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "runner.prefect_server.process", str(os.getpid()), *uvicorn_args],
            env={**os.environ, **server_env, **get_current_settings().to_environment_variables(exclude_unset=True)},
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,  # the terminal's Ctrl-C goes to the CLI only
        )


def main(argv: list[str]) -> None:
    parent_pid, uvicorn_args = int(argv[0]), argv[1:]
    threading.Thread(target=watch_parent, args=(parent_pid,), name="watch-parent", daemon=True).start()
    import uvicorn.main  # uvicorn: only in the server's own process

    sys.argv = ["uvicorn", *uvicorn_args]
    uvicorn.main.main()  # exits when uvicorn stops; exit code 3 when the port is taken, as Prefect expects


if __name__ == "__main__":
    main(sys.argv[1:])
