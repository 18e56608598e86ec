"""Where the flow's stages run: one Prefect API and one Ray cluster, wired to see each other.

Measured pitfall this module exists for: a task running in a Ray worker does not inherit the
flow's Prefect API. Left alone, every Ray worker starts its own temporary Prefect server, its
task runs never reach the flow's API, and SQLite reports "database is locked". So the flow
always runs against a real API URL (the CLI starts a local server when none is configured) and
hands that URL to every Ray worker through the job's runtime environment.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from prefect.settings import (
    PREFECT_API_URL,
    PREFECT_SERVER_ANALYTICS_ENABLED,
    get_current_settings,
    temporary_settings,
)
from prefect_ray import RayTaskRunner

from pipeline_config import RayConfig
from runner.ray_head import served
from runner.server_process import TIMEOUT_SETTING, ServerStartError, owned_server_class
from runner.stopping import STOP, sigterm_handler_kept
from storage_io import S3_ENV_VARS
from training.faults import TEST_HOOK_ENVS

if TYPE_CHECKING:
    from prefect.server.api.server import SubprocessASGIServer


def current_api_url() -> str | None:
    """The Prefect API this process talks to, including a temporary server started for it."""
    url = get_current_settings().api.url
    if url:
        return url
    from prefect.server.api.server import SubprocessASGIServer

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
        from prefect.logging.handlers import APILogHandler

        try:
            APILogHandler().flush()  # blocks until the queued log lines are sent (at most 5 s)
        finally:
            server.stop()


def _start_local_server(alongside: Callable[[str], None] | None) -> SubprocessASGIServer:
    """`prefect_api`'s local server, started in another thread while ``alongside(url)`` runs in this one.

    Its port is picked first, so the URL is known before the server answers. Returns once both
    are done; raises what either raised (the server stopped first when ``alongside`` failed).
    """
    server = owned_server_class()()  # its own session, stops when this process is gone (runner.server_process)
    server.port = server.find_available_port()
    failures: list[BaseException] = []

    def start() -> None:
        try:
            with temporary_settings(updates={PREFECT_SERVER_ANALYTICS_ENABLED: False}):
                server.start()  # ServerStartError when it does not come up (runner.server_process)
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
    PREFECT_API_URL is unset (measured: 8.3-9.6 s one after the other, 6.2-6.7 s side by side),
    at once otherwise. The flow's RayTaskRunner finds Ray running and uses it, and Ray is shut
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
    import ray

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
        warm_stage_workers(warm)

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


# Prefect's task engine, as prefect-ray's entry point runs it in a Ray worker; `warm_stage_workers`
# adds the flow's own module, which a stage's pickled flow-run context refers to.
STAGE_ENGINE_MODULES = ("prefect_ray.task_runners", "prefect.task_engine")


def _import_quietly(modules: tuple[str, ...]) -> None:
    """Import ``modules`` (a warm-up: an import that fails here fails again, and is reported, in the stage itself)."""
    import importlib

    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - nothing to report from a warm-up
            return


def warm_stage_workers(flow_module: str | None) -> list:
    """Have the worker processes of a local Ray just started import what a stage's task needs, without waiting.

    A Ray worker imports Prefect's task engine and the flow's module (the stages, torch) the first
    time it runs a stage; on 2 cores that made the first stages of a run wait on cold workers
    (download 6.6-7.6 s and transform 6.7-7.6 s on the bundled sample, which is already verified).
    One task per CPU imports them as soon as Ray is up, while the Prefect server and the flow run
    are still starting, into the idle workers the stages then get (a task holds its CPU only while
    it imports). The CLI's local Ray only: in a deployment's flow run (its RayTaskRunner starts
    Ray, with no server start to overlap) one run each way gave no clear gain. Measured in
    docs/performance.md ("Warm stage workers"). Returns the tasks' refs (nobody needs to wait on them).
    """
    if not flow_module:
        return []
    import ray

    modules = (*STAGE_ENGINE_MODULES, flow_module)
    try:
        warm = ray.remote(num_cpus=1, max_retries=0)(_import_quietly)
        return [warm.remote(modules) for _ in range(max(1, int(ray.cluster_resources().get("CPU", 1))))]
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


# Keep idle workers alive between epochs. By default Ray kills idle task workers one second after
# they go idle once more workers exist than CPUs (and the Ray Data and Ray Train actors alone
# exceed that), so every epoch's shuffle and map tasks paid for fresh Python processes importing
# torch: measured 10-90 s per epoch on 2 cores instead of ~7, and with the per-epoch train
# pipeline (training.sharding.EpochShards) 8.4-8.7 s of data wait per epoch instead of 0.9-2.4.
# Applies to the local Ray a run starts; a cluster started with `ray start` takes the same values
# as RAY_num_workers_soft_limit / RAY_idle_worker_killing_time_threshold_ms in its environment.
LOCAL_RAY_SYSTEM_CONFIG = {"num_workers_soft_limit": 16, "idle_worker_killing_time_threshold_ms": 600_000}


# Ray Train's controller polls its workers every 2 s by default, so it notices a finished run (and
# every report) up to 2 s late. Measured on the empty worker group (benchmarks/overhead.py): 5.0 s
# from the training function's start to fit() returning with 2 s, 2.0 s with 0.5 s. Set for the
# processes that call fit() (Ray Train hands it on to its controller); a value in the environment wins.
RAY_TRAIN_ENV = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5"}


def ray_train_env() -> dict[str, str]:
    """`RAY_TRAIN_ENV`, with any of its variables already set in this process's environment kept."""
    return {name: os.environ.get(name, value) for name, value in RAY_TRAIN_ENV.items()}


