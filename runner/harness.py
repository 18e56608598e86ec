"""What every flow does around its stage list, and what its command line does around the flow.

`run_flow` is a flow's body minus its stages: the run folder and its name, the Ray task runner,
the cluster check, the run's lease, and ``summary.json`` however the run ends. `run_cli` is
``python -m flows.<name>``: settings from arguments and the environment, a Prefect API and a Ray
cluster (started or reached), the flow, and the closing summary in the terminal.
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from prefect.states import Cancelled
from pydantic import ValidationError

from dataset import folder
from pipeline_config import DEFAULT_WORKLOAD, PipelineConfig, TunePipelineConfig
from pipeline_config.settings import parse_cli
from reporting import artifacts, environment
from runner import console, hooks, stopping
from runner.runtime import cli_runtime, ray_task_runner
from runner.stages import StageRecorder
from storage_io import RunInUseError, StorageLayout, atomic_write_json, read_json, run_lease
from training import models


def default_run_name(prefix: str = DEFAULT_WORKLOAD) -> str:
    """A unique, sortable run name: <prefix>-<UTC timestamp>-<random>."""
    return f"{prefix}-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}-{uuid.uuid4().hex[:6]}"


def run_name_prefix(config: PipelineConfig) -> str:
    """What a run's default name starts with: the workload (``mnist``); a search's, ``<workload>-tune``
    (``tune`` for MNIST, as it always was)."""
    if getattr(config, "tune", None) is None:
        return config.workload
    return "tune" if config.workload == DEFAULT_WORKLOAD else f"{config.workload}-tune"


def flow_run_name() -> str:
    """The Prefect flow run's name: the run's name (its folder under runs/), so the UI lists runs by
    workload. A run started without ``run_name`` (a deployment's) gets a new default name here,
    and `run_flow` names its folder after it."""
    from prefect.runtime import flow_run

    config = flow_run.parameters.get("config")
    if isinstance(config, dict):  # before validation; an invalid config fails with its own message later
        try:
            config = (TunePipelineConfig if "tune" in config else PipelineConfig).model_validate(config)
        except ValidationError:
            return default_run_name()
    if not isinstance(config, PipelineConfig):
        return default_run_name()
    return config.run_name or default_run_name(run_name_prefix(config))


def run_flow(config: PipelineConfig, module: str, check_fits: Any, plan: dict[str, float], stages: Any) -> dict[str, Any] | Cancelled:
    """What every flow does around its stage list ``stages(stage, layout, config)``.

    The run folder (when ``run_name`` is unset, the flow run's name: `flow_run_name`), the Ray task
    runner, ``check_fits`` before anything is written, the run's lease, and summary.json however it
    ends: on a stop request (Ctrl-C, SIGTERM) the summary says interrupted and the flow run ends
    Cancelled. ``module``: the flow's CLI module, what the summary's resume command runs.
    """
    models.check_name(config.model.name)  # ValueError naming model.name: an unknown model, a module that does not import
    folder.check_source(config.download, config.transform.image_size)  # source=folder: a bad layout or image, named
    layout = StorageLayout.create(config.storage_root, config.run_name or _named_run(config))
    layout.check_reachable()  # an S3 root: the bucket answers before any work starts
    try:
        with stopping.keep_sigterm(), ray_task_runner(config.ray) as runner:
            check_fits(config)  # before anything is written
            with run_lease(layout):  # refuses a live run of the same name
                hooks.remember_run(layout)
                env = environment.describe()
                artifacts.publish_environment_report(env, config.workload)
                stage = StageRecorder(runner, layout, config, env, plan, module)
                try:
                    stages(stage, layout, config)
                except stopping.RunStopped as stop:
                    summary = stage.write_summary()
                    return Cancelled(message=f"run {layout.run_name} {stop}; {resume_hint(summary)}")
                except BaseException:
                    try:
                        stage.write_summary()
                    except OSError as exc:  # e.g. the storage root is full: keep the stage's own error
                        print(f"could not write {layout.summary_path}: {exc}", file=sys.stderr)
                    raise
                return stage.write_summary()
    finally:
        stopping.FLOW_BODY_DONE.set()


def _named_run(config: PipelineConfig) -> str:
    """The flow run's name when `flow_run_name` made it for this config (a deployment's run), else a new default name."""
    from prefect.runtime import flow_run

    prefix = run_name_prefix(config)
    name = flow_run.name
    if isinstance(name, str) and name.startswith(f"{prefix}-") and len(name) == len(default_run_name(prefix)):
        return name
    return default_run_name(prefix)


def resume_hint(summary: dict[str, Any]) -> str:
    """Where the stopped run can go on from, and the command that does it."""
    kept = (summary.get("stopped") or {}).get("checkpoint_kept")
    where = f"its checkpoint {kept['path']} is kept" if kept else "no training checkpoint was written yet"
    command = console.resume_command(
        summary.get("run_name") or "?", summary.get("storage_root"), None, summary.get("module", "flows.train")
    )
    return f"{where}; resume with: {command}"


def run_cli(argv: list[str] | None, settings_class: type, flow: Any, title: str, module: str) -> int:
    """Run ``flow`` once from the command line: parse ``settings_class`` from ``argv`` and the
    environment, start (or reach) a Prefect API and a Ray cluster, run, print a short summary.

    ``module`` is what the printed resume command runs (``python -m <module>``); the default run
    name starts with the workload (`run_name_prefix`); ``{workload}`` in ``title`` is its name
    (``MNIST`` for mnist).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        settings = parse_cli(argv, settings_class)
        config = settings.pipeline_config()
        models.check_name(config.model.name)
        folder.check_source(config.download, config.transform.image_size)
    except (ValidationError, ValueError) as exc:
        print(f"invalid configuration:\n{exc}", file=sys.stderr)
        return 2
    if config.run_name is None:
        config = config.model_copy(update={"run_name": default_run_name(run_name_prefix(config))})
    layout = StorageLayout.create(config.storage_root, config.run_name)
    try:
        layout.check_reachable()
    except ValueError as exc:
        print(f"invalid configuration:\n{exc}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    named = "MNIST" if config.workload == DEFAULT_WORKLOAD else config.workload
    print(f"{title.format(workload=named)}: run {config.run_name} -> {layout.run_dir}", flush=True)
    failed, runtime = None, None
    # Ctrl-C and SIGTERM ask the run to stop (runner/stopping.py). The Prefect API and a local Ray
    # start side by side; the terminal shows stage and epoch lines and warnings unless --verbose
    # (the Prefect UI gets every log line either way).
    with stopping.signals_stop_the_run() as stop:
        with console.quiet_terminal(not settings.verbose), cli_runtime(config.ray) as runtime:
            if runtime.dashboard_url:
                dashboard = f"dashboard at {runtime.dashboard_url} while the run lasts (token: ~/.ray/auth_token)"
                print(f"Ray: local cluster, {dashboard}", flush=True)
            elif config.ray.address:
                print(f"Ray: the cluster at {config.ray.address}", flush=True)
            try:
                if stop.requested:  # while Ray and the server were starting
                    raise stopping.RunStopped(None, stop.reason or "stopped")
                with stopping.ApiWatch(runtime.api_url, settings.lost_api_wait_s, layout.summary_path, argv):
                    flow(config)
            except Exception as exc:  # the summary below still tells what happened
                failed = exc
        in_use = isinstance(failed, RunInUseError)  # the summary on disk belongs to the live run
        summary = (read_json(layout.summary_path) or {}) if not in_use else {}
        summary.pop("config", None)
        if summary and settings.summary_out:
            atomic_write_json(Path(settings.summary_out), summary)
        if settings.print_json and summary:
            print(json.dumps(summary, indent=2))
        api_url = runtime.api_url if runtime else None
        temporary = bool(runtime and runtime.temporary_server)
        wall = time.perf_counter() - started
        if stop.requested and summary.get("status") != "completed":
            fallback = {"run_name": config.run_name, "storage_root": config.storage_root}
            lines = console.stopped_lines(summary or fallback, stop.reason, wall, argv, module)
            print("\n" + "\n".join(lines), file=sys.stderr, flush=True)
            return stop.exit_code() or 1
        fallback = {"run_name": config.run_name, "storage_root": config.storage_root}
        lines = console.summary_lines(summary or fallback, failed, wall, api_url, temporary, argv, module)
        print("\n" + "\n".join(lines), file=sys.stderr if failed else sys.stdout)
        return 1 if failed is not None else 0
