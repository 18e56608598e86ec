"""Serve the four deployments from one process (MNIST's three and the generic flow's): the simplest scheduled + UI setup.

    PREFECT_API_URL=http://127.0.0.1:4200/api python -m deployments.serve
    python -m deployments.serve --cron "30 1 * * *" --timezone Europe/Berlin
    python -m deployments.serve --manual-preset smoke     # the run form starts from the smoke values
    python -m deployments.serve --tune-preset smoke       # the search's form starts from the tune smoke values

Registers and serves, until Ctrl-C:

- ``mnist-resnet18/nightly``: on a cron schedule (default 02:00 UTC), parameters from the
  ``nightly`` preset;
- ``mnist-resnet18/manual``: no schedule; start it from the UI (Run > Custom run), with
  ``prefect deployment run 'mnist-resnet18/manual'`` or through the API;
- ``mnist-resnet18-tune/manual``: the hyperparameter search (``flows.tune``), no schedule;
  started the same ways (``prefect deployment run 'mnist-resnet18-tune/manual'``), its form
  starting from the tune flow's ``--tune-preset`` (default ``default``);
- ``train/manual``: the generic flow (``flows.train``) for any workload, no schedule; its form has
  the same fields, ``workload`` and ``model.name`` among them, starting from ``--manual-preset``.

Runs of all four execute one at a time by default (``--limit 1``) in subprocesses of this process.
They join one Ray cluster: a Ray head this process starts on 127.0.0.1 when it starts and stops when
it stops (``--ray-address`` names a running cluster instead), so no run pays for starting a Ray of
its own (`runner.cluster.ray_head`). With ``--limit 2`` (a scheduled run and a UI run at once) both start,
and the runs take turns on the cluster: each plans its stages from the whole cluster, so the second
waits before its first stage, saying for whom and how long, until the first ends (`runner.cluster.cluster_slot`). The runs get this process's environment (``PREFECT_API_URL``, ``PIPELINE_FAILURE_WEBHOOK_URL``,
``PIPELINE_MODEL_MODULES``: the modules a run's ``model.name`` may import) and working directory (the default ``storage_root`` "storage" is relative to it). On shutdown the
nightly schedule is paused.

With ``--watch CONFIG`` (a workload's config file, like docs/extending.md's ``shapes.yaml``) and
``--score FOLDER``, training reacts (`deployments.reacting`): this process looks at the config's
image folder every ``--watch-every`` seconds, ``train/on-data`` trains when it changed, and
``score/on-promotion`` scores FOLDER with each new champion.

    python -m deployments.serve --watch shapes.yaml --score my-images/test

``deployments/prefect.yaml`` declares the same four deployments for ``prefect deploy`` and a
``process`` work pool, when runs should be executed by a separate worker.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from deployments import reacting
from pipeline_config import PipelineConfig, RayConfig, TunePipelineConfig
from pipeline_config.settings import PRESETS, load_preset
from runner.cluster.ray_head import SERVED_RAY_ENV, RayHeadError, ray_head
from training.model import trust

if TYPE_CHECKING:
    from prefect.deployments.runner import RunnerDeployment

NIGHTLY_CRON = "0 2 * * *"
NIGHTLY_TIMEZONE = "UTC"
NIGHTLY_PRESET = "nightly"
TAGS = ["mnist", "resnet18", "ray"]
TRAIN_TAGS = ["ray", "workload"]  # the generic flow's: its runs' workload is a parameter


def common_options() -> dict[str, Any]:
    """What every served deployment shares: a module-path entrypoint (runs load `flows.*` from the installed
    project, whatever the working directory of this process) and run parameters checked against the flow's."""
    from prefect.deployments.runner import EntrypointType  # only when deployments are built

    return {"entrypoint_type": EntrypointType.MODULE_PATH, "enforce_parameter_schema": True}


def preset_parameters(preset: str) -> dict[str, Any]:
    """The flow's parameters for a preset: the whole validated config, so the UI form shows every value.

    Args:
        preset: A name from ``pipeline_config.settings.PRESETS``.

    Returns:
        ``{"config": <PipelineConfig as JSON>}``.
    """
    return {"config": PipelineConfig.model_validate(load_preset(preset)).model_dump(mode="json")}


