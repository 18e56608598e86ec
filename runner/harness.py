"""What a flow's command line does around the flow (a flow's body runs in `runner.pipeline_run.PipelineRun`).

`run_cli` is ``python -m flows.<name>``: settings from arguments and the environment, a Prefect API and a
Ray cluster (started or reached), the flow, and the closing summary in the terminal.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from dataset.sources.interface import check_data
from dataset.tensors import sizing
from pipeline_config import DEFAULT_WORKLOAD, PipelineConfig
from pipeline_config.settings import old_prefix_lines, parse_cli
from runner import console, stopping
from runner.cluster import ray_auth
from runner.cluster.runtime import cli_runtime
from runner.pipeline_run import default_run_name, run_name_prefix
from runner.summary import RunSummary, outcome_of
from runner.tracking_records import tracking_uri
from storage_io import StorageLayout, atomic_write_json, redact_error
from training.model import trust
from training.resources import DoesNotFit


def run_cli(argv: list[str] | None, settings_class: type, flow: Any, title: str, module: str) -> int:
    """Run ``flow`` once from the command line: parse ``settings_class`` from ``argv`` and the
    environment, start (or reach) a Prefect API and a Ray cluster, run, print a short summary.

    ``module`` is what the printed resume command runs (``python -m <module>``); the default run
    name starts with the workload (`run_name_prefix`); ``{workload}`` in ``title`` is its name
    (``MNIST`` for mnist).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    for line in old_prefix_lines(settings_class):  # MNIST_ variables flows.mnist and flows.tune still read
        print(line, file=sys.stderr)
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
    source = check_data(config.download, sizing.checked_size(config.transform), config.storage_root)
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
    if any(t is not threading.main_thread() and t.is_alive() and not t.daemon for t in threading.enumerate()):
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or a broken pipe
            pass
    os._exit(code)
