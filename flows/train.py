"""The training pipeline for any workload as one Prefect flow whose stages run on Ray.

    python -m flows.train --workload flowers --model.name mobilenet_v3_small ...   # any workload
    python -m flows.train --preset smoke      # a minutes-long check (MNIST's bundled sample)
    python -m flows.train --help              # every field, also settable as PIPELINE_<SECTION>__<FIELD>

``workload`` names the run (``<workload>-<time>-<id>``), its artifact keys and the registry's
model (``<workload>-<model>``); its default is MNIST, whose own entry point ``flows.mnist`` is
this flow with MNIST's names (flow ``mnist-resnet18``, ``MNIST_*`` environment variables).

Stages hand each other manifests (paths, row counts, checksums), never in-memory data, so any
stage can run on any Ray node, be retried, or be skipped when its output is already on storage.
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from contextlib import nullcontext
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from prefect import Task, flow
from prefect.states import Cancelled
from prefect_ray.context import remote_options
from pydantic import ValidationError

from dataset import folder
from pipeline_config import DEFAULT_WORKLOAD, PipelineConfig, TunePipelineConfig
from pipeline_config.settings import TrainSettings, parse_cli
from reporting import artifacts, environment
from runner import console, hooks, stopping
from runner.runtime import cli_runtime, ray_task_runner
from storage_io import (
    RunInUseError,
    StorageLayout,
    atomic_write_json,
    join,
    lease_uses,
    read_json,
    run_lease,
    storage_writes,
)
from tasks.cleanup import cleanup
from tasks.download import download
from tasks.evaluate import evaluate
from tasks.to_parquet import to_parquet
from tasks.train import retry_infrastructure_failures, train
from tasks.transform import transform
from training import models
from training.records import HISTORY_FILE
from training.trainer import latest_checkpoint, plan_resources
from training.tuning import TRIALS_DIR

# Logical CPUs the Prefect task itself holds on Ray. Download and conversion do their own work;
# the other stages only coordinate Ray Data / Ray Train work that reserves its own resources,
# and holding a CPU there would starve it (with 2 CPUs and 2 training workers, it deadlocks).
STAGE_CPUS = {"download": 1, "to-parquet": 1, "transform": 0, "train": 0, "evaluate": 0, "cleanup": 0}


def train_with_retries(cfg) -> Task:
    """The training stage with Prefect retries for when Ray Train gives up (see tasks/train.py)."""
    return train.with_options(
        retries=cfg.stage_retries,
        retry_delay_seconds=cfg.stage_retry_delay_s,
        retry_condition_fn=retry_infrastructure_failures,
    )


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


class StageRecorder:
    """Runs stages on the task runner and records their status and seconds for summary.json.

    ``plan``: the flow's stages in order with the logical CPUs each holds (`STAGE_CPUS`).
    """

    def __init__(
        self, runner, layout: StorageLayout, config: PipelineConfig, env: dict[str, Any], plan: dict[str, float] = STAGE_CPUS,
        module: str = "flows.train",
    ):
        self.runner, self.layout, self.config, self.env, self.plan = runner, layout, config, env, plan
        self.module = module  # what resumes the run: python -m <module>
        self.stages: dict[str, dict[str, Any]] = {}
        self.outputs: dict[str, Any] = {}
        self.stopped: dict[str, Any] | None = None  # how an interrupted or cancelled run stopped

    def __call__(self, stage: Task, **parameters: Any) -> Any:
        name = stage.name
        number = f"[{list(self.plan).index(name) + 1}/{len(self.plan)}] {name}"
        self.stages[name] = {"status": "running", "seconds": None}
        console.say("%s ...%s", number, _stage_start(name, self))
        start = time.perf_counter()
        # Training says one line per epoch, read from the run's history on storage by this driver.
        history = join(self.layout.run_dir, HISTORY_FILE)
        watch = console.EpochWatcher(history, self.epochs()) if name == "train" else nullcontext()
        tune_cfg = getattr(self.config, "tune", None)
        if name == "tune" and tune_cfg is not None:  # one line per trial epoch, from the trials' histories
            watch = console.TrialWatcher(join(self.layout.run_dir, TRIALS_DIR), tune_cfg.epochs, tune_cfg.metric)
        try:
            with remote_options(num_cpus=self.plan[name]):
                future = self.runner.submit(stage, parameters=parameters)
            with watch:
                result = stopping.wait_for_stage(future, name)
        except stopping.RunStopped as stop:
            self.stages[name]["status"] = "interrupted"
            self.record_stop("interrupted", name, stop.reason)
            raise
        except BaseException as exc:
            if stopping.prefect_is_cancelling():  # Cancel in the Prefect UI: Prefect's engine ends the run
                self.stages[name]["status"] = "cancelled"
                self.record_stop("cancelled", name, "cancelled from Prefect")
            else:
                self.stages[name] |= {"status": "failed", "error": f"{type(exc).__name__}: {exc}"}
            raise
        finally:
            self.stages[name]["seconds"] = round(time.perf_counter() - start, 2)
        self.stages[name]["status"] = "completed"
        self.outputs[name] = result
        seconds = console.duration(self.stages[name]["seconds"])
        console.say("%s done in %s%s", number, seconds, _stage_detail(name, result, self.config))
        return result

    def epochs(self) -> int | None:
        """The epochs training makes on this run's data (train.epochs capped by train.max_images), once it is known."""
        dataset = self.outputs.get("to-parquet")
        if "train" not in self.plan:  # a search without training the best config (trials: tuning)
            return None
        return self.config.train.epochs_for(dataset.rows["train"]) if dataset else None

    def record_stop(self, status: str, stage: str, reason: str) -> None:
        """Remember that the run stopped on request in ``stage``, and the checkpoint it keeps."""
        self.stopped = {"status": status, "stage": stage, "reason": reason, "checkpoint_kept": latest_checkpoint(self.layout.run_dir)}

    def status(self) -> str:
        """completed, failed, interrupted (Ctrl-C, SIGTERM) or cancelled (from Prefect)."""
        if self.stopped:
            return self.stopped["status"]
        return "completed" if self.completed() else "failed"

    def completed(self) -> bool:
        """True when every stage ran and completed."""
        return len(self.stages) == len(self.plan) and all(s["status"] == "completed" for s in self.stages.values())

    def summary(self) -> dict[str, Any]:
        """Run name, storage, data source, per-stage status and seconds, checkpoint and metrics."""
        raw, dataset, trained, tuned = (self.outputs.get(name) for name in ("download", "to-parquet", "train", "tune"))
        metrics = _read_metrics(self.layout)
        from prefect.runtime import flow_run

        return {
            "run_name": self.layout.run_name,
            "module": self.module,  # what resumes it
            "workload": self.config.workload,
            "flow_run_id": str(flow_run.id) if flow_run.id else None,
            "storage_root": self.layout.root,
            "run_dir": self.layout.run_dir,
            "data_source": raw.source if raw else None,
            "data": {
                "raw_dir": raw.directory if raw else None,
                "download_skipped": raw.skipped if raw else None,
                "dataset_dir": dataset.directory if dataset else None,
                "conversion_skipped": dataset.skipped if dataset else None,
                "rows": dataset.rows if dataset else None,
            },
            "status": self.status(),
            "stopped": self.stopped,
            "stages": self.stages,
            "epochs": self.epochs(),
            "best_checkpoint": trained.best_checkpoint if trained else None,
            "best_val_accuracy": trained.best_val_accuracy if trained else None,
            "training_attempts": trained.attempts if trained else None,
            "resumed_from_epoch": trained.resumed_from_epoch if trained else None,
            "test_accuracy": metrics.get("accuracy"),
            "promotion": metrics.get("promotion"),
            "evaluation": metrics,
            **({"tuning": tuned.summary() if tuned else None} if "tune" in self.plan else {}),
            "config": self.config.model_dump(mode="json"),
            "environment": self.env,
        }

    def write_summary(self) -> dict[str, Any]:
        summary = self.summary()
        hooks.remember_summary(summary)  # the failure hook's account, even when the write below fails
        with storage_writes("summary", self.layout.run_dir):
            atomic_write_json(self.layout.summary_path, summary)
        return summary


