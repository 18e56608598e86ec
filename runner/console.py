"""What a person reads while a run goes: stage lines, one line per epoch, a short summary at the end.

Lines the pipeline says for people (``say``) go to the flow run's log, so the Prefect UI and a
served deployment's terminal show them like any other log line; they carry a marker that
``quiet_terminal`` lets through the terminal while it holds back Prefect's engine messages
(task created, submitted, finished) below WARNING. The CLI is quiet unless ``--verbose``.

Epoch lines come from the driver, not from the training workers: `runner.watchers.EpochWatcher`
reads the run's ``history.jsonl`` (written by rank 0 after every epoch) from storage while the
training stage runs, so they work the same for a local Ray, a remote cluster and an ``s3://`` root.
"""

from __future__ import annotations

import copy
import logging
import os
import shlex
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dataset.sources.interface import predict_input
from pipeline_config import DEFAULT_WORKLOAD, ModelConfig, registry_model_name
from runner.summary import RunSummary
from storage_io import redact_error, redact_text, redact_url

# flows.predict's --model when unset: the default workload's default model (mnist-resnet18).
DEFAULT_MODEL = registry_model_name(DEFAULT_WORKLOAD, ModelConfig().name)
CONSOLE_FLAG = "mnist_console"  # set on LogRecords meant for the terminal
Logger = logging.Logger | logging.LoggerAdapter


def run_logger() -> Logger:
    """The current Prefect run's logger (its lines reach the UI), or a plain INFO logger outside a run."""
    from prefect import get_run_logger  # after the CLI set Prefect's logging
    from prefect.exceptions import MissingContextError  # after the CLI set Prefect's logging

    try:
        return get_run_logger()
    except MissingContextError:
        logger = logging.getLogger("runner.console")
        logger.setLevel(logging.INFO)
        return logger


def say(message: str, *args: Any, logger: Logger | None = None) -> None:
    """Log a line for people to ``logger`` (default: the current run's), marked to pass a quiet terminal.

    A thread of its own has no Prefect run context: hand it the logger taken in the run's thread.
    """
    (logger or run_logger()).info(message, *args, extra={CONSOLE_FLAG: True})


