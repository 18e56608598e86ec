"""How a run's Ray starts or is joined, and what every Ray worker is handed: `ray_init_args`, `ray_task_runner`.

Every worker gets the flow's Prefect API URL (`runner.prefect_server.api`: a Ray worker does not inherit it),
the S3 settings of the storage root and the test-only switches, since a Ray worker does not see the
driver's environment. A local Ray keeps idle workers alive between epochs (`LOCAL_RAY_SYSTEM_CONFIG`),
starts its GCS on the port its workers' ``RAY_ADDRESS`` names (`local_gcs_port`) and has Ray Train's
controller poll its workers every 0.5 s (`RAY_TRAIN_ENV`). The numbers behind these choices:
docs/design.md, "Measurements behind the code".
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

from prefect.exceptions import MissingContextError
from prefect.logging import get_run_logger
from prefect.runtime import flow_run
from prefect_ray import RayTaskRunner

from pipeline_config import RayConfig
from runner.cluster import cluster_slot
from runner.cluster.ray_head import LOCAL_RAY_SYSTEM_CONFIG, served
from runner.console import say
from runner.prefect_server.api import current_api_url
from runner.stopping import sigterm_handler_kept
from storage_io import S3_ENV_VARS
from training.worker.faults import TEST_HOOK_ENVS

# Ray Train's controller polls its workers every 2 s by default, so it notices a finished run (and
# every report) up to 2 s late; 0.5 s takes most of that wait off every fit() (docs/design.md). Set for the
# processes that call fit() (Ray Train hands it on to its controller); a value in the environment wins.
RAY_TRAIN_ENV = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5"}


def ray_train_env() -> dict[str, str]:
    """`RAY_TRAIN_ENV`, with any of its variables already set in this process's environment kept."""
    return {name: os.environ.get(name, value) for name, value in RAY_TRAIN_ENV.items()}


# A local Ray with a metrics port (ray.metrics_export_port): each process reports its metrics every 2 s (Ray's
# default 10 s), and the run keeps that Ray up METRICS_LINGER_S after its last stage, a report and one scrape of
# deployments/prometheus/prometheus.yml (5 s), so Prometheus gets the last stages' figures before Ray stops.
METRICS_REPORT_MS = 2000
METRICS_LINGER_S = 8.0


def linger_for_metrics(cfg: RayConfig) -> None:
    """After a run on a local Ray that serves metrics on a chosen port: wait `METRICS_LINGER_S`, saying so (see above)."""
    if served(cfg).address is None and cfg.metrics_export_port:
        say("keeping the local Ray's metrics up %gs for Prometheus's last scrape (ray.metrics_export_port %d)",
            METRICS_LINGER_S, cfg.metrics_export_port)
        time.sleep(METRICS_LINGER_S)


def ray_init_args(cfg: RayConfig, api_url: str) -> tuple[str, dict]:
    """(address, ``ray.init`` keyword arguments) for ``cfg``, handing ``api_url`` to every Ray worker."""
    env_vars = {"PREFECT_API_URL": api_url, "RAY_DATA_DISABLE_PROGRESS_BARS": "1", **ray_train_env()}
    # S3 storage root settings (endpoint, region, credentials) and the test-only fault injection
    # and row logging switches (training/worker/faults.py): a Ray worker does not see the driver's env.
    for name in (*S3_ENV_VARS, *TEST_HOOK_ENVS):
        if os.environ.get(name):
            env_vars[name] = os.environ[name]
    init_kwargs: dict = {
        "runtime_env": {"env_vars": env_vars},
        # The dashboard is what Ray's State API answers from: without it Ray Train's placement
        # group cleaner logged "Failed to query Ray Train Controller actor state" every 2-4 s
        # (hundreds of lines a run). It binds to 127.0.0.1; its start cost is in docs/design.md.
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
        if cfg.metrics_export_port:  # a port a person chose: someone scrapes it, every process reports more often
            init_kwargs["_metrics_export_port"] = cfg.metrics_export_port
            init_kwargs["_system_config"] = {**LOCAL_RAY_SYSTEM_CONFIG, "metrics_report_interval_ms": METRICS_REPORT_MS}
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
TOKEN_NOTICE_LOGGER = "ray._private.authentication.authentication_token_setup"  # Ray 2.59+: logs that token auth is on


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def _node_ip() -> str:
    from ray._private.services import get_node_ip_address  # Ray's internals: only where used

    return get_node_ip_address()


@contextmanager
def local_gcs_port(init_kwargs: dict) -> Iterator[None]:
    """While a local Ray starts: its GCS on the port the workers' ``RAY_ADDRESS`` names (``RAY_GCS_SERVER_PORT``),
    and the workers' environment variables in this process's environment instead of a runtime env.

    The raylet starts here and every worker process it spawns inherits its environment, so the
    variables reach every worker without a runtime env; with one, each new worker process (every
    stage's first task, Ray Train's controller and workers, every actor) first goes through Ray's
    runtime-env setup, an extra Python process (docs/design.md). ``init_kwargs`` loses its ``runtime_env`` (it only held these variables); this process's
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
    # Ray's WARNING "Token authentication is enabled for this Ray cluster" is not for a person to act on: token
    # auth stays on, and the CLI's Ray line names the token's file (`runner.console`). Quiet only while it starts.
    notice = logging.getLogger(TOKEN_NOTICE_LOGGER)
    level = notice.level
    notice.setLevel(logging.ERROR)
    try:
        yield
    finally:
        notice.setLevel(level)
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def ray_task_runner(cfg: RayConfig) -> RayTaskRunner:
    """A RayTaskRunner for ``cfg``: a fresh local Ray when no address is set, else that cluster; with no
    address in a run a serving process executes, its cluster (`runner.cluster.ray_head.SERVED_RAY_ENV`).

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
    try:
        get_run_logger().info(message)
    except MissingContextError:
        pass


class SignalKeepingRayTaskRunner(RayTaskRunner):
    """A RayTaskRunner whose ``ray.init`` leaves the flow's SIGTERM handler in place (``stopping.sigterm_handler_kept``),
    and which, on a cluster it joins, runs its tasks only while it holds the cluster's run slot (`runner.cluster.cluster_slot`):
    taken before the first stage (after the run's checks), freed when the runner exits."""

    _slot = None  # the run slot's actor while this runner holds it

    def __enter__(self):
        with sigterm_handler_kept(), local_gcs_port(self.init_kwargs):
            return super().__enter__()

    def hold_cluster(self) -> None:
        """On a cluster this runner joined: take its run slot, waiting (and saying so) while another run holds it.
        Once taken, held until the runner exits; a run's own local Ray needs none."""
        if self._slot is None and self.address not in (None, "local"):
            self._slot = cluster_slot.take(_run_name(), self.address)

    def submit(self, task, parameters, wait_for=None, dependencies=None):
        self.hold_cluster()  # the stage runner took it before the stage's line (`runner.stages.StageRecorder`)
        return super().submit(task, parameters, wait_for, dependencies)

    def __exit__(self, *exc_info):
        if self._slot is not None:
            cluster_slot.free(self._slot)
            self._slot = None
        return super().__exit__(*exc_info)


def _run_name() -> str:
    """The flow run's name (a pipeline run's name, `runner.pipeline_run.flow_run_name`), for the run slot's holder."""
    return str(flow_run.name or "?")
