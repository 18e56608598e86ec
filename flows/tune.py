"""Hyperparameter search for any workload's recipe with Ray Tune, as one Prefect flow on the same stages.

    python -m flows.tune --preset smoke                # a few-minutes search on the bundled sample
    python -m flows.tune --tune.num-samples 16 --tune.train-best
    python -m flows.tune --workload flowers --model.name mobilenet_v3_small ...   # another workload
    python -m flows.tune --help                        # every field, also settable as MNIST_<SECTION>__<FIELD>

Download, conversion and transform are the main flow's stages, unchanged (outputs verified on
storage are reused). The tune stage runs the trials, each a Ray Train run of the real training
loop, and writes the best trial's recipe as ``best_config.yaml`` in the run folder, which
``python -m flows.mnist --config-file`` trains (``flows.train`` for another workload: the file names it). With ``tune.train_best`` the same flow run then
trains that recipe with ``train.epochs`` and evaluates it through the normal stages, gate included,
and promotes it as the training flow does, with the same events (`flows.train.promote_and_announce`).
"""

from __future__ import annotations

from prefect import flow

from flows.train import STAGE_CPUS, promote_and_announce, train_with_retries
from pipeline_config import TunePipelineConfig
from pipeline_config.settings import TuneSettings
from reporting import artifacts
from runner import hooks
from runner.harness import exit_now, flow_run_name, run_cli, run_flow
from runner.stages import StageRecorder
from runner.summary import RunSummary
from storage_io import StorageLayout, lease_uses
from tasks.cleanup import cleanup
from tasks.download import download
from tasks.evaluate import evaluate
from tasks.to_parquet import to_parquet
from tasks.train import retry_infrastructure_failures
from tasks.transform import transform
from tasks.tune import tune_search
from training.tuning import plan_trials, trial_spec, trial_train_config

# The stages and the logical CPUs each holds (see flows.train.STAGE_CPUS); the tune stage only
# coordinates trials whose workers reserve their own CPUs.
TUNE_STAGE_CPUS = {"download": 1, "to-parquet": 1, "transform": 0, "tune": 0}
TRAIN_BEST_STAGE_CPUS = {name: STAGE_CPUS[name] for name in ("train", "evaluate", "promote", "cleanup")}


def stage_plan(config: TunePipelineConfig) -> dict[str, float]:
    """The flow's stages: the search, then, with ``tune.train_best``, training, evaluation, promotion and cleanup."""
    return TUNE_STAGE_CPUS | (TRAIN_BEST_STAGE_CPUS if config.tune.train_best else {})


def tune_with_retries(config: TunePipelineConfig):
    """The tune stage with Prefect retries for infrastructure failures (a retry restores the search)."""
    return tune_search.with_options(
        retries=config.train.stage_retries,
        retry_delay_seconds=config.train.stage_retry_delay_s,
        retry_condition_fn=retry_infrastructure_failures,
    )


# The flow keeps MNIST's name (its deployment is mnist-resnet18-tune/manual); it searches any
# workload and model.name: the run, its artifact keys and its registry model follow `workload`.
@flow(name="mnist-resnet18-tune", flow_run_name=flow_run_name, log_prints=True, on_failure=[hooks.report_failure])
def mnist_tune(config: TunePipelineConfig = TunePipelineConfig()) -> RunSummary:
    """Download the data, convert to Parquet, transform with Ray Data, search the recipe with Ray Tune (each trial a Ray Train run)."""
    return run_flow(config, "flows.tune", check_trials_fit, stage_plan(config), run_stages)


def run_stages(stage: StageRecorder, layout: StorageLayout, config: TunePipelineConfig) -> None:
    """The stage list: the data stages, the search, and with ``tune.train_best`` the winner trained and evaluated."""
    workload = config.workload
    raw = stage(download, cfg=config.download, layout=layout)
    dataset = stage(
        to_parquet, raw=raw, cfg=config.parquet, layout=layout, image_size=config.transform.image_size, workload=config.workload,
        max_image_pixels=config.download.max_image_pixels,
    )
    lease_uses(layout, raw.directory, dataset.directory)
    artifacts.publish_dataset_report(dataset, workload)
    spec = stage(transform, dataset=dataset, cfg=config.transform, layout=layout)
    tuned = stage(
        tune_with_retries(config), spec=spec, train_cfg=config.train, tune_cfg=config.tune, layout=layout, model=config.model,
        workload=workload, download=config.download,
    )
    if config.tune.train_best:
        best_train = trial_train_config(config.train, tuned.best.config)
        best_spec = trial_spec(spec, tuned.best.config)
        trained = stage(
            train_with_retries(best_train), spec=best_spec, cfg=best_train, layout=layout, model=config.model, workload=workload,
        )
        artifacts.publish_training_report(trained, workload)
        recipe = config.model_dump(mode="json") | {"train": best_train.model_dump(mode="json")}  # what the model card names
        evaluation = stage(evaluate, trained=trained, spec=best_spec, cfg=config.evaluate, layout=layout, workload=workload)
        # The training flow's promotion with its events: a new champion sends pipeline.model.promoted, which
        # score/on-promotion scores, whichever flow made it.
        promote_and_announce(stage, config, layout, evaluation, trained, best_spec, recipe, raw.directory)
        stage(cleanup, cfg=config.cleanup, raw=raw, dataset=dataset, trained=trained, evaluation=evaluation, layout=layout)


def check_trials_fit(config: TunePipelineConfig) -> None:
    """Refuse a search the cluster cannot hold (ValueError naming the field) before any work starts."""
    import ray

    resources = ray.cluster_resources()
    plan_trials(config.train, config.tune, resources.get("CPU", 0), resources.get("GPU", 0))


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: the search (and with ``--tune.train-best`` the best recipe trained), then a short summary."""
    return run_cli(argv, TuneSettings, mnist_tune, "{workload} tune", "flows.tune")


if __name__ == "__main__":
    exit_now(main())