def _for_people(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.WARNING or bool(getattr(record, CONSOLE_FLAG, False))


@contextmanager
def quiet_terminal(enabled: bool = True) -> Iterator[None]:
    """While active, the terminal shows warnings, errors and ``say`` lines only (the Prefect UI keeps everything).

    Filters Prefect's console handler on the root logger and prints errors without their
    traceback (the UI and --verbose keep it); restored on exit. Ray's own driver lines follow
    ``ray.log_to_driver`` (``runner.cluster.ray_init.ray_init_args``).
    """
    if not enabled:
        yield
        return
    from prefect.logging.configuration import ensure_logging_setup  # after the CLI set Prefect's logging
    from prefect.logging.handlers import PrefectConsoleHandler  # after the CLI set Prefect's logging

    ensure_logging_setup()  # Prefect's handlers exist (importing prefect normally made them)
    handlers = [h for h in logging.getLogger().handlers if isinstance(h, PrefectConsoleHandler)]
    formatters = [h.formatter for h in handlers]
    for handler in handlers:
        handler.addFilter(_for_people)
        handler.setFormatter(_WithoutTraceback(handler.formatter))
    try:
        yield
    finally:
        for handler, formatter in zip(handlers, formatters):
            handler.removeFilter(_for_people)
            handler.setFormatter(formatter)


class _WithoutTraceback(logging.Formatter):
    """Formats like ``inner`` but without the traceback: an error is one line in a quiet terminal.

    The record itself is left alone (the Prefect UI's handler sees the same record), a copy is formatted.
    """

    def __init__(self, inner: logging.Formatter | None):
        super().__init__()
        self.inner = inner or logging.Formatter()

    def format(self, record: logging.LogRecord) -> str:
        plain = copy.copy(record)
        plain.exc_info, plain.exc_text, plain.stack_info = None, None, None
        return self.inner.format(plain)


def duration(seconds: float) -> str:
    """``75.2`` -> ``1m15s``; ``3725`` -> ``1h02m05s``; under a minute ``12.3s``."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


def summary_lines(
    summary: RunSummary, error: BaseException | None, wall_s: float, api_url: str | None, temporary_server: bool,
    argv: Sequence[str] | None = None,
) -> list[str]:
    """The short summary the CLI ends with: status, test accuracy against the gate, where things are, what next.

    ``argv``: the CLI's options, for the command that resumes a failed run (`resume_command`).
    """
    run = summary.run_name or "?"
    evaluation = summary.evaluation
    lines = []
    if error is None and summary.nothing_new:
        lines.append(f"Run {run}: nothing new to train on, ended after {duration(wall_s)}.")
        lines.append(f"  why            {summary.nothing_new}")
        lines.append("  to train anyway --no-promote.skip-unchanged (promote.skip_unchanged: false in a deployment's form)")
    elif error is None:
        lines.append(f"Run {run} completed in {duration(wall_s)}.")
    else:
        stage, _ = summary.failed_stage()
        where = f" in stage {stage}" if stage else ""
        lines.append(f"Run {run} FAILED{where} after {duration(wall_s)}: {type(error).__name__}: {redact_error(error)}")
    accuracy, gate = evaluation.get("accuracy"), evaluation.get("min_accuracy")
    if accuracy is not None and gate is not None:
        verdict = "passed" if evaluation.get("passed_gate", accuracy >= gate) else "FAILED"  # a class's recall counts too
        lines.append(f"  test accuracy  {accuracy:.2%} on {evaluation.get('rows', '?')} images (gate {gate:.2%}: {verdict})")
        if evaluation.get("gate"):  # where the gate came from (`tasks.gate`)
            lines.append(f"  gate           {gate:.2%}: {evaluation['gate']}")
    lines += promotion_lines(summary.promotion, summary.storage_root, summary.data_source)
    lines += tuning_lines(summary.tuning, summary.workload)
    lines += tracking_lines(summary.tracking)
    if summary.run_dir:
        lines.append(f"  run folder     {summary.run_dir}")
        lines.append(f"  summary        {summary.path} (--json prints it here)")
    if api_url:
        ui = api_url.removesuffix("/api")
        if temporary_server:
            lines.append(f"  Prefect        {ui} (a temporary server, stopped now; set PREFECT_API_URL to keep runs and see them in the UI)")
        elif summary.flow_run_id:
            lines.append(f"  Prefect UI     {ui}/runs/flow-run/{summary.flow_run_id}")
        else:
            lines.append(f"  Prefect UI     {ui}")
    if error is not None and summary.run_name:
        lines.append(
            f"  to resume      {resume_command(run, summary.storage_root, argv, summary.module)}"
            + " (verified stages are skipped, training goes on from its latest checkpoint)"
        )
    return lines


def promotion_lines(promotion: dict[str, Any] | None, storage_root: str | None, data_source: str | None = None) -> list[str]:
    """Whether the run's model became the champion, why, and how to score images with the champion (``--input`` as
    the run's data came, ``data_source``: an image folder's images, MNIST's IDX digits) or serve it."""
    if not promotion:
        return []
    model = promotion.get("model", "?")
    if promotion.get("promoted"):
        line = f"  model          promoted: {model} v{promotion.get('version')} is the champion ({promotion.get('reason')})"
    else:
        line = f"  model          not promoted: {promotion.get('reason')}"
    options = ["--storage-root", storage_root] if storage_root else []
    options += ["--model", model] if model != DEFAULT_MODEL else []  # flows.predict's default
    command = shlex.join([interpreter(), "-m", "flows.predict", *options])
    if promotion.get("version") is None:  # no champion yet to predict with
        return [line]
    serve = shlex.join([interpreter(), "-m", "deployments.serve_model", *options])
    return [line, f"  predict        {command} --input {predict_input(data_source)}",
            f"  serve          {serve}  (the champion over HTTP, following each promotion)"]


def tracking_lines(tracking: dict[str, Any] | None) -> list[str]:
    """Where the run is in MLflow (credentials redacted), and what a failure kept out of it (nothing when tracking is off)."""
    if not tracking:
        return []
    lines = [f"  MLflow         {redact_url(str(tracking.get('url') or tracking.get('uri')))}"]
    if tracking.get("not_recorded"):
        why = f"MLflow failed: {redact_text(tracking['error'])}" if tracking.get("error") else "MLflow failed during the run"
        lines.append(f"  not in MLflow  {', '.join(tracking['not_recorded'])} ({why}; resuming the run once MLflow answers records them)")
    return lines


def tuning_lines(tuning: dict[str, Any] | None, workload: str | None = None) -> list[str]:
    """The best trial of a search and where its config file is (nothing when the run did not tune).

    ``workload``: the search's; another than MNIST is trained by ``flows.train`` (the file names it).
    """
    if not tuning or not tuning.get("best_trial"):
        return []
    best, metric = tuning["best_trial"], tuning.get("metric", "val_loss")
    value = best.get(metric)
    shown = f"{value:.4f}" if isinstance(value, (int, float)) else "?"
    chosen = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in (best.get("sampled") or {}).items())
    other = workload not in (None, DEFAULT_WORKLOAD)
    module, data = ("flows.train", " <the search's download.* options>") if other else ("flows.mnist", "")
    return [
        f"  best trial     {best.get('trial_id')}: {metric} {shown} after {best.get('epochs_run')} epoch(s) "
        f"({tuning.get('trials')} trials, {tuning.get('stopped_early')} stopped early)",
        f"  its recipe     {chosen}",
        f"  best config    {best.get('config_file')}",
        f"  train it       python -m {module} --config-file {best.get('config_file')}{data}",
    ]


