"""A real Prefect server on 127.0.0.1 and the ``deployments.serve`` process, driven over its REST API.

``PrefectServer`` is ``prefect server start`` with a fresh SQLite database; ``serve_deployments``
serves the four deployments against it; ``ui_run_body`` is what the UI's run form posts;
``wait_for``, ``stop_group`` and ``log_tail`` poll, stop and report on the processes a test starts;
``embedded_png`` reads the picture a markdown artifact carries.
"""

from __future__ import annotations

import base64
import copy
import io
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image

from deployments.serve import preset_parameters, tune_preset_parameters
from tests.support.models import SMALL_MODEL
from tests.support.ray_cluster import SharedRay, serve_args, serve_env

PREFECT = str(Path(sys.executable).with_name("prefect"))
FLOW = "mnist-resnet18"
TUNE_FLOW = "mnist-resnet18-tune"
TRAIN_FLOW = "train"  # the generic flow (flows.train)
# (flow, deployment) of everything ``python -m deployments.serve`` registers; every flow has a "manual".
SERVED = ((FLOW, "nightly"), (FLOW, "manual"), (TUNE_FLOW, "manual"), (TRAIN_FLOW, "manual"))
FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
RUN_TIMEOUT_S = 780  # a smoke run takes ~2-4 minutes on this 2-core machine


def free_port() -> int:
    """A TCP port nobody listens on right now (127.0.0.1)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(check: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 1.0) -> Any:
    """Call ``check`` until it returns something truthy; fail the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = check()
        except httpx.HTTPError:
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(interval_s)


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without any Prefect API or profile settings, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API", "PREFECT_PROFILE", "PREFECT_HOME"))}
    env.update(PREFECT_SERVER_ANALYTICS_ENABLED="false", PYTHONUNBUFFERED="1", **extra)
    return env


def api_env(api_url: str, **extra: str) -> dict[str, str]:
    """This environment for a CLI run against the Prefect API at ``api_url`` (``PREFECT_API_URL``), plus ``extra``.

    No other Prefect API or profile setting and no test hook (``MNIST_FAULT_INJECT``,
    ``MNIST_RECORD_ROWS``) is inherited: a run gets those only from ``extra``.
    """
    from training.worker.faults import TEST_HOOK_ENVS

    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API", "PREFECT_PROFILE")) and k not in TEST_HOOK_ENVS}
    return env | {"PREFECT_API_URL": api_url, **extra}


@contextmanager
def using_api(api_url: str) -> Iterator[None]:
    """This process's Prefect client on ``api_url`` for the block (a flow called in-process reports there).

    Its queued logs and events are sent before the block ends, as ``prefect_test_harness`` does on
    exit: left queued, they would be sent at interpreter exit with no API configured, and Prefect
    would start a temporary server just for them.
    """
    import inspect

    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.utilities.asyncutils import run_coro_as_sync

    async def drain() -> None:
        try:
            sent = APILogWorker.instance().drain()
            if inspect.isawaitable(sent):
                await sent
        except RuntimeError:  # the worker never started
            pass
        sent = EventsWorker.drain_all()
        if inspect.isawaitable(sent):
            await sent

    with temporary_settings(updates={PREFECT_API_URL: api_url}):
        try:
            yield
        finally:
            run_coro_as_sync(drain())