def _stage_detail(name: str, result: Any, config: PipelineConfig) -> str:
    """What a finished stage produced, in a few words for its terminal line (empty when nothing to say)."""
    reused = " (verified on storage, reused)" if getattr(result, "skipped", False) else ""
    if name == "download":
        return f": {result.source} data{reused}"
    if name == "to-parquet":
        rows = result.rows
        return f": {rows.get('train', 0):,} train / {rows.get('val', 0):,} validation / {rows.get('test', 0):,} test rows{reused}"
    if name == "transform":
        return " (checks of this dataset and config reused)" if result.skipped else ""
    if name == "train":
        return f": best validation accuracy {result.best_val_accuracy:.2%}"
    if name == "tune":
        best = result.best
        return (f": best trial {best.trial_id}, {result.metric} {best.best_metric:.4f} ({len(result.trials)} trials, "
                f"{result.stopped_early()} stopped early){' (search restored)' if result.restored else ''}")
    if name == "evaluate":
        promotion = result.promotion
        promoted = ""
        if promotion is not None:
            promoted = f", promoted to {promotion.model} v{promotion.version}" if promotion.promoted else ", not promoted"
        return f": test accuracy {result.accuracy:.2%} (gate {config.evaluate.min_accuracy:.2%} passed){promoted}"
    if name == "cleanup":
        verb = "would delete" if result.dry_run else "deleted"
        kept = f", kept {len(result.kept)} for the model registry" if result.kept else ""
        return f": {verb} {len(result.paths)} item(s){kept}"
    return ""


