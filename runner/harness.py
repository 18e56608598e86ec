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

from prefect.states import Cancelled, Completed
from pydantic import ValidationError

from dataset.formats import folder
from dataset.tensors import sizing
from pipeline_config import DEFAULT_WORKLOAD, PipelineConfig, TunePipelineConfig
from pipeline_config.settings import parse_cli
from reporting import artifacts, environment
from runner import console, stopping
from runner.cluster import ray_auth
from runner.cluster.ray_init import ray_task_runner
from runner.cluster.runtime import cli_runtime
from runner.stages import Stage, StageRecorder
from runner.summary import RunSummary, attach, outcome_of
from runner.tracking import tracking_uri
from storage_io import StorageLayout, atomic_write_json, redact_error, run_lease, storage_writes
from training.model import trust
from training.resources import DoesNotFit


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


def run_flow(
    config: PipelineConfig, module: str, check_fits: Any, plan: list[Stage], stages: Any, nothing_new: Any = None,
) -> RunSummary | Cancelled | Completed:
    """What every flow does around its stage list ``stages(stage, layout, config)``, whose stages are ``plan`` in order.

    The run folder (when ``run_name`` is unset, the flow run's name: `flow_run_name`), the Ray task
    runner, ``check_fits`` before anything is written, the run's lease, then the listing cache the data
    checks held (`dataset.formats.folder.keep_checks`: a run refused before any work leaves the storage root as it
    was), and summary.json however it ends. The run's `RunSummary` is the flow's return value; on a stop request (Ctrl-C, SIGTERM) the
    summary says interrupted and the flow run ends Cancelled with it as data; a failed run's
    exception carries it (`runner.summary.attach`). ``module``: the flow's CLI module, what the
    summary's resume command runs. ``nothing_new(config, layout, module)``: before Ray starts, the summary of
    a run with nothing new to train on (`ended_before_training`), which then ends Completed with
    that reason as its message; None goes on.
    """
    trust.check_allowed(config.model.name, deployed=started_by_deployment())  # before anything is imported
    source = folder.check_source(config.download, sizing.checked_size(config.transform), config.storage_root)  # a bad layout or image, named
    tracking_uri(config)  # ValueError naming MLFLOW_TRACKING_URI when this process's cannot be used
    trust.check_model(sizing.resolved(config, source), source)  # ValueError naming model.name: it does not import, build or run on this data
    layout = StorageLayout.create(config.storage_root, config.run_name or _named_run(config))
    layout.check_reachable()  # an S3 root: the bucket answers before any work starts
    # The size transform.image_size auto chose: the nothing-new check names the dataset by it.
    ended = nothing_new(sizing.resolved(config, source), layout, module) if nothing_new is not None else None
    if ended is not None:
        return Completed(message=f"nothing new to train on: {ended.nothing_new}", data=ended)
    stage = None
    try:
        with stopping.keep_sigterm(), ray_task_runner(config.ray) as runner:
            check_fits(config)  # before anything is written
            with run_lease(layout):  # refuses a live run of the same name
                folder.keep_checks(config.download, config.storage_root)  # past every check: the listing cache now
                env = environment.describe()
                artifacts.publish_environment_report(env, config.workload)
                stage = StageRecorder(runner, layout, config, env, plan, module)
                try:
                    stages(stage, layout, config)
                except stopping.RunStopped as stop:
                    summary = stage.write_summary()
                    return Cancelled(message=f"run {layout.run_name} {stop}; {resume_hint(summary)}", data=summary)
                except BaseException as error:
                    try:
                        stage.write_summary()
                    except Exception as exc:  # e.g. the storage root is full: keep the stage's own error
                        print(f"could not write {layout.summary_path}: {exc}", file=sys.stderr)
                    attach(error, stage.last_summary)  # for the failure hook and the CLI, written or not
                    raise
                return stage.write_summary()
    finally:
        stopping.flow_body_done(stage.last_summary if stage else None)


def ended_before_training(
    config: PipelineConfig, layout: StorageLayout, module: str, reason: str, source: str, **data: Any
) -> RunSummary:
    """The summary of a run that ends before any stage, with nothing new to train on; written as summary.json.

    ``source``: where its data came from (``RawData.source``); ``data``: `runner.summary.DataRecord`
    fields (where the raw data and the dataset are).
    """
    from prefect.runtime import flow_run

    from runner.summary import DataRecord

    summary = RunSummary(
        run_name=layout.run_name, module=module, workload=config.workload, flow_run_id=str(flow_run.id) if flow_run.id else None,
        storage_root=layout.root, run_dir=layout.run_dir, data_source=source, data=DataRecord(**data),
        status="completed", nothing_new=reason, config=config.model_dump(mode="json"),
    )
    with storage_writes("summary", layout.run_dir):
        atomic_write_json(layout.summary_path, summary.to_json())
    return summary


def started_by_deployment() -> bool:
    """Whether this flow run was started through a deployment (the UI's run form, the API), not by the CLI."""
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    return bool(context and context.flow_run and context.flow_run.deployment_id)


def _named_run(config: PipelineConfig) -> str:
    """The flow run's name when `flow_run_name` made it for this config (a deployment's run), else a new default name."""
    from prefect.runtime import flow_run

    prefix = run_name_prefix(config)
    name = flow_run.name
    if isinstance(name, str) and name.startswith(f"{prefix}-") and len(name) == len(default_run_name(prefix)):
        return name
    return default_run_name(prefix)


