"""Ray Tune over the training loop: every trial is a Ray Train V2 run of `train_loop_per_worker`.

Ray 2.60's way (Train V2): the trainable Tune runs is a function, `run_trial`, that builds the
trainer (`training.trainer.torch_trainer`) for the trial's sampled recipe and calls ``fit()``; the trainer's
`TrialReport` callback (``ray.tune.integration.ray_train.TuneReportCallback``) hands every
epoch's metrics to Tune, whose ASHA scheduler stops trials that fall behind.

Where things live, under the run folder ``<root>/runs/<run>/``:

* ``tune/``: Tune's experiment (its state, one folder per trial with ``params.json`` and
  ``result.json``), so the same run name restores the search (`tuner`) without rerunning
  finished trials;
* ``trials/<trial_id>/``: that trial's Ray Train run (checkpoints, ``history.jsonl``). A
  trial restarted after a lost driver builds its trainer for the same folder and so resumes
  from its latest checkpoint.

Resources (`plan_trials`): ``train.data_cpus`` stay free for Ray Data as in the main flow; the
rest is split between the trials running at once, each worker of each trial an equal share.
The trial's own function holds `TRIAL_DRIVER_CPUS` (it only waits on Ray Train).
"""

from __future__ import annotations

from typing import Any

import yaml
from pydantic import BaseModel
from ray import tune
from ray.tune.integration.ray_train import TuneReportCallback
from ray.tune.schedulers import ASHAScheduler, FIFOScheduler
from ray.tune.search.basic_variant import BasicVariantGenerator

from dataset.tensors.spec import TransformSpec
from pipeline_config import TrainConfig, TuneConfig
from storage_io import basename, filesystem, is_remote, join, redact_error
from training.checkpoint.records import HISTORY_FILE, read_history
from training.model.catalog import ModelSpec
from training.trainer import torch_trainer
from training.trial_configs import TRIAL_DRIVER_CPUS, TrialPlan, param_space, trial_spec, trial_train_config

TUNE_DIR = "tune"  # Tune's experiment folder in the run folder
TRIALS_DIR = "trials"  # one Ray Train run per trial: <run>/trials/<trial_id>
TIME_ATTR = "epochs_done"  # what ASHA counts: finished epochs (epoch + 1), the same after a restore


class TrialReport(TuneReportCallback):
    """Hands every finished epoch's metrics (rank 0's) to Tune, with ``epochs_done`` for ASHA.

    Mid-epoch checkpoints (``train.checkpoint_every_steps``) are not epochs; they are not passed on.
    """

    def after_report(self, run_context, metrics: list[dict[str, Any]], checkpoint) -> None:
        if not metrics or metrics[0].get("mid_epoch"):
            return
        metrics = [{**metrics[0], TIME_ATTR: int(metrics[0]["epoch"]) + 1}, *metrics[1:]]
        super().after_report(run_context, metrics, checkpoint)


class TrialContext(BaseModel):
    """What every trial needs besides its sampled config (passed with ``tune.with_parameters``)."""

    spec: TransformSpec
    train: TrainConfig
    model: ModelSpec
    weights: dict[str, str] | None = None  # model.weights for every trial's fresh start (training.model.weights.StartWeights)
    epochs: int
    trials_dir: str
    plan: TrialPlan


def run_trial(config: dict[str, Any], context: TrialContext) -> None:
    """Tune's function trainable: one Ray Train run of the sampled recipe in ``trials/<trial_id>``."""
    trial_id = tune.get_context().get_trial_id()
    plan = context.plan
    trainer = torch_trainer(
        trial_spec(context.spec, config),
        trial_train_config(context.train, config, context.epochs),
        context.model,
        join(context.trials_dir, trial_id),
        plan.use_gpu,
        plan.cpus_per_worker,
        plan.torch_threads,
        [TrialReport()], context.weights,
    )
    trainer.fit()  # a failure Ray Train gave up on fails the trial (TrainingFailedError)


