"""The training pipeline for any workload as one Prefect flow whose stages run on Ray.

    python -m flows.train --workload flowers --model.name mobilenet_v3_small ...   # any workload
    python -m flows.train --preset smoke      # a minutes-long check (MNIST's bundled sample)
    python -m flows.train --help              # every field, also settable as PIPELINE_<SECTION>__<FIELD>

``workload`` names the run (``<workload>-<time>-<id>``), its artifact keys and the registry's
model (``<workload>-<model>``); its default is MNIST, whose own entry point ``flows.mnist`` is
this flow under MNIST's names (flow ``mnist-resnet18``; it also reads the deprecated ``MNIST_*`` variables). An
image folder (``download.source=folder``) without a workload of its own is named after the folder.

With ``promote.skip_unchanged`` (the ``nightly`` preset), a run whose data, model and recipe are its
champion's ends before Ray starts, as "nothing new to train on" (`nothing_new`). Every run sends
the domain events of `reporting.events` (data checked, gate failed, promoted): its stages send
them (`flows.stages`), so every flow that runs those stages sends the same ones.

Before any work (`check_registry_fits`): a champion of the run's registry name trained on other
images or classes than this run's data is refused, naming ``--workload`` and ``promote.model_name``.

Stages hand each other manifests (paths, row counts, checksums), never in-memory data, so any
stage can run on any Ray node, be retried, or be skipped when its output is already on storage.
"""

from __future__ import annotations

from prefect import flow, get_run_logger, runtime

from dataset.formats.parquet import manifest_problem
from flows.preflight import check_cluster_fits, check_registry_fits
from flows.stages import (
    CLEANUP,
    DOWNLOAD,
    EVALUATE,
    PROMOTE,
    TO_PARQUET,
    TRAIN,
    TRANSFORM,
    announce,
    announce_data,
    data_stages,
)
from pipeline_config import PipelineConfig
from pipeline_config.settings import TrainSettings
from reporting import events
from runner import console, hooks
from runner.harness import exit_now, run_cli
from runner.pipeline_run import PipelineRun, ended_before_training, flow_run_name
from runner.summary import RunSummary
from storage_io import StorageLayout, exists
from tasks.download import download
from tasks.to_parquet import dataset_fingerprint

# The flow's stages in order; each declares the CPUs it holds and what it publishes (`flows.stages`).
STAGES = [DOWNLOAD, TO_PARQUET, TRANSFORM, TRAIN, EVALUATE, PROMOTE, CLEANUP]
STAGE_CPUS = {stage.name: stage.cpus for stage in STAGES}  # by name, as the UI lists the task runs
# The command that resumes a run, by the flow's name: `flows.mnist` runs this flow as ``mnist-resnet18``.
RESUME_MODULES = {"train": "flows.train", "mnist-resnet18": "flows.mnist"}


@flow(name="train", flow_run_name=flow_run_name, log_prints=True, on_failure=[hooks.report_failure])
def train_pipeline(config: PipelineConfig = PipelineConfig()) -> RunSummary:
    """Any workload: download, convert to Parquet, transform with Ray Data, train model.name with Ray Train, evaluate, promote, clean up."""
    with PipelineRun(config, resume_module(), STAGES, check_cluster_fits) as run:
        unchanged = nothing_new(run.resolved, run.layout, run.module)  # promote.skip_unchanged: before Ray starts
        if unchanged is not None:
            return run.ended(unchanged)
        raw, dataset, spec = data_stages(run, config)
        trained = run(TRAIN, spec=spec, cfg=config.train, layout=run.layout, model=config.model, workload=config.workload)
        evaluation = run(
            EVALUATE, trained=trained, spec=spec, cfg=config.evaluate, layout=run.layout, workload=config.workload,
            registry_name=config.registry_name,
        )
        run(
            PROMOTE, evaluation=evaluation, trained=trained, spec=spec, cfg=config.promote, evaluate_cfg=config.evaluate,
            layout=run.layout, run_config=config.model_dump(mode="json"), raw_dir=raw.directory, workload=config.workload,
        )
        run(CLEANUP, cfg=config.cleanup, raw=raw, dataset=dataset, trained=trained, evaluation=evaluation, layout=run.layout)
    return run.result


def resume_module() -> str:
    """The CLI module that resumes this flow run (`RESUME_MODULES`, by the running flow's name)."""
    return RESUME_MODULES.get(runtime.flow_run.flow_name, "flows.train")


def nothing_new(config: PipelineConfig, layout: StorageLayout, module: str) -> RunSummary | None:
    """With ``promote.skip_unchanged``, before Ray starts: the summary of a run whose data, model and recipe
    are its champion's (`training.champion.unchanged`), which then ends as "nothing new to train on"; else None.

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
