"""Running a flow's stages one by one and recording them: `Stage` and `StageRecorder`.

A flow's stage list is a plain list of calls, ``stage(DOWNLOAD, cfg=...)``, each handing the next
its output. A `Stage` carries its own concerns: its Prefect task, the logical CPUs that task holds
on Ray, and what it does around the task in the flow's own process (checks and warnings before it,
the lines said while it runs, the reports, events and summary fields that follow from its output).
The recorder runs any stage the same way and names none: each stage runs as a Prefect task on the
flow's Ray task runner; its status and seconds, and how a stopped run stopped, go into
``summary.json``. The terminal gets a line when a stage starts and one when it ends, with what it
produced (its output's ``terminal_detail``).
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from prefect import Task
from prefect.runtime import flow_run
from prefect_ray.context import remote_options

from dataset.tensors.memory import release_memory
from pipeline_config import PipelineConfig
from reporting import metrics
from runner import console, stopping
from runner.summary import DataRecord, RunSummary, StageRecord, StopRecord
from runner.tracking import Tracker
from storage_io import StorageLayout, atomic_write_json, join, read_json, redact_error, storage_writes, total_bytes
from training.manifests import latest_checkpoint


class Stage:
    """One stage of a flow: its Prefect task, the logical CPUs the task holds on Ray, and its hooks.

    The hooks run in the process that runs the flow, never in a Ray worker, so the reports and events
    they publish leave with the flow run's own Prefect client and API (a Ray worker has only the URL the
    runtime hands it: `runner.cluster.ray_init`). Each does nothing unless a stage says otherwise.

    ``cpus``: a stage that does its own work holds a CPU; one that only coordinates Ray Data, Ray Train
    or Ray Tune work (which reserves its own resources) holds none, or, with 2 CPUs and 2 training
    workers, the run deadlocks.
    """

    def __init__(self, task: Task, cpus: float = 0):
        self.task, self.cpus = task, cpus

    @property
    def name(self) -> str:
        return self.task.name

    def prepared(self, run: StageRecorder, parameters: dict[str, Any]) -> Task:
        """The task this call submits: ``task`` with the call's options (Prefect retries from its config)."""
        return self.task

    def starting(self, run: StageRecorder, parameters: dict[str, Any]) -> str:
        """Before the task is submitted: checks, warnings, events; returns what the starting line adds."""
        return ""

    def watching(self, run: StageRecorder, parameters: dict[str, Any]) -> AbstractContextManager:
        """What says lines while the task runs (`runner.watchers`)."""
        return nullcontext()

    def finished(self, run: StageRecorder, parameters: dict[str, Any], output: Any) -> None:
        """After the task completed: the summary fields its output fills (`StageRecorder.note`), its reports and events."""

    def wrote(self, run: StageRecorder, output: Any) -> list[str]:
        """The folders outside the run's own that the completed task created (a dataset it converted, a version it
        promoted), whose bytes count as written by it (``pipeline_storage_bytes_written_total``)."""
        return []


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
    import ray  # Ray: only where the cluster is used
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # Ray: only where the cluster is used

    return {"num_cpus": 0, "scheduling_strategy": NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)}