def tune_preset_parameters(preset: str) -> dict[str, Any]:
    """The tune flow's parameters for a preset (``tune-<preset>.yaml`` over ``<preset>.yaml``), whole and validated.

    Args:
        preset: A name from ``pipeline_config.settings.PRESETS``.

    Returns:
        ``{"config": <TunePipelineConfig as JSON>}``.
    """
    return {"config": TunePipelineConfig.model_validate(load_preset(preset, flow="tune")).model_dump(mode="json")}


def build_deployments(
    cron: str = NIGHTLY_CRON,
    timezone: str = NIGHTLY_TIMEZONE,
    manual_preset: str = "default",
    tune_preset: str = "default",
) -> list:
    """The nightly (scheduled) and manual (no schedule) ``RunnerDeployment`` of the MNIST flow, the search's
    manual one and the generic flow's manual one.

    Args:
        cron: When the nightly deployment runs.
        timezone: The cron's time zone (IANA name).
        manual_preset: Which preset the manual deployments' run forms (MNIST's and the generic flow's) start from.
        tune_preset: Which tune preset the search deployment's run form starts from.

    Returns:
        ``[nightly, manual, tune, train]`` (``tune`` is ``mnist-resnet18-tune/manual``, ``train`` is ``train/manual``).
    """
    from prefect.client.schemas.schedules import CronSchedule  # only when deployments are built

    from flows.mnist import mnist_pipeline  # the flow is imported only when its deployments are served

    common = common_options()
    nightly = mnist_pipeline.to_deployment(
        name="nightly",
        schedule=CronSchedule(cron=cron, timezone=timezone),
        parameters=preset_parameters(NIGHTLY_PRESET),
        description=f"Nightly quality run (preset '{NIGHTLY_PRESET}'), cron '{cron}' {timezone}.",
        tags=[*TAGS, "nightly"],
        **common,
    )
    manual = mnist_pipeline.to_deployment(
        name="manual",
        parameters=preset_parameters(manual_preset),
        description=f"Runs started by hand: Run > Custom run in the UI. The form starts from preset '{manual_preset}'.",
        tags=[*TAGS, "manual"],
        **common,
    )
    return [nightly, manual, _tune_deployment(tune_preset, common), _train_deployment(manual_preset, common)]


def _tune_deployment(preset: str, common: dict[str, Any]) -> RunnerDeployment:
    """The search's ``mnist-resnet18-tune/manual`` (no schedule), its run form starting from tune preset ``preset``."""
    from flows.tune import mnist_tune  # the flow is imported only when its deployments are served

    return mnist_tune.to_deployment(
        name="manual",
        parameters=tune_preset_parameters(preset),
        description=(
            "Hyperparameter search (Ray Tune) started by hand: Run > Custom run in the UI. "
            f"The form starts from tune preset '{preset}'."
        ),
        tags=[*TAGS, "tune", "manual"],
        **common,
    )