def stopped_lines(summary: RunSummary, reason: str | None, wall_s: float, argv: Sequence[str] | None = None) -> list[str]:
    """What the CLI says when a run was stopped on request: where it stopped, what it kept, how to resume."""
    run = summary.run_name or "?"
    stopped = summary.stopped
    where = f" in stage {stopped.stage}" if stopped and stopped.stage else " before its first stage"
    lines = [f"Run {run} {reason or 'stopped'}{where} after {duration(wall_s)}; Ray and the Prefect server are stopped."]
    kept = stopped.checkpoint_kept if stopped else None
    if kept:
        at = f"epoch {kept['epoch'] + 1} of {summary.epochs or '?'} done" if not kept.get("mid_epoch") else (
            f"in epoch {kept['epoch'] + 1} of {summary.epochs or '?'}, step {kept.get('step')}")
        lines.append(f"  checkpoint kept  {kept['path']} ({at})")
    elif summary.stages:
        # Ray Train's record, not the folders: a checkpoint still being committed when the stop came is not resumed from.
        lines.append("  checkpoint kept  none recorded by Ray Train yet (training starts over); finished stages are kept")
    if summary.run_dir:
        lines.append(f"  summary          {summary.path}")
    lines.append(
        f"  to resume        {resume_command(run, summary.storage_root, argv, summary.module)}"
        + " (verified stages are skipped, training goes on from its latest checkpoint)"
    )
    return lines


def resume_command(run_name: str, storage_root: str | None, argv: Sequence[str] | None = None, module: str = "flows.mnist") -> str:
    """The command that goes on with run ``run_name``: its run name and storage root, and otherwise
    the options ``argv`` the run was started with (a smoke run resumes as a smoke run).

    Started by ``make run`` or ``make smoke``: ``make run ARGS="..."``; else the interpreter running
    now (``.venv/bin/python`` after ``make install``). Without ``argv`` (a served run, the Prefect
    UI): the plain ``python -m flows.mnist`` form. ``module``: the flow's module (``flows.tune`` for the
    search, which make does not start).
    """
    options = _without(list(argv or ()), ("--run-name", "--storage-root"))
    options += ["--run-name", run_name] + (["--storage-root", storage_root] if storage_root else [])
    if argv is None:
        return f"python -m {module} {shlex.join(options)}"
    if module == "flows.mnist" and _started_by_make():
        return f"make run ARGS={shlex.quote(shlex.join(options))}"
    return f"{shlex.quote(interpreter())} -m {module} {shlex.join(options)}"


def interpreter() -> str:
    """The Python running now, relative to the working directory when inside it (``.venv/bin/python``)."""
    python = Path(sys.executable)
    return str(python.relative_to(Path.cwd()) if python.is_relative_to(Path.cwd()) else python)


def _without(args: list[str], names: tuple[str, ...]) -> list[str]:
    """``args`` without the options ``names`` (``--name value`` and ``--name=value``)."""
    kept, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg in names:
            skip = True
        elif not arg.startswith(tuple(f"{name}=" for name in names)):
            kept.append(arg)
    return kept


def _started_by_make() -> bool:
    """True when this process is the recipe of a ``make`` target: its parent is make, or a shell make started."""
    pid = os.getppid()
    try:
        for _ in range(2):
            name = Path(f"/proc/{pid}/comm").read_text().strip()
            if name in ("make", "gmake"):
                return True
            if name not in ("sh", "bash", "dash"):
                return False
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])  # the shell's parent
    except (OSError, ValueError, IndexError):
        pass
    return False