class StageRecorder:
    """Runs stages on the task runner and records their status and seconds for summary.json.

    ``plan``: the flow's stages in order (their numbers on the terminal, and what a completed run completed).
    """

    def __init__(
        self, runner, layout: StorageLayout, config: PipelineConfig, env: dict[str, Any], plan: list[Stage],
        module: str = "flows.train", tracker: Tracker | None = None,
    ):
        self.runner, self.layout, self.config, self.env, self.plan = runner, layout, config, env, list(plan)
        self.tracker = tracker or Tracker(config, layout, env)  # MLflow, when MLFLOW_TRACKING_URI is set
        self.module = module  # what resumes the run: python -m <module>
        self.stages: dict[str, StageRecord] = {}
        self.outputs: dict[str, Any] = {}
        self.facts: dict[str, Any] = {}  # RunSummary fields the stages filled (`note`)
        self.stopped: StopRecord | None = None  # how an interrupted or cancelled run stopped
        self.warnings: list[str] = []  # said before training, kept in summary.json
        self.last_summary: RunSummary | None = None  # the latest one built, written or not

    def __call__(self, stage: Stage, **parameters: Any) -> Any:
        name = stage.name
        number = f"[{[s.name for s in self.plan].index(name) + 1}/{len(self.plan)}] {name}"
        detail = stage.starting(self, parameters)  # may refuse the stage before it starts
        self.hold_cluster(name)
        record = self.stages[name] = StageRecord()
        console.say("%s ...%s", number, detail)
        kept_before = self.kept_bytes()
        start = time.perf_counter()
        try:
            with stage.watching(self, parameters):
                result = self.run_task(stage, parameters)
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
            outcome = "completed" if record.status == "running" else record.status
            metrics.stage(self.config.workload, name, outcome, record.seconds)
        record.status = "completed"
        self.outputs[name] = result
        detail = result.terminal_detail() if hasattr(result, "terminal_detail") else ""  # each stage's output says it
        console.say("%s done in %s%s", number, console.duration(record.seconds), detail)
        stage.finished(self, parameters, result)  # a failure here is the run's, after the stage
        self.count_written(stage, result, kept_before)
        release_memory()  # what the stage's reports read here (sample images of a dataset): this process lives all run
        if self.tracker.enabled:
            self.tracker.sync(self.summary())
        return result

    def kept_bytes(self) -> int | None:
        """What the run's own folder holds now (None when it cannot be listed: nothing is counted then)."""
        try:
            return total_bytes(self.layout.run_dir)
        except Exception:  # noqa: BLE001 - a listing that fails costs a metric, never the run
            return None

    def count_written(self, stage: Stage, result: Any, kept_before: int | None) -> None:
        """``pipeline_storage_bytes_written_total``: the growth of the run's folder over the stage, and the folders the
        stage created outside it (`Stage.wrote`); bytes kept on storage, so a checkpoint replaced within the stage
        counts once."""
        kept_after = self.kept_bytes()
        if kept_before is None or kept_after is None:
            return
        try:
            created = sum(total_bytes(path) for path in stage.wrote(self, result))
        except Exception:  # noqa: BLE001 - as kept_bytes
            return
        metrics.record("pipeline_storage_bytes_written_total", max(0, kept_after - kept_before) + created,
                       workload=self.config.workload, stage=stage.name)

    def hold_cluster(self, stage: str) -> None:
        """On a shared cluster, wait for its run slot before the stage's line and seconds (`runner.cluster.cluster_slot`):
        the wait is no stage's time. A stop meanwhile is recorded as one in ``stage``."""
        hold = getattr(self.runner, "hold_cluster", None)  # a runner that joins no cluster has none
        if hold is None:
            return
        try:
            hold()
        except stopping.RunStopped as stop:
            self.record_stop("interrupted", stage, stop.reason)
            raise
        except BaseException:
            if stopping.prefect_is_cancelling():  # Cancel in the Prefect UI while waiting
                self.record_stop("cancelled", stage, "cancelled from Prefect")
            raise

    def run_task(self, stage: Stage, parameters: dict[str, Any]) -> Any:
        """Submit the stage's task on Ray with the CPUs it holds, and wait for its output (a stop request cancels it)."""
        with remote_options(**stage_options(stage.cpus)):
            future = self.runner.submit(stage.prepared(self, parameters), parameters=parameters)
        return stopping.wait_for_stage(future, stage.name)

    def note(self, **fields: Any) -> None:
        """RunSummary fields a stage filled; a dict-valued field (``data``, ``environment``) is merged."""
        for key, value in fields.items():
            before = self.facts.get(key)
            self.facts[key] = before | value if isinstance(before, dict) and isinstance(value, dict) else value

    def warn(self, warning: str) -> None:
        """Say ``warning`` once (a retried stage says it again) and keep it in summary.json."""
        if warning not in self.warnings:
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
        """Run name, storage, per-stage status and seconds, what the stages noted, and the metrics on storage."""
        facts = dict(self.facts)
        metrics = _read_metrics(self.layout)
        return RunSummary(
            run_name=self.layout.run_name,
            module=self.module,
            workload=self.config.workload,
            flow_run_id=str(flow_run.id) if flow_run.id else None,
            storage_root=self.layout.root,
            run_dir=self.layout.run_dir,
            data=DataRecord(**facts.pop("data", {})),
            status=self.status(),
            stopped=self.stopped,
            stages={name: record.model_copy() for name, record in self.stages.items()},
            test_accuracy=metrics.get("accuracy"),
            gate={"min_accuracy": metrics["min_accuracy"], "from": metrics.get("gate", "")} if "min_accuracy" in metrics else None,
            promotion=metrics.get("promotion"),
            evaluation=metrics,
            warnings=list(self.warnings),
            config=self.config.model_dump(mode="json"),
            environment=self.env | facts.pop("environment", {}),  # with what the training step ran on, once it ran
            **facts,
        )

    def write_summary(self) -> RunSummary:
        """Build the summary and write it as summary.json; `last_summary` keeps it even when the write fails."""
        summary = self.summary()
        self.tracker.sync(summary, final=True)
        summary = self.last_summary = summary.model_copy(update={"tracking": self.tracker.record()})
        with storage_writes("summary", self.layout.run_dir):
            atomic_write_json(self.layout.summary_path, summary.to_json())
        return summary


def _read_metrics(layout: StorageLayout) -> dict[str, Any]:
    metrics = read_json(join(layout.evaluation_dir, "metrics.json"))
    return metrics if isinstance(metrics, dict) else {}