def _stage_start(name: str, stage: StageRecorder) -> str:
    """What a starting stage will do, when there is more to say than its name."""
    if name == "train":
        return f" {stage.epochs()} epoch(s)"
    tune_cfg = getattr(stage.config, "tune", None)
    if name == "tune" and tune_cfg is not None:
        return f" {tune_cfg.num_samples} trial(s) of up to {tune_cfg.epochs} epoch(s), {tune_cfg.scheduler.upper()} by {tune_cfg.metric}"
    return ""


def _read_metrics(layout: StorageLayout) -> dict[str, Any]:
    metrics = read_json(join(layout.evaluation_dir, "metrics.json"))
    return metrics if isinstance(metrics, dict) else {}


@flow(name="train", flow_run_name=flow_run_name, log_prints=True, on_failure=[hooks.report_failure])
def train_pipeline(config: PipelineConfig = PipelineConfig()) -> dict[str, Any]:
    """Any workload: download, convert to Parquet, transform with Ray Data, train model.name with Ray Train, evaluate, clean up."""
    return run_flow(config, "flows.train", check_cluster_fits, STAGE_CPUS, run_stages)


def run_stages(stage: StageRecorder, layout: StorageLayout, config: PipelineConfig) -> None:
    """The stage list."""
    workload = config.workload  # names the artifact keys and the registry's model
    raw = stage(download, cfg=config.download, layout=layout)
    dataset = stage(
        to_parquet, raw=raw, cfg=config.parquet, layout=layout, image_size=config.transform.image_size, workload=config.workload
    )
    lease_uses(layout, raw.directory, dataset.directory)  # other runs' cleanup leaves them alone
    artifacts.publish_dataset_report(dataset, workload)
    spec = stage(transform, dataset=dataset, cfg=config.transform, layout=layout)
    trained = stage(
        train_with_retries(config.train), spec=spec, cfg=config.train, layout=layout, model=config.model, workload=workload,
    )
    artifacts.publish_training_report(trained, workload)
    # Evaluation publishes its reports (confusion matrix, predictions, metrics) before its gate decides.
    # Evaluation ends with champion promotion (config.promote): the model replaces the champion only when better.
    evaluation = stage(
        evaluate, trained=trained, spec=spec, cfg=config.evaluate, layout=layout,
        promote=config.promote, run_config=config.model_dump(mode="json"), raw_dir=raw.directory, workload=workload,
    )
    stage(cleanup, cfg=config.cleanup, raw=raw, dataset=dataset, trained=trained, evaluation=evaluation, layout=layout)


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


def check_cluster_fits(config: PipelineConfig) -> None:
    """Refuse training workers the cluster cannot hold (ValueError naming the field) before any work starts."""
    import ray

    if config.train.mode == "single":
        return
    resources = ray.cluster_resources()
    plan_resources(config.train, resources.get("CPU", 0), resources.get("GPU", 0))


def resume_hint(summary: dict[str, Any]) -> str:
    """Where the stopped run can go on from, and the command that does it."""
    kept = (summary.get("stopped") or {}).get("checkpoint_kept")
    where = f"its checkpoint {kept['path']} is kept" if kept else "no training checkpoint was written yet"
    command = console.resume_command(
        summary.get("run_name") or "?", summary.get("storage_root"), None, summary.get("module", "flows.train")
    )
    return f"{where}; resume with: {command}"


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: parse settings, run the flow against a Prefect API, print a short summary."""
    return run_cli(argv, TrainSettings, train_pipeline, "Training pipeline", "flows.train")


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


if __name__ == "__main__":
    sys.exit(main())
