"""Ray Train for the training loop: resources, the trainer, its result, which failures to retry.

The training stage (`tasks.train`) and any other flow that trains call these: `plan_resources`
(`training.resources`) splits the cluster between training workers and Ray Data, `torch_trainer` builds the
trainer (torch's process group, the loop) for a run folder (the same run name resumes from its latest
checkpoint), `fit` runs it and returns a `TrainedModel`, `is_infrastructure_failure` says whether a failed run is worth another
attempt. `fit_in_process` is ``train.mode: single``: the same loop without Ray Train. The manifest it
returns and the readers of Ray Train's checkpoint snapshot are `training.manifests` (no torch).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from dataset.tensors.spec import TransformSpec
from pipeline_config import TrainConfig
from storage_io import (
    S3_SCHEME,
    basename,
    filesystem,
    is_remote,
    join,
    parent,
)
from training.checkpoint.records import HISTORY_FILE, read_history
from training.failures import raise_storage_failure
from training.manifests import (
    ATTEMPTS_LOG,
    SCORE_ORDER,
    CheckpointInfo,
    LoopConfig,
    TrainedModel,
    checkpoint_rank,
    read_attempts,
)
from training.model.catalog import ModelSpec
from training.worker.faults import ROW_LOG_ENV

if TYPE_CHECKING:  # annotations only: see `torch_trainer`
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer


def worker_range(cfg: TrainConfig) -> int | tuple[int, int]:
    """ScalingConfig's num_workers: fixed, or the elastic (min, max) range when train.min_workers is set."""
    if cfg.min_workers is None or cfg.min_workers == cfg.num_workers:
        return cfg.num_workers
    return (cfg.min_workers, cfg.num_workers)


def loop_config(
    cfg: TrainConfig, train_rows: int, torch_threads: int, model: ModelSpec, fault_dir: str | None = None,
    spec: TransformSpec | None = None, weights: dict | None = None,
) -> dict:
    """The `training.worker.loop.LoopConfig` every rank runs, as the plain dict Ray Train hands over (``train_loop_config``)."""
    run_dir = parent(fault_dir) if fault_dir else None
    return LoopConfig(  # model.weights (a `training.model.weights.StartWeights`) rides in model: checkpoints record it
        model=model.model_dump() | ({"weights": dict(weights)} if weights else {}),
        epochs=cfg.epochs_for(train_rows),
        global_batch_size=cfg.global_batch_size,
        learning_rate=cfg.learning_rate,
        weight_decay=cfg.weight_decay,
        label_smoothing=cfg.label_smoothing,
        ema_decay=cfg.ema_decay,
        seed=cfg.seed,
        strategy=cfg.strategy,
        train_rows=train_rows,
        torch_threads=torch_threads,
        hang_timeout_s=cfg.hang_timeout_s,
        fault_dir=fault_dir,
        run_dir=run_dir,
        attempts_log=join(run_dir, ATTEMPTS_LOG) if run_dir else None,
        history_path=join(run_dir, HISTORY_FILE) if run_dir else None,
        checkpoint_every_steps=cfg.checkpoint_every_steps,
        preemption_check_steps=cfg.preemption_check_steps,
        preemption_check_s=cfg.preemption_check_s,
        cuda_graph=cfg.cuda_graph,
        resident_data=cfg.resident_data,
        # Each epoch builds its train pipeline from it (a resumed one without the rows already trained on).
        transform=spec.model_dump(mode="json") if spec is not None else None,
        # Test-only: every rank logs the row_ids it trains on (training.worker.faults.ROW_LOG_ENV).
        row_log_dir=join(run_dir, "row_log") if run_dir and os.environ.get(ROW_LOG_ENV) else None,
        precision=cfg.precision,
        use_gpu=cfg.use_gpu,
    ).model_dump()


