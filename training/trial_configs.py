"""What each trial of a search trains with: how the cluster is split between trials, the space Ray Tune samples, and a trial's (or the winner's) training config, transform and download values."""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel
from ray import tune

from dataset.tensors.spec import TransformSpec
from pipeline_config import TrainConfig, TransformConfig, TuneConfig
from training.resources import GPU_WORKER_CPUS, DoesNotFit, plan_cluster

# Logical CPUs a trial's function holds: Tune places it with a resource request that may not be
# empty, and it only waits on the trainer, whose workers reserve their own CPUs.
TRIAL_DRIVER_CPUS = 0.01


class TrialPlan(BaseModel):
    """How the cluster is split between trials: concurrency and each worker's share."""

    concurrent: int
    use_gpu: bool
    cpus_per_worker: float
    torch_threads: int


def plan_trials(train: TrainConfig, tune_cfg: TuneConfig, cluster_cpus: float, cluster_gpus: float) -> TrialPlan:
    """Trials at once and each worker's CPUs, from the cluster; `DoesNotFit` naming the field when it does not fit.

    ``train.data_cpus`` are kept for Ray Data. Of the rest, every training worker of every running
    trial gets an equal share (a GPU worker at most `GPU_WORKER_CPUS`); with ``tune.max_concurrent_trials: 0``
    as many trials run as give each worker one whole CPU (and a GPU, on GPUs). On 2 CPUs with one worker
    per trial: one trial at a time, its worker on 0.99 CPU and Ray Data on the other, the main flow's split."""
    usable = cluster_cpus - train.data_cpus  # for the trials: their drivers and workers
    # Trials that give each worker a whole CPU; at least one, its workers sharing what there is.
    fits = max(1, math.floor(usable / (train.num_workers + TRIAL_DRIVER_CPUS))) if usable > 2 * TRIAL_DRIVER_CPUS else 0
    use_gpu = plan_cluster(train, cluster_cpus, cluster_gpus).use_gpu  # DoesNotFit: FSDP on CPUs; on GPUs, trials they hold:
    concurrent = tune_cfg.max_concurrent_trials or (min(fits, max(1, int(cluster_gpus) // train.num_workers)) if use_gpu else fits)
    if concurrent > fits:
        raise DoesNotFit(
            f"tune.max_concurrent_trials={concurrent}: the cluster's {cluster_cpus:g} CPUs hold {fits} trial(s) of "
            f"train.num_workers={train.num_workers} beside train.data_cpus={train.data_cpus:g}; lower it or set 0 (auto)"
        )
    if fits == 0:
        raise DoesNotFit(
            f"the cluster has {cluster_cpus:g} CPUs: too few for a trial of train.num_workers={train.num_workers} "
            f"plus train.data_cpus={train.data_cpus:g}; lower either"
        )
    if use_gpu and cluster_gpus < concurrent * train.num_workers:
        raise DoesNotFit(
            f"{concurrent} trial(s) of train.num_workers={train.num_workers} need {concurrent * train.num_workers} GPUs; "
            f"the cluster has {cluster_gpus:g}; lower tune.max_concurrent_trials or train.num_workers, or set train.use_gpu=never"
        )
    workers, most = concurrent * train.num_workers, GPU_WORKER_CPUS if use_gpu else math.inf  # a GPU worker: a few CPUs
    cpus = min(most, math.floor((usable - concurrent * TRIAL_DRIVER_CPUS) / workers * 1000) / 1000)  # rounded down
    threads = min(most, max(1, math.floor(cluster_cpus / workers)))
    return TrialPlan(concurrent=concurrent, use_gpu=use_gpu, cpus_per_worker=cpus, torch_threads=threads)


def param_space(tune_cfg: TuneConfig) -> dict[str, Any]:
    """Tune's search space for the knobs of ``tune.search_space`` (a fixed knob is a constant)."""
    space = tune_cfg.search_space

    def ranged(name: str, log: bool) -> Any:
        knob = getattr(space, name)
        if knob.low == knob.high:
            return knob.low
        return tune.loguniform(knob.low, knob.high) if log else tune.uniform(knob.low, knob.high)

    sizes = sorted(set(space.global_batch_size))
    return {
        "learning_rate": ranged("learning_rate", log=True),
        "weight_decay": ranged("weight_decay", log=True),
        "global_batch_size": sizes[0] if len(sizes) == 1 else tune.choice(sizes),
        "augmentation": ranged("augmentation", log=False),
        "label_smoothing": ranged("label_smoothing", log=False),
    }


def scaled_augmentation(cfg: TransformConfig, strength: float) -> TransformConfig:
    """``cfg`` with shift, rotation and zoom multiplied by ``strength``, each capped at its field's limit."""
    return cfg.model_copy(
        update={
            "shift_px": min(8, round(cfg.shift_px * strength)),
            "rotate_deg": round(min(45.0, cfg.rotate_deg * strength), 3),
            "scale": round(min(0.5, cfg.scale * strength), 4),
        }
    )


def trial_train_config(train: TrainConfig, sampled: dict[str, Any], epochs: int | None = None) -> TrainConfig:
    """The training config a sampled trial runs: ``train`` with the sampled knobs.

    ``epochs``: the trial's budget (``tune.epochs``), which ``train.max_images`` does not cap;
    None keeps ``train``'s epochs (training the best config through the normal stage).
    Mid-epoch checkpoints stay off in trials: Tune compares epochs.
    """
    update: dict[str, Any] = {
        "learning_rate": float(sampled["learning_rate"]),
        "weight_decay": float(sampled["weight_decay"]),
        "global_batch_size": int(sampled["global_batch_size"]),
        "label_smoothing": float(sampled["label_smoothing"]),
    }
    if epochs is not None:
        update |= {"epochs": epochs, "max_images": 0, "checkpoint_every_steps": 0}
    return TrainConfig.model_validate(train.model_dump() | update)


def trial_spec(spec: TransformSpec, sampled: dict[str, Any]) -> TransformSpec:
    """The transform spec with the trial's augmentation strength applied."""
    return spec.model_copy(update={"config": scaled_augmentation(spec.config, float(sampled["augmentation"]))})


def best_config_values(
    train: TrainConfig, transform: TransformConfig, sampled: dict[str, Any], model_name: str | None = None,
    workload: str | None = None, download: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The fields a best trial sets, as a config file for ``python -m flows.train --config-file``
    (with ``model.name`` when given: the model the trials trained; with ``workload`` when given; with
    ``download``, the data the search ran on, when given: an image folder's source and path).
    ``transform.image_size``, when the search set one other than ``auto``, comes along too."""
    chosen = trial_train_config(train, sampled)
    augmented = scaled_augmentation(transform, float(sampled["augmentation"]))
    transform_values = {name: getattr(augmented, name) for name in ("shift_px", "rotate_deg", "scale")}
    if transform.image_size != "auto":  # the default decides the same on the same data; a size or None (kept) comes along
        transform_values["image_size"] = transform.image_size
    return {
        **({"workload": workload} if workload else {}),
        **({"download": download} if download else {}),
        **({"model": {"name": model_name}} if model_name else {}),
        "train": {name: getattr(chosen, name) for name in ("learning_rate", "weight_decay", "global_batch_size", "label_smoothing")},
        "transform": transform_values,
    }