def _train_deployment(preset: str, common: dict[str, Any]) -> RunnerDeployment:
    """The generic flow's ``train/manual`` (no schedule, any workload), its run form starting from preset ``preset``."""
    from flows.train import train_pipeline  # the flow is imported only when its deployments are served

    return train_pipeline.to_deployment(
        name="manual",
        parameters=preset_parameters(preset),
        description=(
            "Any workload (workload, model.name, download.*) started by hand: Run > Custom run in the UI. "
            f"The form starts from preset '{preset}'."
        ),
        tags=[*TRAIN_TAGS, "manual"],
        **common,
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options of ``python -m deployments.serve``."""
    parser = argparse.ArgumentParser(prog="python -m deployments.serve", description=__doc__.split("\n")[0])
    parser.add_argument("--cron", default=NIGHTLY_CRON, help=f"nightly schedule (default: '{NIGHTLY_CRON}')")
    parser.add_argument("--timezone", default=NIGHTLY_TIMEZONE, help=f"time zone of --cron (default: {NIGHTLY_TIMEZONE})")
    parser.add_argument(
        "--manual-preset", default="default", choices=PRESETS, help="preset the manual run form starts from"
    )
    parser.add_argument(
        "--tune-preset", default="default", choices=PRESETS, help="tune preset the search's run form starts from"
    )
    parser.add_argument("--limit", type=int, default=1,
                        help="flow runs executed at the same time (default: 1); runs on the cluster still take turns on it")
    parser.add_argument(
        "--watch", type=Path, metavar="CONFIG",
        help="a workload's config file: watch its download.path, train it (train/on-data) when its images change",
    )
    parser.add_argument("--watch-every", type=float, default=reacting.WATCH_EVERY_S, metavar="S",
                        help=f"seconds between looks at the watched folder (default: {reacting.WATCH_EVERY_S:g})")
    parser.add_argument("--debounce", type=float, default=reacting.DEBOUNCE_S, metavar="S",
                        help=f"changes within this many seconds start one training run, when they end (default: {reacting.DEBOUNCE_S:g})")
    parser.add_argument("--score", metavar="FOLDER", help="score this image folder with each new champion (score/on-promotion)")
    parser.add_argument(
        "--ray-address", metavar="ADDRESS",
        help="the Ray cluster every run joins ('auto', 'host:port'; a run's own ray.address wins); "
             "default: a Ray head started with this process on 127.0.0.1 and stopped with it",
    )
    parser.add_argument("--ray-cpus", type=int, metavar="N", help="CPUs of the Ray head it starts (default: the machine's)")
    parser.add_argument("--ray-metrics-port", type=int, metavar="PORT",
                        help="where the Ray head it starts serves Prometheus metrics, Ray's and the runs' (default: a port Ray "
                             "picks, listed in /tmp/ray/prom_metrics_service_discovery.json)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Register the four deployments and execute their runs, one at a time by default, until interrupted."""
    from prefect import serve  # only when deployments are built

    args = parse_args(argv)
    try:
        allowed = trust.allowed_modules()  # what the runs of these deployments may import as model.name
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    try:
        RayConfig(address=args.ray_address)  # the checks a run's ray.address gets, before anything starts
    except ValidationError as exc:
        print(f"invalid configuration:\n--ray-address: {exc.errors()[0]['msg']}", file=sys.stderr)
        return 2
    try:
        more = reacting.build(args.watch, args.score, common_options(), args.watch_every, args.debounce)
        folder_watcher = reacting.watcher(args.watch, args.watch_every)
    except ValueError as exc:
        print(f"invalid configuration:\n{exc}", file=sys.stderr)
        return 2
    print(f"model.name functions these deployments' runs may import: modules under {', '.join(allowed)} ({trust.MODULES_ENV})")
    # SIGTERM before Prefect's runner takes it over (it stops serving gracefully): exit through the
    # `with` below, which stops the Ray head, instead of dying at once.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        with runs_cluster(args.ray_address, args.ray_cpus, args.ray_metrics_port) as address:
            os.environ[SERVED_RAY_ENV] = address  # the runs this process executes inherit it and join that cluster
            if folder_watcher is not None:
                print(f"watching {folder_watcher.config.download.path} every {args.watch_every:g}s ({folder_watcher.config.workload})")
                folder_watcher.start()
            serve(*build_deployments(args.cron, args.timezone, args.manual_preset, args.tune_preset), *more, limit=args.limit)
    except RayHeadError as exc:
        print(exc, file=sys.stderr)
        return 3
    return 0


@contextmanager
def runs_cluster(address: str | None, cpus: int | None, metrics_port: int | None = None) -> Iterator[str]:
    """The Ray cluster the served runs join: ``address``, or a head started here for the block (`runner.cluster.ray_head`)."""
    if address:
        print(f"Ray: every run joins the cluster at {address}", flush=True)
        yield address
        return
    log = Path(tempfile.gettempdir()) / f"pipeline-serve-ray-{os.getpid()}.log"
    print("Ray: starting a local cluster for the runs ...", flush=True)
    with ray_head(log, num_cpus=cpus, metrics_port=metrics_port) as started:
        os.environ["RAY_AUTH_MODE"] = "token"  # the head checks the token in ~/.ray/auth_token: the runs present it
        print(f"Ray: every run joins the local cluster at {started} (stopped with this process; log {log})", flush=True)
        yield started


if __name__ == "__main__":
    sys.exit(main())