def summarize_result(
    result, run_dir: str, num_workers: int, cpus: float, model: ModelSpec, score: str = "val_accuracy",
) -> TrainedModel:
    """Turn a ``ray.train.Result`` into the manifest later stages read (checkpoint paths as ``s3://`` URIs on S3)."""
    remote = is_remote(run_dir)
    if result.error:
        raise_storage_failure(result.error, run_dir)
        raise RuntimeError(f"Ray Train run {run_dir} failed: {result.error}") from result.error
    # Mid-epoch checkpoints are only there to resume from; they are never candidates.
    kept = [
        CheckpointInfo(path=S3_SCHEME + ckpt.path if remote else ckpt.path, epoch=int(m["epoch"]), val_accuracy=float(m["val_accuracy"]), val_loss=float(m["val_loss"]))
        for ckpt, m in (result.best_checkpoints or [])
        if not m.get("mid_epoch")
    ]
    if not kept:
        raise RuntimeError(f"Ray Train run {run_dir} finished without a checkpoint")
    best = max(kept, key=lambda c: checkpoint_rank(c, score))
    # Every epoch from rank 0's history.jsonl; Result.metrics_dataframe only has the kept checkpoints.
    history = read_history(join(run_dir, HISTORY_FILE))
    if not history and result.metrics_dataframe is not None:
        history = result.metrics_dataframe.to_dict(orient="records")
    return TrainedModel(
        run_dir=str(run_dir),
        model=model,
        best_checkpoint=best.path,
        best_val_accuracy=best.val_accuracy,
        checkpoints=kept,
        history=[
            {k: v for k, v in row.items() if isinstance(v, (int, float)) and k not in ("mid_epoch", "step")}
            for row in history
            if not (row.get("mid_epoch") == 1)
        ],
        num_workers=num_workers,
        cpus_per_worker=cpus,
        score=score,
    )


# Ray Train's record of the checkpoints it kept, in the run folder (ray.train.v2 constants).


def torch_trainer(
    spec: TransformSpec, cfg: TrainConfig, model: ModelSpec, run_dir: str, use_gpu: bool, cpus: float, threads: int, callbacks: list,
    weights: dict | None = None,
) -> DataParallelTrainer:
    """Ray Train's trainer for torch running the loop (`training.worker.launch.run_loop`) as ``cfg`` says, in the folder ``run_dir``.

    Ray Train's run is named by the folder (``RunConfig(storage_path=<its parent>, name=<its name>)``),
    so a trainer built again for the same folder resumes from its latest checkpoint. Ray Train
    writes checkpoints through a pyarrow filesystem: the local one, or S3 for an ``s3://`` folder.
    ``callbacks``: Ray Train callbacks (they run in the Train controller). ``weights``: model.weights (`loop_config`).

    It is what Ray's ``TorchTrainer`` builds, with the process group set up by `ProcessGroupConfig` instead of
    Ray's ``TorchConfig``: neither this process nor Ray Train's controller loads torch (`training.worker.launch`).
    Ray Train is imported here, not at the top: the stages' module is imported by every Ray worker that runs
    any stage (Prefect ships the flow, which names every stage), and the stages that do not train should not pay for it.
    """
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig  # Ray Train: heavy
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer  # Ray Train: only where the trainer is built

    from training.worker.launch import (  # Ray Train's backend: only where the trainer is built
        ProcessGroupConfig,
        run_loop,
    )

    storage_fs, storage_path = filesystem(parent(run_dir))
    return DataParallelTrainer(
        run_loop,
        train_loop_config=loop_config(cfg, spec.dataset.rows["train"], threads, model, join(run_dir, "faults"), spec, weights),
        # Collectives (DDP's all-reduce) give up after the hang timeout instead of gloo's 30 minutes.
        backend_config=ProcessGroupConfig(timeout_s=int(cfg.hang_timeout_s) + 60 if cfg.hang_timeout_s else 1800),
        scaling_config=ScalingConfig(
            num_workers=worker_range(cfg), use_gpu=use_gpu, resources_per_worker={"CPU": cpus}, placement_strategy=cfg.placement
        ),
        run_config=RunConfig(
            storage_path=storage_path,
            storage_filesystem=storage_fs if is_remote(run_dir) else None,
            name=basename(run_dir),
            # A drained or preempted node (Ray marks it draining on SIGTERM, spot reclaims) spends its
            # own budget, not max_failures, which stays for real failures.
            failure_config=FailureConfig(max_failures=cfg.max_failures, max_preemption_failures=cfg.max_preemption_failures),
            checkpoint_config=CheckpointConfig(
                num_to_keep=cfg.num_to_keep,
                checkpoint_score_attribute=cfg.checkpoint_score,
                checkpoint_score_order=SCORE_ORDER[cfg.checkpoint_score],
            ),
            callbacks=callbacks,
        ),
        # No datasets= here: every worker builds its Ray Data pipelines inside the loop, the train
        # rows per epoch (their order and augmentation depend on it; training.worker.sharding.EpochShards) and
        # its share of the validation rows once (training.worker.loop.train_loop_per_worker).
    )