def resume_hint(summary: RunSummary) -> str:
    """Where the stopped run can go on from, and the command that does it."""
    kept = summary.stopped.checkpoint_kept if summary.stopped else None
    where = f"its checkpoint {kept['path']} is kept" if kept else "no training checkpoint was written yet"
    command = console.resume_command(summary.run_name or "?", summary.storage_root, None, summary.module)
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
        settings, config, layout = checked_settings(argv, settings_class)
    except (ValidationError, ValueError) as exc:
        print(f"invalid configuration:\n{redact_error(exc)}", file=sys.stderr)  # redacted before pydantic shortens an input
        return 2
    started = time.perf_counter()
    named = "MNIST" if config.workload == DEFAULT_WORKLOAD else config.workload
    print(f"{title.format(workload=named)}: run {config.run_name} -> {layout.run_dir}", flush=True)
    summary, failed, runtime = None, None, None
    # Ctrl-C and SIGTERM ask the run to stop (runner/stopping.py). The Prefect API and a local Ray
    # start side by side; the terminal shows stage and epoch lines and warnings unless --verbose
    # (the Prefect UI gets every log line either way).
    with stopping.signals_stop_the_run() as stop:
        runtime_for = cli_runtime(config.ray, ray_now=not skips_when_unchanged(config), warm=flow.fn.__module__)
        with console.quiet_terminal(not settings.verbose), runtime_for as runtime:
            if runtime.dashboard_url:
                dashboard = f"dashboard at {runtime.dashboard_url} while the run lasts (token: ~/.ray/auth_token)"
                print(f"Ray: local cluster, {dashboard}", flush=True)
            elif config.ray.address:
                print(f"Ray: the cluster at {config.ray.address}", flush=True)
            try:
                if stop.requested:  # while Ray and the server were starting
                    raise stopping.RunStopped(None, stop.reason or "stopped")
                with stopping.ApiWatch(runtime.api_url, settings.lost_api_wait_s, layout.summary_path, argv):
                    summary, failed = outcome_of(flow(config, return_state=True))  # the run's own summary
            except Exception as exc:  # the summary below still tells what happened
                failed = exc
        wall = time.perf_counter() - started
        return close_cli(summary, failed, config, settings, runtime, stop, wall, argv, module)


def skips_when_unchanged(config: PipelineConfig) -> bool:
    """Whether the run may end before training (``promote.skip_unchanged``): its CLI then starts Ray only if it trains."""
    promote = getattr(config, "promote", None)
    return bool(promote and promote.enabled and promote.skip_unchanged and getattr(config, "tune", None) is None)


def checked_settings(argv: list[str], settings_class: type) -> tuple[Any, PipelineConfig, StorageLayout]:
    """(settings, config with its run name, the run's layout) from ``argv`` and the environment;
    ValidationError or ValueError naming the field when something cannot work, before any work starts."""
    settings = parse_cli(argv, settings_class)
    config = settings.pipeline_config()
    source = folder.check_source(config.download, sizing.checked_size(config.transform), config.storage_root)
    tracking_uri(config)  # MLFLOW_TRACKING_URI the tracker cannot use, or with credentials: refused, naming it
    trust.check_model(sizing.resolved(config, source), source)  # the command line's user may import any module
    if config.run_name is None:
        config = config.model_copy(update={"run_name": default_run_name(run_name_prefix(config))})
    layout = StorageLayout.create(config.storage_root, config.run_name)
    layout.check_reachable()
    refused = ray_auth.token_problem(config.ray.address)  # a head that would turn this process's token away
    if refused:
        raise ValueError(refused)
    return settings, config, layout


def close_cli(
    summary: RunSummary | None, failed: BaseException | None, config: PipelineConfig, settings: Any, runtime: Any,
    stop: stopping.StopRequest, wall_s: float, argv: list[str], module: str,
) -> int:
    """The CLI's end: the summary where ``--summary-out``/``--json`` ask for it, the closing lines, the exit code.

    ``summary`` is None when the run never got to its stages (a refused lease, a setup error):
    then the lines name the run and its storage root from ``config``. A cluster that cannot hold what
    the configuration asks (`DoesNotFit`, found once Ray is up) is refused like a bad value: exit 2.
    """
    if summary is not None and settings.summary_out:
        atomic_write_json(Path(settings.summary_out), summary.to_json(config=False))
    if summary is not None and settings.print_json:
        print(json.dumps(summary.to_json(config=False), indent=2))
    if summary is None and isinstance(failed, DoesNotFit):  # refused before any work: nothing to resume
        print(f"invalid configuration:\n{redact_error(failed)}", file=sys.stderr)
        return 2
    shown = summary or RunSummary(run_name=config.run_name, storage_root=config.storage_root, module=module)
    if stop.requested and shown.status != "completed":
        lines = console.stopped_lines(shown, stop.reason, wall_s, argv)
        print("\n" + "\n".join(lines), file=sys.stderr, flush=True)
        return stop.exit_code() or 1
    api_url = runtime.api_url if runtime else None
    temporary = bool(runtime and runtime.temporary_server)
    lines = console.summary_lines(shown, failed, wall_s, api_url, temporary, argv)
    print("\n" + "\n".join(lines), file=sys.stderr if failed else sys.stdout)
    return 1 if failed is not None else 0


def exit_now(code: int) -> None:
    """End a command-line run with ``code`` once its exit handlers have run, skipping the interpreter's teardown.

    After the last line is printed, tearing down torch's, Ray's and Prefect's modules keeps the shell
    waiting for its prompt for seconds on a small machine (docs/design.md). The exit handlers (``atexit``: Prefect's and Ray's shutdowns, logging's flush) still run, and
    the standard streams are flushed; with a non-daemon thread still running, the normal exit waits for it.
    """
    import atexit
    import os
    import threading

    if any(t is not threading.main_thread() and t.is_alive() and not t.daemon for t in threading.enumerate()):
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or a broken pipe
            pass
    os._exit(code)
