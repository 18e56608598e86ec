"""The training pipeline for any workload as one Prefect flow whose stages run on Ray.

    python -m flows.train --workload flowers --model.name mobilenet_v3_small ...   # any workload
    python -m flows.train --preset smoke      # a minutes-long check (MNIST's bundled sample)
    python -m flows.train --help              # every field, also settable as PIPELINE_<SECTION>__<FIELD>

``workload`` names the run (``<workload>-<time>-<id>``), its artifact keys and the registry's
model (``<workload>-<model>``); its default is MNIST, whose own entry point ``flows.mnist`` is
this flow with MNIST's names (flow ``mnist-resnet18``, ``MNIST_*`` environment variables). An
image folder (``download.source=folder``) without a workload of its own is named after the folder.

With ``promote.skip_unchanged`` (the ``nightly`` preset), a run whose data, model and recipe are its
champion's ends before Ray starts, as "nothing new to train on" (`nothing_new`). Every run sends
the domain events of `reporting.events` (data checked, gate failed, promoted).

Before any work (`check_registry_fits`): a champion of the run's registry name trained on other
images or classes than this run's data is refused, naming ``--workload`` and ``promote.model_name``.

Stages hand each other manifests (paths, row counts, checksums), never in-memory data, so any
stage can run on any Ray node, be retried, or be skipped when its output is already on storage.
"""

from __future__ import annotations

from prefect import Task, flow, get_run_logger

from dataset.parquet import manifest_problem
from flows.preflight import check_cluster_fits, check_registry_fits, data_to_come, workload_line  # noqa: F401 (the CLI, tests)
from pipeline_config import PipelineConfig
from pipeline_config.settings import TrainSettings
from reporting import artifacts, events
from runner import console, hooks
from runner.harness import ended_before_training, exit_now, flow_run_name, run_cli, run_flow
from runner.stages import StageRecorder
from runner.summary import RunSummary
from storage_io import StorageLayout, exists, lease_uses, redact_url
from tasks.cleanup import cleanup
from tasks.download import download
from tasks.evaluate import evaluate
from tasks.promote import PromotionOutcome, promote
from tasks.to_parquet import dataset_fingerprint, to_parquet
from tasks.train import retry_infrastructure_failures, train
from tasks.transform import transform
from training import model_trust
from training import unchanged
from training.registry import Promotion


# Logical CPUs the Prefect task itself holds on Ray. Download and conversion do their own work;
# the other stages only coordinate Ray Data / Ray Train work that reserves its own resources,
# and holding a CPU there would starve it (with 2 CPUs and 2 training workers, it deadlocks).
STAGE_CPUS = {"download": 1, "to-parquet": 1, "transform": 0, "train": 0, "evaluate": 0, "promote": 0, "cleanup": 0}


def train_with_retries(cfg) -> Task:
    """The training stage with Prefect retries for when Ray Train gives up (see tasks/train.py)."""
    return train.with_options(
        retries=cfg.stage_retries,
        retry_delay_seconds=cfg.stage_retry_delay_s,
        retry_condition_fn=retry_infrastructure_failures,
    )


@flow(name="train", flow_run_name=flow_run_name, log_prints=True, on_failure=[hooks.report_failure])
def train_pipeline(config: PipelineConfig = PipelineConfig()) -> RunSummary:
    """Any workload: download, convert to Parquet, transform with Ray Data, train model.name with Ray Train, evaluate, promote, clean up."""
    return run_flow(config, "flows.train", check_cluster_fits, STAGE_CPUS, run_stages, nothing_new)


