"""Hyperparameter search for any workload's recipe with Ray Tune, as one Prefect flow on the same stages.

    python -m flows.tune --preset smoke                # a few-minutes search on the bundled sample
    python -m flows.tune --tune.num-samples 16 --tune.train-best
    python -m flows.tune --workload flowers --model.name mobilenet_v3_small ...   # another workload
    python -m flows.tune --help                        # every field, also settable as PIPELINE_<SECTION>__<FIELD>

Download, conversion and transform are the main flow's stages, unchanged (outputs verified on
storage are reused). The tune stage runs the trials, each a Ray Train run of the real training
loop, and writes the best trial's recipe as ``best_config.yaml`` in the run folder, which
``python -m flows.mnist --config-file`` trains (``flows.train`` for another workload: the file names it). With ``tune.train_best`` the same flow run then
trains that recipe with ``train.epochs`` and evaluates it through the normal stages, gate included,
and promotes it with the training flow's own stages, so with the same events (`flows.stages`).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

from prefect import Task, flow

from flows.stages import CLEANUP, DOWNLOAD, EVALUATE, PROMOTE, TO_PARQUET, TRAIN, TRANSFORM, data_stages, with_retries
from pipeline_config import TunePipelineConfig
from pipeline_config.settings import TuneSettings
from runner import hooks
from runner.harness import exit_now, run_cli
from runner.pipeline_run import PipelineRun, flow_run_name
from runner.stages import Stage, StageRecorder
from runner.summary import RunSummary
from runner.watchers import TrialWatcher
from storage_io import join
from tasks.tune import tune_search
from training.trial_configs import plan_trials, trial_spec, trial_train_config
from training.tuning import TRIALS_DIR


class Tune(Stage):
    """The search: Prefect retries from the training config (a retry restores the search), one line per trial
    epoch while it runs, and the search's account in summary.json."""

    def prepared(self, run: StageRecorder, parameters: dict[str, Any]) -> Task:
        return with_retries(self.task, parameters["train_cfg"])

    def starting(self, run: StageRecorder, parameters: dict[str, Any]) -> str:
        tune = parameters["tune_cfg"]
        return f" {tune.num_samples} trial(s) of up to {tune.epochs} epoch(s), {tune.scheduler.upper()} by {tune.metric}"

    def watching(self, run: StageRecorder, parameters: dict[str, Any]) -> AbstractContextManager:
        tune = parameters["tune_cfg"]
        return TrialWatcher(join(run.layout.run_dir, TRIALS_DIR), tune.epochs, tune.metric)

    def finished(self, run: StageRecorder, parameters: dict[str, Any], tuned: Any) -> None:
        run.note(tuning=tuned.summary())


TUNE = Tune(tune_search)  # coordinates trials whose workers reserve their own CPUs: holds none
SEARCH_STAGES = [DOWNLOAD, TO_PARQUET, TRANSFORM, TUNE]
TRAIN_BEST_STAGES = [TRAIN, EVALUATE, PROMOTE, CLEANUP]  # the winner trained, evaluated, promoted as flows.train's
TUNE_STAGE_CPUS = {stage.name: stage.cpus for stage in SEARCH_STAGES}  # by name, as the UI lists the task runs


def stage_plan(config: TunePipelineConfig) -> list[Stage]:
    """The flow's stages: the search, then, with ``tune.train_best``, training, evaluation, promotion and cleanup."""
    return SEARCH_STAGES + (TRAIN_BEST_STAGES if config.tune.train_best else [])


# The flow keeps MNIST's name (its deployment is mnist-resnet18-tune/manual); it searches any
# workload and model.name: the run, its artifact keys and its registry model follow `workload`.
@flow(name="mnist-resnet18-tune", flow_run_name=flow_run_name, log_prints=True, on_failure=[hooks.report_failure])
def mnist_tune(config: TunePipelineConfig = TunePipelineConfig()) -> RunSummary:
    """Download the data, convert to Parquet, transform with Ray Data, search the recipe with Ray Tune (each trial a Ray Train run).

    With ``tune.train_best`` the winner is then trained, evaluated and promoted by the training flow's own stages
    (so with its events: a champion the search made sends ``pipeline.model.promoted`` as any other, which
    ``score/on-promotion`` scores)."""
    with PipelineRun(config, "flows.tune", stage_plan(config), check_trials_fit) as run:
        raw, dataset, spec = data_stages(run, config)
        tuned = run(
            TUNE, spec=spec, train_cfg=config.train, tune_cfg=config.tune, layout=run.layout, model=config.model,
            workload=config.workload, download=config.download,
        )
        if config.tune.train_best:
            best_train, best_spec = trial_train_config(config.train, tuned.best.config), trial_spec(spec, tuned.best.config)
            trained = run(TRAIN, spec=best_spec, cfg=best_train, layout=run.layout, model=config.model, workload=config.workload)
            evaluation = run(
                EVALUATE, trained=trained, spec=best_spec, cfg=config.evaluate, layout=run.layout, workload=config.workload,
                registry_name=config.registry_name,
            )
            run(
                PROMOTE, evaluation=evaluation, trained=trained, spec=best_spec, cfg=config.promote, evaluate_cfg=config.evaluate,
                layout=run.layout, run_config=config.model_dump(mode="json") | {"train": best_train.model_dump(mode="json")},  # the winner's recipe
                raw_dir=raw.directory, workload=config.workload,
            )
            run(CLEANUP, cfg=config.cleanup, raw=raw, dataset=dataset, trained=trained, evaluation=evaluation, layout=run.layout)
    return run.result


def check_trials_fit(config: TunePipelineConfig) -> None:
    """Refuse a search the cluster cannot hold (ValueError naming the field) before any work starts."""
    import ray  # Ray: only where the cluster is used

    resources = ray.cluster_resources()
    plan_trials(config.train, config.tune, resources.get("CPU", 0), resources.get("GPU", 0))


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: the search (and with ``--tune.train-best`` the best recipe trained), then a short summary."""
    return run_cli(argv, TuneSettings, mnist_tune, "{workload} tune", "flows.tune")


if __name__ == "__main__":
    exit_now(main())