def scheduler(tune_cfg: TuneConfig):
    """ASHA over finished epochs (grace period, reduction factor, the budget), or FIFO (no early stops)."""
    if tune_cfg.scheduler == "none":
        return FIFOScheduler()
    return ASHAScheduler(
        time_attr=TIME_ATTR,
        max_t=tune_cfg.epochs,
        grace_period=tune_cfg.grace_period,
        reduction_factor=tune_cfg.reduction_factor,
    )


def trial_name(trial) -> str:
    """A trial's name and folder: its id (``<experiment>_<index>``), which also names its Ray Train run."""
    return trial.trial_id


def tuner(context: TrialContext, tune_cfg: TuneConfig, run_dir: str) -> tuple[tune.Tuner, bool]:
    """The Tuner of the run in ``run_dir``, restored when the run already has a Tune experiment.

    Returns (tuner, restored). A restored search keeps its finished trials and their results;
    trials that were running (the driver was lost) or errored start again, and their Ray Train
    runs resume from their latest checkpoints.
    """
    trainable = tune.with_resources(tune.with_parameters(run_trial, context=context), {"cpu": TRIAL_DRIVER_CPUS})
    experiment = join(run_dir, TUNE_DIR)
    storage_fs, storage_path = filesystem(run_dir)
    fs = storage_fs if is_remote(run_dir) else None
    if tune.Tuner.can_restore(experiment, storage_filesystem=fs):
        restored = tune.Tuner.restore(
            experiment, trainable, resume_unfinished=True, resume_errored=False, restart_errored=True, storage_filesystem=fs
        )
        return restored, True
    fresh = tune.Tuner(
        trainable,
        param_space=param_space(tune_cfg),
        tune_config=tune.TuneConfig(
            metric=tune_cfg.metric,
            mode=tune_cfg.direction,
            scheduler=scheduler(tune_cfg),
            # Tune ignores max_concurrent_trials beside a BasicVariantGenerator: the limit goes here.
            search_alg=BasicVariantGenerator(random_state=tune_cfg.seed, max_concurrent=context.plan.concurrent),
            num_samples=tune_cfg.num_samples,
            trial_name_creator=trial_name,
            trial_dirname_creator=trial_name,
        ),
        run_config=tune.RunConfig(
            name=TUNE_DIR,
            storage_path=storage_path,
            storage_filesystem=fs,
            failure_config=tune.FailureConfig(max_failures=tune_cfg.max_failures),
            verbose=0,  # the stage says one line per trial; Tune's tables go to the stage log
        ),
    )
    return fresh, False


class TrialRecord(BaseModel):
    """One trial of a finished search: what it sampled and how it went."""

    trial_id: str
    config: dict[str, Any]
    status: str  # completed, stopped early (by the scheduler) or errored
    epochs_run: int
    best_metric: float | None
    last_metric: float | None
    history: list[dict[str, float]]  # per epoch: epoch, val_ce, val_loss, val_accuracy
    run_dir: str
    error: str | None = None


def trial_records(grid, tune_cfg: TuneConfig, trials_dir: str) -> list[TrialRecord]:
    """Every trial of a Tune ``ResultGrid``, its per-epoch history read from its Ray Train run folder."""
    better = min if tune_cfg.direction == "min" else max
    records = []
    for result in grid:
        trial_id = basename(result.path)  # trial folders are named by trial id (`trial_name`)
        run_dir = join(trials_dir, trial_id)
        history = [
            {key: float(row[key]) for key in ("epoch", "val_ce", "val_loss", "val_accuracy") if key in row}
            for row in read_history(join(run_dir, HISTORY_FILE))
        ]
        if not history and result.metrics_dataframe is not None and tune_cfg.metric in result.metrics_dataframe:
            frame = result.metrics_dataframe
            history = [{"epoch": float(row["epoch"]), tune_cfg.metric: float(row[tune_cfg.metric])} for _, row in frame.iterrows()]
        values = [row[tune_cfg.metric] for row in history if tune_cfg.metric in row]
        epochs_run = len(history)
        if result.error is not None:
            status = "errored"
        elif epochs_run < tune_cfg.epochs:
            status = "stopped early"
        else:
            status = "completed"
        records.append(
            TrialRecord(
                trial_id=trial_id,
                config={key: result.config[key] for key in sorted(result.config)},
                status=status,
                epochs_run=epochs_run,
                best_metric=better(values) if values else None,
                last_metric=values[-1] if values else None,
                history=history,
                run_dir=run_dir,
                error=f"{type(result.error).__name__}: {redact_error(result.error)}"[:500] if result.error is not None else None,
            )
        )
    return sorted(records, key=lambda record: record.trial_id)


