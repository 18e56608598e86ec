"""Where the flow's stages run, for a command-line run: one Prefect API and one Ray cluster, wired to see each other.

`cli_runtime` starts (or reaches) both side by side, warms the local Ray's workers, and turns a start
that fails into one message and exit code 3 (`StartFailed`). The Prefect side is `runner.prefect_server.api`,
the Ray side `runner.cluster.ray_init`.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import NamedTuple

from pipeline_config import RayConfig
from runner.cluster.ray_init import local_gcs_port, ray_init_args
from runner.prefect_server.api import current_api_url, prefect_api
from runner.prefect_server.process import TIMEOUT_SETTING, ServerStartError
from runner.stopping import STOP, sigterm_handler_kept


class Runtime(NamedTuple):
    """What ``cli_runtime`` started or joined, for the CLI to tell the person at the terminal."""

    api_url: str
    temporary_server: bool  # the CLI started the Prefect server: runs vanish when it stops
    dashboard_url: str | None  # the local Ray's dashboard, while the run lasts


@contextmanager
def cli_runtime(cfg: RayConfig, ray_now: bool = True, warm: str | None = None) -> Iterator[Runtime]:
    """The Prefect API and, for a local Ray, Ray itself, for a run of ``python -m flows.mnist``.

    With no ``ray.address`` the local Ray is started here, with the API's URL in the workers'
    environment: while the temporary Prefect server comes up in another thread when
    PREFECT_API_URL is unset (the two starts overlap instead of adding up), at once otherwise. The flow's RayTaskRunner finds Ray running and uses it, and Ray is shut
    down when the block ends. With ``ray.address`` the flow's RayTaskRunner joins that cluster.

    If either does not start, the CLI prints what failed, where its log is and what to do, and
    exits with ``START_FAILED_EXIT_CODE`` (``StartFailed``) instead of a traceback.

    ``ray_now=False`` (a run that may end before training, ``promote.skip_unchanged``): only the API;
    the flow's RayTaskRunner starts the local Ray if the run goes on to its stages.

    ``warm``: the flow's module, which the local Ray's workers import as soon as it is up
    (`warm_stage_workers`).
    """
    temporary = current_api_url() is None
    if cfg.address is not None or not ray_now:
        with ExitStack() as stack:
            url = _started(lambda: stack.enter_context(prefect_api()))
            yield Runtime(url, temporary, None)
        return
    import ray  # Ray: only where the cluster is used

    given: list[str] = []
    dashboard: list[str | None] = [None]

    def start_ray(url: str) -> None:
        address, kwargs = ray_init_args(cfg, url)
        try:
            with sigterm_handler_kept(), local_gcs_port(kwargs):  # SIGTERM stays the CLI's (runner/stopping.py)
                context = ray.init(address, **kwargs)
        except Exception as exc:
            raise RayStartError(exc) from exc
        dashboard[0] = f"http://{context.dashboard_url}" if context.dashboard_url else None
        given.append(url)
        # The run's first stage would start a second worker (and import the same again) while this one still imports:
        # the wait ends with the warm-up, or with the server's start if that comes later (the two run side by side).
        refs = warm_stage_workers(warm)
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=WARM_UP_WAIT_S)

    with ExitStack() as stack:
        try:
            url = _started(lambda: stack.enter_context(prefect_api(alongside=start_ray)))
        except StartFailed:
            ray.shutdown()  # nothing half-started stays behind
            raise
        stack.callback(ray.shutdown)  # Ray first, the server last (it still takes the run's last log lines)
        if given != [url]:  # the server had to move to another port while starting
            ray.shutdown()
            _started(lambda: start_ray(url))
        yield Runtime(url, temporary, dashboard[0])


WARM_UP_WAIT_S = 30.0  # a warm-up that takes longer is left to finish on its own (the first stage imports for itself)

# Prefect's task engine, as prefect-ray's entry point runs it in a Ray worker; `warm_stage_workers`
# adds the flow's own module, which a stage's pickled flow-run context refers to.
STAGE_ENGINE_MODULES = ("prefect_ray.task_runners", "prefect.task_engine")


def _import_quietly(modules: tuple[str, ...]) -> None:
    """Import ``modules`` (a warm-up: an import that fails here fails again, and is reported, in the stage itself)."""
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - nothing to report from a warm-up
            return


def warm_stage_workers(flow_module: str | None) -> list:
    """Have the worker processes of a local Ray just started import what a stage's task needs, without waiting.

    A Ray worker imports Prefect's task engine and the flow's module (the stages, torch) the first
    time it runs a stage; on 2 cores that made the first stages of a run wait seconds on cold workers
    even when their output is already verified on storage.
    One task imports them as soon as Ray is up, while the Prefect server and the flow run are still
    starting, into the idle worker the stages then get: Ray hands a task the worker that went idle last,
    and the stages run one after another (tests/test_warm_workers.py). It holds its CPU only while it
    imports. One task per CPU warmed a second worker that no stage used and that held 110-150 MB beside
    training (docs/performance.md, "Training started without torch, data that fits without Ray Data"). The CLI's local
    Ray only: a deployment's flow run starts Ray in its RayTaskRunner, with no server start to overlap
    (docs/design.md, "Measurements behind the code"). Returns the task's ref in a list (nobody needs to wait on it).
    """
    if not flow_module:
        return []
    import ray  # Ray: only where the cluster is used

    modules = (*STAGE_ENGINE_MODULES, flow_module)
    try:
        warm = ray.remote(num_cpus=1, max_retries=0)(_import_quietly)
        return [warm.remote(modules)]
    except Exception:  # noqa: BLE001 - a warm-up never fails the run: the stages import for themselves
        return []


START_FAILED_EXIT_CODE = 3  # the CLI's exit code when its Prefect server or local Ray did not start


class StartFailed(SystemExit):
    """Ends the CLI with ``START_FAILED_EXIT_CODE`` (or a stop's 130/143) once its message is printed: no traceback."""

    def __init__(self, message: str, code: int = START_FAILED_EXIT_CODE):
        super().__init__(code)
        self.message = message


class RayStartError(RuntimeError):
    """``ray.init`` of the run's local Ray failed; the cause is chained."""


def ray_logs_dir() -> Path:
    """Where a local Ray keeps its processes' logs (its newest session's)."""
    return Path(os.environ.get("RAY_TMPDIR") or "/tmp") / "ray" / "session_latest" / "logs"


def _started(start: Callable[[], str | None]):
    """``start()``; a Prefect server or local Ray that did not start becomes ``StartFailed``, its message printed."""
    try:
        return start()
    except ServerStartError as exc:
        if STOP.requested:  # abandoned on Ctrl-C or SIGTERM: a stop, not a failure
            message = f"{STOP.reason} while the Prefect server was starting: nothing ran."
            print(message, file=sys.stderr, flush=True)
            raise StartFailed(message, STOP.exit_code() or START_FAILED_EXIT_CODE) from None
        message = start_failed_message(exc)
    except RayStartError as exc:
        message = start_failed_message(exc)
    print(message, file=sys.stderr, flush=True)
    raise StartFailed(message)


def start_failed_message(exc: ServerStartError | RayStartError) -> str:
    """What failed, where its log is, what to do: the one message a failed start prints."""
    if isinstance(exc, ServerStartError):
        more_time = f"; or give it more time with\n              {TIMEOUT_SETTING} (now {exc.timeout_s:g} s)"
        return (
            f"The temporary Prefect server did not start: {exc.reason}.\n"
            f"  its log     {exc.log_path} (this start: from '--- ... CLI pid {os.getpid()}: temporary ...')\n"
            f"  what to do  run again; or point PREFECT_API_URL at a running Prefect server (`prefect server start`,\n"
            f"              then PREFECT_API_URL=http://127.0.0.1:4200/api){more_time if exc.timed_out else ''}"
        )
    cause = exc.__cause__ or exc
    first_line = (str(cause).strip().splitlines() or [""])[0][:300]
    return (
        f"The local Ray did not start: {type(cause).__name__}: {first_line}\n"
        f"  its logs    {ray_logs_dir()}\n"
        f"  what to do  run again; or set ray.address (--ray.address) to a running Ray cluster (`ray start --head`)"
    )