def fit(trainer: DataParallelTrainer, cfg: TrainConfig, run_dir: str, cpus: float) -> TrainedModel:
    """Run ``trainer`` to the end and describe the result, its attempts included.

    A full, read-only or over-quota storage root comes out as a `StorageWriteError` naming the folder.
    """
    try:
        result = trainer.fit()
    except Exception as exc:  # Ray Train's TrainingFailedError: a full disk becomes the stage's StorageWriteError
        raise_storage_failure(exc, run_dir)
        raise
    model = ModelSpec.model_validate(trainer.train_loop_config["model"])  # what torch_trainer handed the workers
    trained = summarize_result(result, run_dir, cfg.num_workers, cpus, model, cfg.checkpoint_score)
    attempts = read_attempts(join(run_dir, ATTEMPTS_LOG))
    resumed = next((a["start_epoch"] for a in attempts if a["start_epoch"] > 0), None)
    return trained.model_copy(update={"attempts": attempts, "resumed_from_epoch": resumed, **last_compute(attempts)})


def last_compute(attempts: list[dict]) -> dict[str, str]:
    """The device and precision the last attempt recorded (none for attempts recorded before they were)."""
    last = attempts[-1] if attempts else {}
    return {key: last[key] for key in ("device", "precision") if last.get(key)}


def fit_in_process(spec: TransformSpec, cfg: TrainConfig, model: ModelSpec, run_dir: str, threads: int, weights=None) -> TrainedModel:
    """``train.mode: single``: the same loop in this process with ``threads`` torch threads (`fit_single`; imported
    here for the reason `torch_trainer` gives)."""
    from training.single_process import fit_single  # torch: only for train.mode single

    config = loop_config(cfg, spec.dataset.rows["train"], threads, model, join(run_dir, "faults"), spec, weights)
    found, history = fit_single(config, spec, run_dir, cfg.num_to_keep, cfg.checkpoint_score)
    kept = [
        CheckpointInfo(path=str(path), epoch=int(m["epoch"]), val_accuracy=float(m["val_accuracy"]), val_loss=float(m["val_loss"]))
        for path, m in found
    ]
    best = max(kept, key=lambda c: checkpoint_rank(c, cfg.checkpoint_score))
    attempts = read_attempts(join(run_dir, ATTEMPTS_LOG))
    return TrainedModel(
        run_dir=run_dir,
        model=model,
        best_checkpoint=best.path,
        best_val_accuracy=best.val_accuracy,
        checkpoints=kept,
        history=history,
        num_workers=1,
        cpus_per_worker=float(threads),
        score=cfg.checkpoint_score,
        attempts=attempts,
        resumed_from_epoch=next((a["start_epoch"] for a in attempts if a["start_epoch"] > 0), None),
        **last_compute(attempts),
    )
