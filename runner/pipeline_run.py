"""A flow run's context: the run's name, and `PipelineRun`, what a flow's body runs its stages in.

`PipelineRun` does the checks before any work, names the run folder, starts the Ray task runner, the cluster
check and the run's lease at the first stage, and writes ``summary.json`` however the run ends; the flow's
body is its stage calls (`flows.train`, `flows.tune`).
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Callable
from contextlib import ExitStack
from datetime import datetime, timezone
from typing import Any

from prefect.context import FlowRunContext
from prefect.runtime import flow_run
from prefect.states import Cancelled, Completed
from pydantic import ValidationError

from dataset.sources.interface import DataToCome, check_data, keep_checks
from dataset.tensors import sizing
from pipeline_config import DEFAULT_WORKLOAD, PipelineConfig, TunePipelineConfig
from reporting import artifacts, environment, metrics
from runner import console, stopping
from runner.cluster.ray_init import linger_for_metrics, ray_task_runner
from runner.stages import Stage, StageRecorder
from runner.summary import DataRecord, RunSummary, attach
from runner.tracking_records import tracking_uri
from storage_io import StorageLayout, atomic_write_json, run_lease, storage_writes
from training.model import trust


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
    and `PipelineRun` names its folder after it."""
    config = flow_run.parameters.get("config")
    if isinstance(config, dict):  # before validation; an invalid config fails with its own message later
        try:
            config = (TunePipelineConfig if "tune" in config else PipelineConfig).model_validate(config)
        except ValidationError:
            return default_run_name()
    if not isinstance(config, PipelineConfig):
        return default_run_name()
    return config.run_name or default_run_name(run_name_prefix(config))


class PipelineRun:
    """One flow run of the pipeline, as the flow's body sees it: ``with PipelineRun(...) as run:``, then one
    ``run(STAGE, ...)`` per stage, then ``return run.result``.

    Entering it does the checks before any work (what a run may import, its data source, the tracking URI, the
    model's trial on the data) and names the run folder (`flow_run_name`'s name when ``run_name`` is unset);
    nothing is written yet, and nothing is started. The first stage call starts the rest: the Ray task runner,
    ``check_fits`` (the cluster holds the run), the run's lease, the listing cache the data checks held
    (`dataset.sources.interface.keep_checks`: a run refused before any work leaves the storage root as it was) and
    the environment report; each stage call then runs on it (`runner.stages.StageRecorder`). Leaving it writes
    ``summary.json`` however the run ended: ``result`` is the run's `RunSummary`; on a stop request (Ctrl-C,
    SIGTERM) a Cancelled state holding it, the stop not raised further; a failed run's exception carries it
    (`runner.summary.attach`). A run that ends before any stage (`ended`: nothing new to train on) starts no Ray.

    ``module``: the flow's CLI module, what the summary's resume command runs.
    """

    def __init__(self, config: PipelineConfig, module: str, plan: list[Stage], check_fits: Callable[[PipelineConfig], None] | None):
        self.config, self.module, self.plan, self.check_fits = config, module, list(plan), check_fits
        self.layout: StorageLayout | None = None
        self.source: DataToCome | None = None  # what the data check found (`dataset.sources.interface.check_data`)
        self.result: RunSummary | Cancelled | Completed | None = None
        self.recorder: StageRecorder | None = None
        self._started = False
        self._resources = ExitStack()

    def __enter__(self) -> PipelineRun:
        config = self.config
        trust.check_allowed(config.model.name, deployed=started_by_deployment())  # before anything is imported
        self.source = check_data(config.download, sizing.checked_size(config.transform), config.storage_root)
        tracking_uri(config)  # ValueError naming MLFLOW_TRACKING_URI when this process's cannot be used
        trust.check_model(self.resolved, self.source)  # ValueError naming model.name: it does not import, build or run on this data
        self.layout = StorageLayout.create(config.storage_root, config.run_name or _named_run(config))
        self.layout.check_reachable()  # an S3 root: the bucket answers before any work starts
        return self

    @property
    def resolved(self) -> PipelineConfig:
        """The config with ``transform.image_size: auto`` made concrete for this run's data (what names its dataset)."""
        return sizing.resolved(self.config, self.source)

    def ended(self, summary: RunSummary) -> Completed:
        """End the run before any stage, with nothing new to train on: ``summary`` is `ended_before_training`'s."""
        self.result = Completed(message=f"nothing new to train on: {summary.nothing_new}", data=summary)
        return self.result

    def __call__(self, stage: Stage, **parameters: Any) -> Any:
        """Run ``stage`` with ``parameters`` (its task's arguments) on the run's Ray; its output, a manifest."""
        if self.recorder is None:
            self._start()
        return self.recorder(stage, **parameters)

    def _start(self) -> None:
        self._started = True
        self._resources.enter_context(stopping.keep_sigterm())
        runner = self._resources.enter_context(ray_task_runner(self.config.ray))
        if self.check_fits is not None:
            self.check_fits(self.config)  # before anything is written
        self._resources.enter_context(run_lease(self.layout))  # refuses a live run of the same name
        keep_checks(self.config.download, self.config.storage_root)  # past every check: the listing cache now
        env = environment.describe()
        artifacts.publish_environment_report(env, self.config.workload)
        self.recorder = StageRecorder(runner, self.layout, self.config, env, self.plan, self.module)

    def __exit__(self, kind, error, trace) -> bool:
        stopped = isinstance(error, stopping.RunStopped) and self.recorder is not None  # a stop during a stage: the run is Cancelled
        try:
            if self.recorder is not None:
                self._summarize(error)
        finally:
            try:
                if stopped:
                    self._resources.__exit__(None, None, None)
                else:
                    self._resources.__exit__(kind, error, trace)
            finally:
                if self._started:
                    stopping.flow_body_done(self.recorder.last_summary if self.recorder else None)
        return stopped

    def _summarize(self, error: BaseException | None) -> None:
        if error is None:
            self.result = self.recorder.write_summary()
        elif isinstance(error, stopping.RunStopped):
            summary = self.recorder.write_summary()
            self.result = Cancelled(message=f"run {self.layout.run_name} {error}; {resume_hint(summary)}", data=summary)
        else:
            try:
                self.recorder.write_summary()
            except Exception as exc:  # e.g. the storage root is full: keep the stage's own error
                print(f"could not write {self.layout.summary_path}: {exc}", file=sys.stderr)
            attach(error, self.recorder.last_summary)  # for the failure hook and the CLI, written or not
        metrics.run_ended(self.config.workload, self.recorder.status())
        linger_for_metrics(self.config.ray)  # the run's figures to Prometheus before its own Ray stops


def ended_before_training(
    config: PipelineConfig, layout: StorageLayout, module: str, reason: str, source: str, **data: Any
) -> RunSummary:
    """The summary of a run that ends before any stage, with nothing new to train on; written as summary.json.

    ``source``: where its data came from (``RawData.source``); ``data``: `runner.summary.DataRecord`
    fields (where the raw data and the dataset are).
    """
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
    context = FlowRunContext.get()
    return bool(context and context.flow_run and context.flow_run.deployment_id)


def _named_run(config: PipelineConfig) -> str:
    """The flow run's name when `flow_run_name` made it for this config (a deployment's run), else a new default name."""
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