def stop_group(proc: subprocess.Popen, grace_s: float = 30) -> None:
    """SIGTERM the process group this test started, SIGKILL it if it lingers."""
    if proc.poll() is not None:
        return
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def log_tail(path: Path, chars: int = 4000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.is_file() else "(no log)"


class PrefectServer:
    """``prefect server start`` on 127.0.0.1 with its own PREFECT_HOME (a fresh SQLite database)."""

    def __init__(self, home: Path):
        self.home, self.port = home, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api = f"{self.url}/api"
        self.log = home / "server.log"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 120) -> PrefectServer:
        self.home.mkdir(parents=True, exist_ok=True)
        # The UI asks /ui-settings where the API is; prefect 3.8.8 answers from these settings,
        # not from --port, so without them the UI would call port 4200.
        env = clean_env(  # its Prometheus metrics on, as the CLI's temporary server has them (/api/metrics)
            PREFECT_HOME=str(self.home), PREFECT_SERVER_API_HOST="127.0.0.1", PREFECT_SERVER_API_PORT=str(self.port),
            PREFECT_SERVER_METRICS_ENABLED="true",
        )
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(self.port)],
                env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            )
        wait_for(self._healthy, timeout_s, f"the Prefect server on {self.url}\n{log_tail(self.log)}")
        return self

    def _healthy(self) -> bool:
        if self.proc.poll() is not None:
            pytest.fail(f"prefect server exited with {self.proc.returncode}:\n{log_tail(self.log)}")
        return httpx.get(f"{self.api}/health", timeout=2).status_code == 200

    def stop(self) -> None:
        if self.proc is not None:
            stop_group(self.proc)

    def request(self, method: str, path: str, **kwargs) -> httpx.Response:
        """One API call, retried on 503 the way Prefect's own client retries it.

        The server answers 503 when SQLite reports SQLITE_BUSY / SQLITE_BUSY_SNAPSHOT (a
        transient lock, prefect/server/api/server.py ``is_client_retryable_exception``); the
        write was rolled back, so sending it again is safe. Seen once in CI on this 2-core
        machine while a flow run was writing logs.
        """
        for attempt in range(6):
            response = httpx.request(method, f"{self.api}{path}", timeout=30, **kwargs)
            if response.status_code != 503:
                return response
            time.sleep(2**attempt)
        return response

    def get(self, path: str, **kwargs) -> Any:
        response = self.request("GET", path, **kwargs)
        response.raise_for_status()
        return response.json()

    def post(self, path: str, body: dict | None = None) -> Any:
        response = self.request("POST", path, json=body or {})
        response.raise_for_status()
        return response.json()

    def deployment(self, name: str, flow: str = FLOW) -> dict:
        """A deployment by name; ``flow`` tells the two "manual" ones apart (default: the training flow's)."""
        return self.get(f"/deployments/name/{flow}/{name}")

    def flow_run(self, flow_run_id: str) -> dict:
        return self.get(f"/flow_runs/{flow_run_id}")

    def task_runs(self, flow_run_id: str) -> list[dict]:
        return self.post("/task_runs/filter", {"flow_runs": {"id": {"any_": [flow_run_id]}}})

    def artifacts(self, flow_run_id: str) -> list[dict]:
        return self.post("/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [flow_run_id]}}})

    def logs(self, flow_run_id: str) -> list[dict]:
        return self.post("/logs/filter", {"logs": {"flow_run_id": {"any_": [flow_run_id]}}, "limit": 200})

    def wait_final(self, flow_run_id: str, log: Path, timeout_s: float = RUN_TIMEOUT_S) -> dict:
        """Poll a flow run until it reaches a final state; returns the flow run."""

        def final() -> dict | None:
            run = self.flow_run(flow_run_id)
            return run if run["state_type"] in FINAL else None

        return wait_for(final, timeout_s, f"flow run {flow_run_id} to finish\n{log_tail(log)}", interval_s=1)


# How often the served runner asks for runs to start (and for cancellations): Prefect's default is 10 s, so
# every test run waited 5 s on average before it started. A user's `serve` keeps the default.
RUNNER_POLL_S = "2"


def serve_deployments(server: PrefectServer, cwd: Path, *args: str, ray: SharedRay | None = None, **env: str) -> subprocess.Popen:
    """Start ``python -m deployments.serve`` against ``server``; return once its four deployments exist.

    ``ray``: the cluster its runs join (``--ray-address``, with the token authentication it asks); by
    default the serving process starts a head of its own. Its runner polls every ``RUNNER_POLL_S``
    seconds (``PREFECT_RUNNER_POLL_FREQUENCY``) unless ``env`` says otherwise."""
    log = cwd / "serve.log"
    env = {"PREFECT_RUNNER_POLL_FREQUENCY": RUNNER_POLL_S, **env}
    if ray is not None:
        args, env = (*args, *serve_args(ray)), {**env, **serve_env(ray)}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "deployments.serve", *args],
            cwd=cwd, env=clean_env(PREFECT_HOME=str(server.home), PREFECT_API_URL=server.api, **env),
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )

    def registered() -> bool:
        if proc.poll() is not None:
            pytest.fail(f"deployments.serve exited with {proc.returncode}:\n{log_tail(log)}")
        for flow, name in SERVED:
            if server.request("GET", f"/deployments/name/{flow}/{name}").status_code != 200:
                return False
        return "being served" in log.read_text(errors="replace")

    wait_for(registered, 180, f"the four deployments to be served\n{log_tail(log)}")
    return proc


def far_cron() -> str:
    """A daily cron 12 hours from now: a real schedule that cannot fire while the test runs."""
    return f"0 {(datetime.now(timezone.utc).hour + 12) % 24} * * *"


def ui_run_body(deployment: dict, parameters: dict, name: str) -> dict:
    """The body the UI's custom-run form (Run > Custom run > Submit) POSTs to /deployments/{id}/create_flow_run.

    Read from the Prefect 3.8.8 UI bundle (deployment run route): it sends the edited
    parameters with the deployment's tags, work queue and schema enforcement, in a SCHEDULED
    state with no scheduled time ("now").
    """
    return {
        "name": name,
        "work_queue_name": deployment.get("work_queue_name"),
        "empirical_policy": {"resuming": False, "max_retries": 0, "retry_delay_seconds": 0, "retries": 0, "retry_delay": 0},
        "state": {
            "type": "SCHEDULED",
            "message": "",
            "state_details": {"pause_reschedule": False, "deferred": False, "untrackable_result": False, "scheduled_time": None},
        },
        "tags": deployment.get("tags") or [],
        "job_variables": None,
        "enforce_parameter_schema": deployment["enforce_parameter_schema"],
        "parameters": parameters,
    }


def smoke_config(storage: Path, run_name: str, *, model: str = SMALL_MODEL, **train: Any) -> dict:
    """The smoke preset's config as JSON, with a storage root, a run name, train overrides and ``model.name``
    (the small model by default: these runs prove the deployment path, not the network)."""
    config = copy.deepcopy(preset_parameters("smoke")["config"])
    config.update(storage_root=str(storage), run_name=run_name, model={"name": model})
    config["train"].update(train)
    return config


def tune_smoke_config(storage: Path, run_name: str, *, model: str = SMALL_MODEL, **tune: Any) -> dict:
    """The tune flow's smoke preset as JSON (4 trials x 2 epochs, sample data) with storage root, run name,
    tune overrides and ``model.name`` (the small model by default)."""
    config = copy.deepcopy(tune_preset_parameters("smoke")["config"])
    config.update(storage_root=str(storage), run_name=run_name, model={"name": model})
    config["tune"].update(tune)
    return config


def embedded_png(markdown: str) -> Image.Image:
    """The PNG picture a markdown artifact embeds as a data URI."""
    match = re.search(r"\(data:image/png;base64,([A-Za-z0-9+/=]+)\)", markdown)
    assert match, markdown[:300]
    image = Image.open(io.BytesIO(base64.b64decode(match.group(1))))
    image.load()
    return image
