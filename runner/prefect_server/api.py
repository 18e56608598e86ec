"""The Prefect API a run reports to: the configured one, or a local server this process starts.

A task running in a Ray worker does not inherit the flow's Prefect API. Left alone, every Ray worker
started its own temporary Prefect server, its task runs never reached the flow's API, and SQLite
reported "database is locked" (docs/design.md, "Measurements behind the code"). So the flow always
runs against a real API URL (the CLI starts a local server when none is configured, `prefect_api`),
and `runner.cluster.ray_init` hands that URL to every Ray worker.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from prefect.settings import (
    PREFECT_API_URL,
    PREFECT_SERVER_ANALYTICS_ENABLED,
    get_current_settings,
    temporary_settings,
)

from runner.prefect_server.process import owned_server_class
from runner.stopping import STOP

if TYPE_CHECKING:
    from prefect.server.api.server import SubprocessASGIServer


def current_api_url() -> str | None:
    """The Prefect API this process talks to, including a temporary server started for it."""
    url = get_current_settings().api.url
    if url:
        return url
    from prefect.server.api.server import SubprocessASGIServer  # the server: about a second to import

    server = SubprocessASGIServer._instances.get(None)
    return server.api_url if server is not None and server.running else None


@contextmanager
def prefect_api(alongside: Callable[[str], None] | None = None) -> Iterator[str]:
    """Use the configured PREFECT_API_URL, or start a local Prefect server on 127.0.0.1 for this process.

    Starting it explicitly (rather than letting Prefect start one lazily) gives the run a
    URL that Ray workers can be told about. ``alongside(url)`` runs in this thread while the
    server starts in another (its port is picked first, so the URL is known); the block is
    entered once both are done. The URL yielded is the server's final one.
    """
    url = current_api_url()
    if url:
        if alongside is not None:
            alongside(url)
        yield url
        return
    server = _start_local_server(alongside)
    previous = os.environ.get("PREFECT_API_URL")
    os.environ["PREFECT_API_URL"] = server.api_url  # inherited by a local Ray started later
    try:
        with temporary_settings(updates={PREFECT_API_URL: server.api_url}):
            yield server.api_url
    finally:
        if previous is None:
            os.environ.pop("PREFECT_API_URL", None)
        else:
            os.environ["PREFECT_API_URL"] = previous
        # Now, not at interpreter exit (Prefect's atexit hook): the run is over. Its last log
        # lines are sent first, or they would meet a closed port.
        from prefect.logging.handlers import APILogHandler  # the server: about a second to import

        try:
            APILogHandler().flush()  # blocks until the queued log lines are sent (at most 5 s)
        finally:
            server.stop()


def _start_local_server(alongside: Callable[[str], None] | None) -> SubprocessASGIServer:
    """`prefect_api`'s local server, started in another thread while ``alongside(url)`` runs in this one.

    Its port is picked first, so the URL is known before the server answers. Returns once both
    are done; raises what either raised (the server stopped first when ``alongside`` failed).
    """
    server = owned_server_class()()  # its own session, stops when this process is gone (runner.prefect_server.process)
    server.port = server.find_available_port()
    failures: list[BaseException] = []

    def start() -> None:
        try:
            with temporary_settings(updates={PREFECT_SERVER_ANALYTICS_ENABLED: False}):
                server.start()  # ServerStartError when it does not come up (runner.prefect_server.process)
        except BaseException as exc:  # raised again in the calling thread
            failures.append(exc)

    starter = threading.Thread(target=start, name="prefect-server-start", daemon=True)
    starter.start()
    try:
        if alongside is not None:
            alongside(server.api_url)
    except BaseException:
        server.given_up.set()  # no wait for a server this run no longer needs
        starter.join()
        server.stop()
        raise
    while starter.is_alive():
        starter.join(0.2)
        if STOP.requested:  # Ctrl-C or SIGTERM while it starts: no waiting out its startup timeout
            server.given_up.set()
    if failures:
        raise failures[0]
    return server
