"""Stage 4 of the tune flow: hyperparameter search with Ray Tune over the training loop.

Every trial is a Ray Train run (`training.tuning`); which layer owns which failure:

* Ray Train owns a trial's lost worker: it restarts that trial's worker group from the trial's
  latest checkpoint (``train.max_failures``).
* Tune owns a failed trial: it restarts it ``tune.max_failures`` times.
* Prefect owns infrastructure failures Tune could not absorb (a trial that errored on a lost
  worker or node, or the search itself lost): the stage is retried ``train.stage_retries`` times
  and the retry restores the search from the run folder, keeping finished trials. A trial that
  errored in the training code fails the stage only when no trial finished.
* The flow owns a lost driver: ``python -m flows.tune --run-name <same name>`` restores the
  search the same way.
"""

from __future__ import annotations

import ray
from prefect import task

from dataset.sources.interface import best_config_data
from dataset.tensors.spec import TransformSpec
from pipeline_config import DEFAULT_WORKLOAD, DownloadConfig, ModelConfig, TrainConfig, TransformConfig, TuneConfig
from reporting.artifacts import publish_tuning_report
from reporting.logs import stage_logger
from storage_io import StorageLayout, atomic_write_bytes, join, storage_writes
from training.failures import is_infrastructure_failure
from training.model import weights
from training.model.catalog import ModelSpec
from training.trial_configs import best_config_values, plan_trials
from training.tuning import (
    BEST_CONFIG_FILE,
    TrialContext,
    TrialRecord,
    TuningResult,
    best_config_yaml,
    best_trial,
    experiment_dir,
    trial_records,
    trials_dir,
    tuner,
)


class TrialsFailed(RuntimeError):
    """Trials of the search errored: every one of them, or some on lost infrastructure (worth a retry)."""


@task(name="tune")
def tune_search(
    spec: TransformSpec, train_cfg: TrainConfig, tune_cfg: TuneConfig, layout: StorageLayout, model: ModelConfig | None = None,
    workload: str = DEFAULT_WORKLOAD, download: DownloadConfig | None = None,
) -> TuningResult:
    """Run (or restore) the search in the run folder; write the best config; publish the trial table and curves.

    Every trial trains ``model.name`` (default ResNet-18), built for the dataset's channels and classes;
    ``workload`` names the reports' artifact keys and goes into the best config.
    """
    logger = stage_logger(__name__)
    resources = ray.cluster_resources()
    plan = plan_trials(train_cfg, tune_cfg, resources.get("CPU", 0), resources.get("GPU", 0))
    model = model or ModelConfig()
    network = ModelSpec.for_data(model.name, spec.dataset)
    start, said = weights.for_training(model.weights, layout.root, network)  # every trial's fresh start; WeightsError
    if start:
        logger.info("%s", said)
    context = TrialContext(
        spec=spec, train=train_cfg, model=network, weights=start.model_dump() if start else None, epochs=tune_cfg.epochs,
        trials_dir=trials_dir(layout.run_dir), plan=plan,
    )
    search, restored = tuner(context, tune_cfg, layout.run_dir)
    logger.info(
        "%s %d trial(s) of up to %d epoch(s), %d at a time, each %d worker(s) x %.3g CPUs; %s decides by %s (%s)",
        "Restoring the search of" if restored else "Searching", tune_cfg.num_samples, tune_cfg.epochs, plan.concurrent,
        train_cfg.num_workers, plan.cpus_per_worker, tune_cfg.scheduler.upper(), tune_cfg.metric, tune_cfg.direction,
    )
    grid = search.fit()
    trials = trial_records(grid, tune_cfg, context.trials_dir)
    best = _best_or_raise(grid, trials, tune_cfg)
    other = workload if workload != DEFAULT_WORKLOAD else None  # MNIST's file stays as it was
    transform = TransformConfig.model_validate(spec.config.model_dump())
    # A search on a user's folder: the best config names the folder, so the winner trains on the same images.
    data = best_config_data(download) if download is not None else None
    values = best_config_values(train_cfg, transform, best.config, network.name, other, data)
    if model.weights:  # the winner trains again from the weights its trials started from
        values["model"] = {**values.get("model", {}), "weights": model.weights}
    path = join(layout.run_dir, BEST_CONFIG_FILE)
    module = "flows.train" if other else "flows.mnist"
    with storage_writes("tune", path):
        atomic_write_bytes(path, best_config_yaml(values, best, tune_cfg.metric, layout.run_name, module).encode())
    result = TuningResult(
        run_dir=layout.run_dir, experiment_dir=experiment_dir(layout.run_dir), metric=tune_cfg.metric, mode=tune_cfg.direction,
        trials=trials, best=best, best_config=values, best_config_path=path, restored=restored, plan=plan,
    )
    for record in trials:
        logger.info("trial %s: %s after %d epoch(s), best %s %s", record.trial_id, record.status, record.epochs_run,
                    tune_cfg.metric, "-" if record.best_metric is None else f"{record.best_metric:.4f}")
    logger.info("Best trial %s (%s %.4f); its config: %s", best.trial_id, tune_cfg.metric, best.best_metric, path)
    publish_tuning_report([record.model_dump() for record in trials], tune_cfg.metric, best.trial_id, path, workload)
    return result


def _best_or_raise(grid, trials: list[TrialRecord], tune_cfg: TuneConfig) -> TrialRecord:
    """The search's best trial; TrialsFailed when a trial lost its infrastructure (a retry of the stage
    restores the search) or when no trial finished (every one errored, or none reported the metric)."""
    errors = [result.error for result in grid if result.error is not None]
    lost = [error for error in errors if is_infrastructure_failure(error)]
    if lost:
        raise TrialsFailed(f"{len(lost)} trial(s) lost their infrastructure; a retry restores the search: {lost[0]}") from lost[0]
    best = best_trial(trials, tune_cfg)
    if best is None or len(errors) == len(trials):
        first = errors[0] if errors else None
        raise TrialsFailed(f"no trial of {len(trials)} finished: {first or 'none reported a metric'}") from first
    return best