def best_trial(records: list[TrialRecord], tune_cfg: TuneConfig) -> TrialRecord | None:
    """The trial whose best epoch scored best on ``tune.metric`` (None when no trial reported one)."""
    scored = [record for record in records if record.best_metric is not None]
    if not scored:
        return None
    sign = 1 if tune_cfg.direction == "min" else -1
    return min(scored, key=lambda record: (sign * record.best_metric, record.trial_id))


def experiment_dir(run_dir: str) -> str:
    """Tune's experiment folder of the run in ``run_dir``."""
    return join(run_dir, TUNE_DIR)


def trials_dir(run_dir: str) -> str:
    """Where the trials' Ray Train runs live in the run in ``run_dir``."""
    return join(run_dir, TRIALS_DIR)


BEST_CONFIG_FILE = "best_config.yaml"  # in the run folder


class TuningResult(BaseModel):
    """The tune stage's manifest: every trial, the best one and where its config file is."""

    run_dir: str
    experiment_dir: str
    metric: str
    mode: str
    trials: list[TrialRecord]
    best: TrialRecord
    best_config: dict[str, Any]  # the fields the best trial sets (train.*, transform.*)
    best_config_path: str
    restored: bool
    plan: TrialPlan

    def stopped_early(self) -> int:
        return sum(trial.status == "stopped early" for trial in self.trials)

    def terminal_detail(self) -> str:
        """What the tune stage's closing terminal line adds after its name and seconds."""
        restored = " (search restored)" if self.restored else ""
        return (f": best trial {self.best.trial_id}, {self.metric} {self.best.best_metric:.4f} ({len(self.trials)} trials, "
                f"{self.stopped_early()} stopped early){restored}")

    def summary(self) -> dict[str, Any]:
        """What summary.json says about the search."""
        return {
            "metric": self.metric,
            "mode": self.mode,
            "trials": len(self.trials),
            "stopped_early": self.stopped_early(),
            "errored": sum(trial.status == "errored" for trial in self.trials),
            "restored": self.restored,
            "concurrent_trials": self.plan.concurrent,
            "experiment_dir": self.experiment_dir,
            "best_trial": {
                "trial_id": self.best.trial_id,
                self.metric: self.best.best_metric,
                "epochs_run": self.best.epochs_run,
                "sampled": self.best.config,
                "config": self.best_config,
                "config_file": self.best_config_path,
                "run_dir": self.best.run_dir,
            },
        }


def best_config_yaml(values: dict[str, Any], best: TrialRecord, metric: str, run_name: str, module: str = "flows.mnist") -> str:
    """The best trial's fields as YAML for ``python -m <module> --config-file``, with where they came from."""
    header = (
        f"# Best trial {best.trial_id} of tune run {run_name}: {metric} {best.best_metric:.4f} after "
        f"{best.epochs_run} epoch(s).\n"
        f"# Train it: python -m {module} --config-file <this file>  (presets, env vars and flags layer as usual)\n"
    )
    if "download" in values:  # an image folder: the file names it, so the winner trains on the same images
        header += "# on the data the search ran on (download.*)\n"
    elif "workload" in values:  # another workload's data is not the default: say so
        header += "# with the data options (download.*) the search ran with\n"
    return header + yaml.safe_dump(values, sort_keys=True)
