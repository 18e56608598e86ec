"""The temporary Prefect server the CLI starts: in a session of its own, and gone when the CLI is.

Prefect's ``SubprocessASGIServer`` runs uvicorn in the CLI's process group, so the terminal's
Ctrl-C reached the server at once and the flow could no longer record how it stopped; and after
a SIGKILL of the CLI the server lived on (re-parented to PID 1) until killed by hand. Here:

* ``OwnedServer`` starts the same uvicorn command in a new session (no terminal signals) through
  this module, and the CLI stops it itself, last (``flows.runtime.prefect_api``);
* ``python -m flows.server_process <parent pid> <uvicorn args>`` watches the parent: when it is
  gone (its parent pid changes), the server stops itself, so nothing outlives the run.

A parent-death signal (``PR_SET_PDEATHSIG``) would fire when the *thread* that started the server
ends, and the CLI starts it from a helper thread (side by side with Ray), hence the watcher.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

PARENT_POLL_S = 0.5
STOP_GRACE_S = 5.0  # after SIGTERM to itself, uvicorn's graceful shutdown gets this long


def watch_parent(parent_pid: int) -> None:
    """Stop this process (SIGTERM, then exit) once ``parent_pid`` is no longer its parent."""
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_S)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(STOP_GRACE_S)
    os._exit(1)


def owned_server_class() -> type:
    """A ``SubprocessASGIServer`` whose uvicorn runs under this module (imported late: Prefect's server is heavy)."""
    from prefect.server.api.server import SubprocessASGIServer

    class OwnedServer(SubprocessASGIServer):
        def _run_uvicorn_command(self) -> subprocess.Popen[Any]:
            return _start_owned(self)

    return OwnedServer


def _start_owned(server: Any) -> subprocess.Popen[Any]:
    """Prefect's own uvicorn command and environment (``SubprocessASGIServer._run_uvicorn_command``), under the watcher."""
    import prefect
    from prefect.settings import get_current_settings

    server_env = {"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
    uvicorn_args = [
        "--app-dir", str(prefect.__module_path__.parent),
        "--factory", "prefect.server.api.server:create_app",
        "--host", "127.0.0.1", "--port", str(server.port),
        "--log-level", "error", "--lifespan", "on",
    ]
    return subprocess.Popen(
        [sys.executable, "-m", "flows.server_process", str(os.getpid()), *uvicorn_args],
        env={**os.environ, **server_env, **get_current_settings().to_environment_variables(exclude_unset=True)},
        start_new_session=True,  # the terminal's Ctrl-C goes to the CLI only
    )


def main(argv: list[str]) -> None:
    parent_pid, uvicorn_args = int(argv[0]), argv[1:]
    threading.Thread(target=watch_parent, args=(parent_pid,), name="watch-parent", daemon=True).start()
    import uvicorn.main

    sys.argv = ["uvicorn", *uvicorn_args]
    uvicorn.main.main()  # exits when uvicorn stops; exit code 3 when the port is taken, as Prefect expects


if __name__ == "__main__":
    main(sys.argv[1:])
