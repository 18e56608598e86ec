"""The pipeline's stages as the flows run them, each with its own concerns (`runner.stages.Stage`).

A stage is its Prefect task (``tasks/``), the logical CPUs the task holds on Ray, and what follows from
its output in the flow's process: the reports it publishes, the domain events it sends
(`reporting.events`), what it adds to ``summary.json`` and to its terminal lines. Every flow that runs
a stage gets all of it, so `flows.train` and `flows.tune` send the same events: the promote stage sends
``pipeline.gate.failed`` before it fails a run below its gate and ``pipeline.model.promoted`` after a new
champion, whichever flow trained it.

CPUs: download and conversion do their own work and hold one; every other stage only coordinates Ray
Data, Ray Train or Ray Tune work that reserves its own resources, and holding a CPU there would starve
it (with 2 CPUs and 2 training workers, it deadlocks).

The hooks run where the flow runs, never in a Ray worker: an event leaves with the flow run's own
Prefect client (the flow run and its deployment as related resources), the same way from the CLI, a
deployment's run or a run that joined a cluster.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

from prefect import Task

from dataset.formats.parquet import ParquetDataset
from dataset.sources.interface import RawData
from dataset.tensors.spec import TransformSpec
from pipeline_config import PipelineConfig
from reporting import artifacts, events, metrics
from runner.harness import skips_when_unchanged
from runner.pipeline_run import PipelineRun
from runner.stages import Stage, StageRecorder
from runner.watchers import EpochWatcher
from storage_io import StorageLayout, join, lease_uses, redact_url
from tasks import gate
from tasks.cleanup import cleanup
from tasks.download import download
from tasks.evaluate import evaluate
from tasks.promote import promote
from tasks.to_parquet import to_parquet
from tasks.train import retry_infrastructure_failures, train
from tasks.transform import transform
from training.champion import unchanged
from training.champion.registry import Promotion
from training.champion.registry_files import version_dir
from training.checkpoint.records import HISTORY_FILE
from training.model import trust


def with_retries(task: Task, cfg) -> Task:
    """``task`` with Prefect retries for when Ray Train (or Tune) gives up on lost infrastructure (see tasks/train.py)."""
    return task.with_options(
        retries=cfg.stage_retries,
        retry_delay_seconds=cfg.stage_retry_delay_s,
        retry_condition_fn=retry_infrastructure_failures,
    )


class Download(Stage):
    """Where the data is and whether it was fetched again."""

    def finished(self, run: StageRecorder, parameters: dict[str, Any], raw: Any) -> None:
        run.note(data_source=raw.source, data={"raw_dir": raw.directory, "download_skipped": raw.skipped})

    def wrote(self, run: StageRecorder, raw: Any) -> list[str]:  # files fetched into the storage root (not a user's folder)
        return [] if raw.skipped or not run.layout.contains(raw.directory) else [raw.directory]


class ToParquet(Stage):
    """The dataset: its labels checked across splits and its test split against the gate it will get (before
    any training: `tasks.gate.before_training`), leased against other runs' cleanup, checked against the
    champion's (the data-checked event), tried on the run's model, and shown in the UI."""

    def wrote(self, run: StageRecorder, dataset: Any) -> list[str]:  # a dataset converted now, not one reused
        return [] if dataset.skipped else [dataset.directory]

    def finished(self, run: StageRecorder, parameters: dict[str, Any], dataset: Any) -> None:
        config, layout = run.config, run.layout
        run.note(data={"dataset_dir": dataset.directory, "conversion_skipped": dataset.skipped, "rows": dataset.rows})
        for warning in gate.before_training(config.evaluate, dataset):  # LabelsDisagree stops the run here
            run.warn(warning)
        lease_uses(layout, parameters["raw"].directory, dataset.directory)  # other runs' cleanup leaves them alone
        if not skips_when_unchanged(config):  # else `flows.train.nothing_new` sent it before Ray started
            announce_data(config, layout, dataset.directory, verified=True)
        trust.try_on_dataset(config, dataset)  # an s3:// folder's shape is known only now: the model runs on it
        artifacts.publish_dataset_report(dataset, config.workload)


class Train(Stage):
    """Training: Prefect retries from its config, the epochs it makes and a warning when they are too few to
    learn, one line per epoch while it runs, and its report."""

    def prepared(self, run: StageRecorder, parameters: dict[str, Any]) -> Task:
        return with_retries(self.task, parameters["cfg"])

    def starting(self, run: StageRecorder, parameters: dict[str, Any]) -> str:
        cfg, rows = parameters["cfg"], parameters["spec"].dataset.rows["train"]
        run.note(epochs=cfg.epochs_for(rows))
        warning = cfg.few_steps_warning(rows)
        if warning:
            run.warn(warning)
        return f" {cfg.epochs_for(rows)} epoch(s)"

    def watching(self, run: StageRecorder, parameters: dict[str, Any]) -> AbstractContextManager:
        epochs = parameters["cfg"].epochs_for(parameters["spec"].dataset.rows["train"])
        live = run.tracker.sync_epochs if run.tracker.enabled else None  # each epoch into MLflow as it finishes
        config = run.config
        return EpochWatcher(join(run.layout.run_dir, HISTORY_FILE), epochs, on_epoch=live,
                            on_row=lambda row: metrics.epoch(config.workload, config.registry_name, row))

    def finished(self, run: StageRecorder, parameters: dict[str, Any], trained: Any) -> None:
        compute = trained.compute()  # what the training step ran on: {"device": "cuda", "precision": "bf16"}
        run.note(
            best_checkpoint=trained.best_checkpoint, best_val_accuracy=trained.best_val_accuracy,
            training_attempts=trained.attempts, resumed_from_epoch=trained.resumed_from_epoch, weights=trained.weights,
            environment={"training": compute} if compute else {},
        )
        artifacts.publish_training_report(trained, run.config.workload)
        restarts = len(trained.attempts or []) - 1  # each attempt after the first: a restart of the group, a retry
        metrics.record("pipeline_train_restarts_total", restarts, workload=run.config.workload, model=run.config.registry_name)


class Promote(Stage):
    """Promotion and its events: ``pipeline.gate.failed`` before the stage fails a run below its gate,
    ``pipeline.model.promoted`` after a new champion (which ``score/on-promotion`` scores)."""

    def starting(self, run: StageRecorder, parameters: dict[str, Any]) -> str:
        evaluation = parameters["evaluation"]
        metrics.gate(run.config.workload, run.config.registry_name, evaluation.passed_gate, evaluation.accuracy)
        if not evaluation.passed_gate:
            announce(
                run.config, events.GATE_FAILED, run=run.layout.run_name, test_accuracy=evaluation.accuracy,
                min_accuracy=evaluation.min_accuracy, gate=evaluation.gate,
            )
        return ""

    def finished(self, run: StageRecorder, parameters: dict[str, Any], outcome: Any) -> None:
        if outcome.promotion is not None and outcome.promotion.promoted:
            announce_promotion(run.config, run.layout, outcome.promotion, parameters["evaluation"].accuracy)
            metrics.record("pipeline_promotions_total", 1, workload=run.config.workload, model=outcome.promotion.model)

    def wrote(self, run: StageRecorder, outcome: Any) -> list[str]:  # the new version's folder in the registry
        promotion = outcome.promotion
        promoted = promotion is not None and promotion.promoted and promotion.version is not None
        return [version_dir(run.layout.root, promotion.model, promotion.version)] if promoted else []


DOWNLOAD = Download(download, cpus=1)
TO_PARQUET = ToParquet(to_parquet, cpus=1)
TRANSFORM = Stage(transform)
TRAIN = Train(train)
EVALUATE = Stage(evaluate)
PROMOTE = Promote(promote)
CLEANUP = Stage(cleanup)


def data_stages(run: PipelineRun, config: PipelineConfig) -> tuple[RawData, ParquetDataset, TransformSpec]:
    """The data stages every flow starts with, each with its own config section and the previous manifest: the
    data listed and fingerprinted, converted to the project's Parquet dataset, transformed for training."""
    raw = run(DOWNLOAD, cfg=config.download, layout=run.layout)
    dataset = run(
        TO_PARQUET, raw=raw, cfg=config.parquet, layout=run.layout, image_size=config.transform.image_size,
        workload=config.workload, max_image_pixels=config.download.max_image_pixels,
    )
    spec = run(TRANSFORM, dataset=dataset, cfg=config.transform, layout=run.layout)
    return raw, dataset, spec


def announce_data(config: PipelineConfig, layout: StorageLayout, dataset_dir: str, verified: bool) -> unchanged.Verdict:
    """The data's verdict against the champion's (`training.champion.unchanged`), sent as the data-checked event."""
    verdict = unchanged.compare(layout.root, config.registry_name, dataset_dir, verified, config.model_dump(mode="json"))
    announce(config, events.DATA_CHECKED, run=layout.run_name, **verdict.payload())
    return verdict


def announce_promotion(config: PipelineConfig, layout: StorageLayout, promotion: Promotion, accuracy: float) -> None:
    """The promotion event: the new champion, its accuracy and run, and the champion it replaced."""
    announce(
        config, events.PROMOTED, model=promotion.model, version=promotion.version, test_accuracy=accuracy,
        run=layout.run_name, replaced_version=promotion.champion_before, replaced_accuracy=promotion.champion_accuracy,
        storage_root=redact_url(layout.root),
    )


def announce(config: PipelineConfig, name: str, **payload) -> None:
    """Send one domain event about the run's model (`reporting.events`)."""
    events.emit(name, events.model_resource(config.registry_name, config.workload, config.model.name), payload)