def run_stages(stage: StageRecorder, layout: StorageLayout, config: PipelineConfig) -> None:
    """The stage list."""
    workload = config.workload  # names the artifact keys and the registry's model
    raw = stage(download, cfg=config.download, layout=layout)
    dataset = stage(
        to_parquet, raw=raw, cfg=config.parquet, layout=layout, image_size=config.transform.image_size, workload=config.workload,
        max_image_pixels=config.download.max_image_pixels,
    )
    lease_uses(layout, raw.directory, dataset.directory)  # other runs' cleanup leaves them alone
    if not config.promote.skip_unchanged:  # else `nothing_new` sent it before Ray started
        announce_data(config, layout, dataset.directory, verified=True)
    model_trust.try_on_dataset(config, dataset)  # an s3:// folder's shape is known only now: the model runs on it
    artifacts.publish_dataset_report(dataset, workload)
    spec = stage(transform, dataset=dataset, cfg=config.transform, layout=layout)
    trained = stage(
        train_with_retries(config.train), spec=spec, cfg=config.train, layout=layout, model=config.model, workload=workload,
    )
    artifacts.publish_training_report(trained, workload)
    # Evaluation publishes its reports (confusion matrix, predictions, metrics) and the gate's verdict;
    # promotion records the run, makes a better model the champion, and fails a run below the gate.
    evaluation = stage(evaluate, trained=trained, spec=spec, cfg=config.evaluate, layout=layout, workload=workload)
    promote_and_announce(stage, config, layout, evaluation, trained, spec, config.model_dump(mode="json"), raw.directory)
    stage(cleanup, cfg=config.cleanup, raw=raw, dataset=dataset, trained=trained, evaluation=evaluation, layout=layout)


def promote_and_announce(
    stage: StageRecorder, config: PipelineConfig, layout: StorageLayout, evaluation, trained, spec, run_config: dict,
    raw_dir: str | None,
) -> PromotionOutcome:
    """The promote stage and its events, for every flow that promotes (this one, and `flows.tune`'s
    ``tune.train_best``): ``pipeline.gate.failed`` before the stage fails a run below the gate, and
    ``pipeline.model.promoted`` after a new champion, which ``score/on-promotion`` scores.
    ``run_config``: what the model card records (the search's: the winner's recipe)."""
    if not evaluation.passed_gate:
        announce(config, events.GATE_FAILED, run=layout.run_name, test_accuracy=evaluation.accuracy, min_accuracy=evaluation.min_accuracy)
    outcome = stage(
        promote, evaluation=evaluation, trained=trained, spec=spec, cfg=config.promote, evaluate_cfg=config.evaluate,
        layout=layout, run_config=run_config, raw_dir=raw_dir, workload=config.workload,
    )
    if outcome.promotion is not None and outcome.promotion.promoted:
        announce_promotion(config, layout, outcome.promotion, evaluation.accuracy)
    return outcome


def nothing_new(config: PipelineConfig, layout: StorageLayout, module: str) -> RunSummary | None:
    """With ``promote.skip_unchanged``, before Ray starts: the summary of a run whose data, model and recipe
    are its champion's (`training.unchanged`), which then ends as "nothing new to train on"; else None.

    The data is listed and fingerprinted as the download and conversion stages would (an unchanged image
    folder's checksums come from its listing cache); the dataset of that fingerprint must still verify.
    """
    if not (config.promote.enabled and config.promote.skip_unchanged):
        return None
    raw = download.fn(config.download, layout)
    fingerprint = dataset_fingerprint(raw, config.parquet, config.transform.image_size)
    dataset_dir = layout.dataset_dir(fingerprint, config.workload)
    verified = exists(dataset_dir) and manifest_problem(dataset_dir, fingerprint) is None
    verdict = announce_data(config, layout, dataset_dir, verified)
    if not verdict.unchanged:
        console.say(f"promote.skip_unchanged: training, {verdict.reason}")
        return None
    get_run_logger().info("Nothing new to train on: %s. Set promote.skip_unchanged=false to train anyway.", verdict.reason)
    announce(config, events.NOTHING_NEW, run=layout.run_name, **verdict.payload())
    return ended_before_training(
        config, layout, module, verdict.reason, raw.source, raw_dir=raw.directory, download_skipped=raw.skipped,
        dataset_dir=dataset_dir, conversion_skipped=True,
    )


def announce_data(config: PipelineConfig, layout: StorageLayout, dataset_dir: str, verified: bool) -> unchanged.Verdict:
    """The data's verdict against the champion's (`training.unchanged`), sent as the data-checked event."""
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


class _CheckedTrainSettings(TrainSettings):
    """Run the training pipeline for any workload (a Prefect flow on Ray) once and print its summary."""

    def pipeline_config(self) -> PipelineConfig:
        """The flow's parameter, after `check_registry_fits`: the CLI refuses a mismatch before Ray starts (exit 2)."""
        config = super().pipeline_config()
        check_registry_fits(config)
        return config


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: parse settings, run the flow against a Prefect API, print a short summary."""
    return run_cli(argv, _CheckedTrainSettings, train_pipeline, "Training pipeline", "flows.train")


if __name__ == "__main__":
    exit_now(main())
