"""Running a flow's stages one by one and recording them: `StageRecorder`.

Each stage runs as a Prefect task on the flow's Ray task runner; its status and seconds, and how
a stopped run stopped, go into ``summary.json``. The terminal gets a line when a stage starts and
one when it ends, with what it produced.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from typing import Any

from prefect import Task
from prefect_ray.context import remote_options

from pipeline_config import PipelineConfig, TrainConfig
from runner import console, stopping, watchers
from runner.summary import DataRecord, RunSummary, StageRecord, StopRecord
from runner.tracking import Tracker
from storage_io import StorageLayout, atomic_write_json, join, read_json, redact_error, storage_writes
from training.records import HISTORY_FILE
from training.manifests import latest_checkpoint
from training.tuning import TRIALS_DIR


def stage_options(cpus: float) -> dict[str, Any]:
    """Ray options for a stage task holding ``cpus`` logical CPUs.

    A stage that holds none only coordinates: it calls Ray Train's ``fit()`` (whose controller
    Ray Train puts on the same node), starts Ray Data or inference actors, or lists files. It runs
    on the driver's node, on a cluster normally the head, which is not the node a spot reclaim or
    a drain takes away; anywhere else it would die with a preempted worker node and take the
    whole stage with it (seen in the cluster test: the training stage and its controller on the
    preempted node). Soft: another node when the driver's cannot take it. One machine: no change.
    """
    if cpus:
        return {"num_cpus": cpus}
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return {"num_cpus": 0, "scheduling_strategy": NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)}


class StageRecorder:
    """Runs stages on the task runner and records their status and seconds for summary.json.

    ``plan``: the flow's stages in order with the logical CPUs each holds (``flows.train.STAGE_CPUS``).
    """

    def __init__(
        self, runner, layout: StorageLayout, config: PipelineConfig, env: dict[str, Any], plan: dict[str, float],
        module: str = "flows.train", tracker: Tracker | None = None,
    ):
        self.runner, self.layout, self.config, self.env, self.plan = runner, layout, config, env, plan
        self.tracker = tracker or Tracker(config, layout, env)  # MLflow, when MLFLOW_TRACKING_URI is set
        self.module = module  # what resumes the run: python -m <module>
        self.stages: dict[str, StageRecord] = {}
        self.outputs: dict[str, Any] = {}
        self.stopped: StopRecord | None = None  # how an interrupted or cancelled run stopped
        self.warnings: list[str] = []  # said before training, kept in summary.json
        self.last_summary: RunSummary | None = None  # the latest one built, written or not

    def __call__(self, stage: Task, **parameters: Any) -> Any:
        name = stage.name
        number = f"[{list(self.plan).index(name) + 1}/{len(self.plan)}] {name}"
        record = self.stages[name] = StageRecord()
        console.say("%s ...%s", number, _stage_start(name, self))
        if name == "train":
            self.warn_few_steps(parameters.get("cfg", self.config.train))
        start = time.perf_counter()
        # Training says one line per epoch, read from the run's history on storage by this driver.
        history = join(self.layout.run_dir, HISTORY_FILE)
        live = self.tracker.sync_epochs if self.tracker.enabled else None  # each epoch into MLflow as it finishes
        watch = watchers.EpochWatcher(history, self.epochs(), on_epoch=live) if name == "train" else nullcontext()
        tune_cfg = getattr(self.config, "tune", None)
        if name == "tune" and tune_cfg is not None:  # one line per trial epoch, from the trials' histories
            watch = watchers.TrialWatcher(join(self.layout.run_dir, TRIALS_DIR), tune_cfg.epochs, tune_cfg.metric)
        try:
            with remote_options(**stage_options(self.plan[name])):
                future = self.runner.submit(stage, parameters=parameters)
            with watch:
                result = stopping.wait_for_stage(future, name)
        except stopping.RunStopped as stop:
            record.status = "interrupted"
            self.record_stop("interrupted", name, stop.reason)
            raise
        except BaseException as exc:
            if stopping.prefect_is_cancelling():  # Cancel in the Prefect UI: Prefect's engine ends the run
                record.status = "cancelled"
                self.record_stop("cancelled", name, "cancelled from Prefect")
            else:
                record.status, record.error = "failed", f"{type(exc).__name__}: {redact_error(exc)}"
            raise
        finally:
            record.seconds = round(time.perf_counter() - start, 2)
        record.status = "completed"
        self.outputs[name] = result
        if self.tracker.enabled:
            self.tracker.sync(self.summary())
        seconds = console.duration(record.seconds)
        detail = result.terminal_detail() if hasattr(result, "terminal_detail") else ""  # each stage's output says it
        console.say("%s done in %s%s", number, seconds, detail)
        return result

    def epochs(self) -> int | None:
        """The epochs training makes on this run's data (train.epochs capped by train.max_images), once it is known."""
        dataset = self.outputs.get("to-parquet")
        if "train" not in self.plan:  # a search without training the best config (trials: tuning)
            return None
        return self.config.train.epochs_for(dataset.rows["train"]) if dataset else None

    def warn_few_steps(self, cfg: TrainConfig) -> None:
        """One warning line when training ``cfg`` on the converted data makes too few optimizer steps to learn."""
        dataset = self.outputs.get("to-parquet")
        warning = cfg.few_steps_warning(dataset.rows["train"]) if dataset else None
        if warning and warning not in self.warnings:
            self.warnings.append(warning)
            console.run_logger().warning("%s", warning)

    def record_stop(self, status: str, stage: str, reason: str) -> None:
        """Remember that the run stopped on request in ``stage``, and the checkpoint it keeps."""
        self.stopped = StopRecord(status=status, stage=stage, reason=reason, checkpoint_kept=latest_checkpoint(self.layout.run_dir))

    def status(self) -> str:
        """completed, failed, interrupted (Ctrl-C, SIGTERM) or cancelled (from Prefect)."""
        if self.stopped:
            return self.stopped.status
        return "completed" if self.completed() else "failed"

    def completed(self) -> bool:
        """True when every stage ran and completed."""
        return len(self.stages) == len(self.plan) and all(s.status == "completed" for s in self.stages.values())

    def summary(self) -> RunSummary:
        """Run name, storage, data source, per-stage status and seconds, checkpoint and metrics."""
        raw, dataset, trained, tuned = (self.outputs.get(name) for name in ("download", "to-parquet", "train", "tune"))
        metrics = _read_metrics(self.layout)
        from prefect.runtime import flow_run

        return RunSummary(
            run_name=self.layout.run_name,
            module=self.module,
            workload=self.config.workload,
            flow_run_id=str(flow_run.id) if flow_run.id else None,
            storage_root=self.layout.root,
            run_dir=self.layout.run_dir,
            data_source=raw.source if raw else None,
            data=DataRecord(
                raw_dir=raw.directory if raw else None,
                download_skipped=raw.skipped if raw else None,
                dataset_dir=dataset.directory if dataset else None,
                conversion_skipped=dataset.skipped if dataset else None,
                rows=dataset.rows if dataset else None,
            ),
            status=self.status(),
            stopped=self.stopped,
            stages={name: record.model_copy() for name, record in self.stages.items()},
            epochs=self.epochs(),
            best_checkpoint=trained.best_checkpoint if trained else None,
            best_val_accuracy=trained.best_val_accuracy if trained else None,
            training_attempts=trained.attempts if trained else None,
            resumed_from_epoch=trained.resumed_from_epoch if trained else None,
            weights=trained.weights if trained else None,
            test_accuracy=metrics.get("accuracy"),
            promotion=metrics.get("promotion"),
            evaluation=metrics,
            tuning=tuned.summary() if tuned else None,
            warnings=list(self.warnings),
            config=self.config.model_dump(mode="json"),
            # what the training step ran on, as its last attempt recorded it: {"device": "cuda", "precision": "bf16"}
            environment=self.env | ({"training": trained.compute()} if trained and trained.compute() else {}),
        )

    def write_summary(self) -> RunSummary:
        """Build the summary and write it as summary.json; `last_summary` keeps it even when the write fails."""
        summary = self.summary()
        self.tracker.sync(summary, final=True)
        summary = self.last_summary = summary.model_copy(update={"tracking": self.tracker.record()})
        with storage_writes("summary", self.layout.run_dir):
            atomic_write_json(self.layout.summary_path, summary.to_json())
        return summary


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