def ray_init_args(cfg: RayConfig, api_url: str) -> tuple[str, dict]:
    """(address, ``ray.init`` keyword arguments) for ``cfg``, handing ``api_url`` to every Ray worker."""
    env_vars = {"PREFECT_API_URL": api_url, "RAY_DATA_DISABLE_PROGRESS_BARS": "1", **ray_train_env()}
    # S3 storage root settings (endpoint, region, credentials) and the test-only fault injection
    # and row logging switches (training/faults.py): a Ray worker does not see the driver's env.
    for name in (*S3_ENV_VARS, *TEST_HOOK_ENVS):
        if os.environ.get(name):
            env_vars[name] = os.environ[name]
    init_kwargs: dict = {
        "runtime_env": {"env_vars": env_vars},
        # The dashboard is what Ray's State API answers from: without it Ray Train's placement
        # group cleaner logged "Failed to query Ray Train Controller actor state" every 2-4 s
        # (200 lines of one default run). It binds to 127.0.0.1 and costs ~1.5 s at start.
        "include_dashboard": True,
        # Ray Data's per-epoch execution plans, Ray Train's and the stage tasks' logs are mirrored
        # into this terminal only when asked (ray.log_to_driver, the CLI's --verbose); the stage
        # logs reach the Prefect UI either way, and Ray keeps every worker's log in its session folder.
        "log_to_driver": cfg.log_to_driver,
        # Ray's own INFO lines in this process ("Started a local Ray instance ...") go with them.
        "logging_level": logging.INFO if cfg.log_to_driver else logging.WARNING,
    }
    if cfg.address is None:
        # "local" forces a new Ray for this run; a bare ray.init() would silently join any
        # cluster already running on this machine.
        address = "local"
        if cfg.num_cpus:
            init_kwargs["num_cpus"] = cfg.num_cpus
        init_kwargs["_system_config"] = LOCAL_RAY_SYSTEM_CONFIG
        # The workers get this Ray's address: code in them that looks the cluster up without one
        # (Ray Train's placement group cleaner, through the State API) otherwise fails with "Found
        # multiple active Ray instances" whenever a second local Ray runs on the machine, and the
        # placement group of a trial ASHA stopped keeps its CPUs. `local_gcs_port` starts the GCS there.
        env_vars["RAY_ADDRESS"] = f"{_node_ip()}:{_free_port()}"
    else:
        address = cfg.address
        init_kwargs.pop("include_dashboard")
    return address, init_kwargs


GCS_PORT_ENV = "RAY_GCS_SERVER_PORT"  # read by ray.init when it starts a head node


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def _node_ip() -> str:
    from ray._private.services import get_node_ip_address

    return get_node_ip_address()


@contextmanager
def local_gcs_port(init_kwargs: dict) -> Iterator[None]:
    """While a local Ray starts: its GCS on the port the workers' ``RAY_ADDRESS`` names (``RAY_GCS_SERVER_PORT``),
    and the workers' environment variables in this process's environment instead of a runtime env.

    The raylet starts here and every worker process it spawns inherits its environment, so the
    variables reach every worker without a runtime env; with one, each new worker process (every
    stage's first task, Ray Train's controller and workers, every actor) first went through Ray's
    runtime-env setup (an extra Python process): the first task took 1.6 s instead of 0.5 s on 2
    cores. ``init_kwargs`` loses its ``runtime_env`` (it only held these variables); this process's
    environment is restored once Ray has started. A cluster given by address keeps the runtime env.
    """
    runtime_env = init_kwargs.get("runtime_env") or {}
    env_vars = dict(runtime_env.get("env_vars") or {})
    address = env_vars.get("RAY_ADDRESS")
    if not address:
        yield
        return
    variables = {**env_vars, GCS_PORT_ENV: address.rsplit(":", 1)[1]}
    rest = {key: value for key, value in runtime_env.items() if key != "env_vars"}
    if rest:
        init_kwargs["runtime_env"] = rest
    else:
        init_kwargs.pop("runtime_env", None)
    before = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def ray_task_runner(cfg: RayConfig) -> RayTaskRunner:
    """A RayTaskRunner for ``cfg``: a fresh local Ray when no address is set, else that cluster; with no
    address in a run a serving process executes, its cluster (`runner.ray_head.SERVED_RAY_ENV`).

    When this process already runs Ray (`cli_runtime` started it), the runner uses that one.
    """
    api_url = current_api_url()
    if not api_url:
        raise RuntimeError(
            "no Prefect API URL: set PREFECT_API_URL or start the flow with `python -m flows.mnist`, "
            "which starts a local Prefect server; Ray workers must report to the flow's API"
        )
    cfg = served(cfg)  # a run that deployments.serve executes joins the serving process's cluster
    if cfg.address is not None:
        _log_in_run(f"Ray: joining the cluster at {cfg.address}")
    address, init_kwargs = ray_init_args(cfg, api_url)
    return SignalKeepingRayTaskRunner(address=address, init_kwargs=init_kwargs)


def _log_in_run(message: str) -> None:
    """``message`` in the flow run's log (the Prefect UI), when there is a flow run."""
    from prefect.exceptions import MissingContextError
    from prefect.logging import get_run_logger

    try:
        get_run_logger().info(message)
    except MissingContextError:
        pass


class SignalKeepingRayTaskRunner(RayTaskRunner):
    """A RayTaskRunner whose ``ray.init`` leaves the flow's SIGTERM handler in place (``stopping.sigterm_handler_kept``)."""

    def __enter__(self):
        with sigterm_handler_kept(), local_gcs_port(self.init_kwargs):
            return super().__enter__()
