"""Stage 4: distributed training with Ray Train (TorchTrainer, Ray Train V2).

The flow, not the trainer, names the run: ``RunConfig(storage_path=<root>/runs, name=<run>)``,
so calling this stage again with the same run name resumes that Ray Train run from its latest
checkpoint instead of starting over.

Which layer owns which failure:

* Ray Train owns lost workers and nodes and hangs: it restarts the worker group from the latest
  checkpoint, up to ``train.max_failures`` times (``FailureConfig``).
* Prefect owns the case where Ray Train gives up: the stage is retried ``train.stage_retries``
  times (``retry_infrastructure_failures`` decides), and each retry calls ``fit()`` again with
  the same storage path and run name, which resumes the run from its latest checkpoint. A bug in
  the training code (every failed rank raised an ordinary exception) is not retried.
* The flow owns a lost driver: ``python -m flows.mnist --run-name <same name>`` skips finished
  stages whose outputs verify on storage and this stage resumes from the latest checkpoint.
* Nobody retries a storage root that takes no more writes (full, read-only, over quota): the
  stage fails with a `StorageWriteError` naming the stage, the folder and the cause. Rank 0
  removes the checkpoint folder whose upload failed (each checkpoint's folder name is known
  before its upload: ``checkpoint_epoch-0003``, ``checkpoint_epoch-0003_step-000120``), so it
  neither holds the space a restart needs nor looks like a checkpoint; cleanup removes any such
  folder that still got left behind.

Total budget before a run fails: (max_failures + 1) x (stage_retries + 1) training attempts.

``train.mode: single`` runs the same loop in this stage's own process without Ray Train
(tasks.common.single_process), as a baseline for the price of distribution.
"""

from __future__ import annotations

import math
import os

import ray
from prefect import task
from pydantic import BaseModel
from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer

from pipeline_config import TrainConfig
from tasks.common.faults import ROW_LOG_ENV
from tasks.common.logs import stage_logger
from tasks.common.reports import training_progress_callbacks
from tasks.common.single_process import fit_single
from tasks.common.storage import (
    S3_SCHEME,
    StorageLayout,
    StorageWriteError,
    filesystem,
    is_remote,
    join,
    parent,
    read_lines,
    storage_errno,
    storage_write_error,
)
from tasks.common.train_loop import HISTORY_FILE, read_history, train_loop_per_worker
from tasks.transform import TransformSpec

# One JSON line per training attempt in the run folder: the epoch it started from and its world size.
ATTEMPTS_LOG = "train_attempts.jsonl"

# Which way each checkpoint score is better.
SCORE_ORDER = {"val_accuracy": "max", "val_loss": "min"}


class CheckpointInfo(BaseModel):
    """One kept checkpoint and the metrics reported with it."""

    path: str
    epoch: int
    val_accuracy: float
    val_loss: float = 0.0


def checkpoint_rank(checkpoint: CheckpointInfo, score: str) -> tuple[float, int]:
    """Sort key, larger is better: the configured score first, the later epoch on ties."""
    value = checkpoint.val_accuracy if score == "val_accuracy" else -checkpoint.val_loss
    return value, checkpoint.epoch


class TrainedModel(BaseModel):
    """Where the trained run lives and how it went."""

    run_dir: str
    best_checkpoint: str
    best_val_accuracy: float
    checkpoints: list[CheckpointInfo]
    history: list[dict]
    num_workers: int
    cpus_per_worker: float
    score: str = "val_accuracy"
    attempts: list[dict] = []  # one per attempt: start_epoch, world_size (train_attempts.jsonl)
    resumed_from_epoch: int | None = None  # the first attempt's start epoch when it resumed an earlier run


def plan_resources(cfg: TrainConfig, cluster_cpus: float, cluster_gpus: float) -> tuple[bool, float, int]:
    """Decide (use_gpu, CPUs per worker, torch threads per worker) for this cluster.

    Workers share the cluster's CPUs minus ``cfg.data_cpus``, which stay free for Ray Data:
    with 2 CPUs, 2 workers and 1 kept free each worker reserves 0.5 CPU, and the data
    pipeline's tasks (fractional reads and maps, a whole-CPU file listing) always find room.
    Logical CPUs are only bookkeeping; torch threads follow the physical split.
    """
    use_gpu = cfg.use_gpu == "always" or (cfg.use_gpu == "auto" and cluster_gpus > 0)
    if cfg.strategy == "fsdp" and not use_gpu:
        raise ValueError("train.strategy=fsdp needs GPUs (PyTorch FSDP does not run on CPU); use train.strategy=ddp")
    if use_gpu and cluster_gpus < cfg.num_workers:
        raise ValueError(f"train.num_workers={cfg.num_workers} needs {cfg.num_workers} GPUs; the cluster has {cluster_gpus:g}")
    cpus = round((cluster_cpus - cfg.data_cpus) / cfg.num_workers, 3)
    if cpus < 0.01:
        raise ValueError(
            f"the cluster has {cluster_cpus:g} CPUs: too few for train.num_workers={cfg.num_workers} "
            f"plus train.data_cpus={cfg.data_cpus:g}; lower either"
        )
    threads = max(1, math.floor(cluster_cpus / cfg.num_workers))
    return use_gpu, cpus, threads


def worker_range(cfg: TrainConfig) -> int | tuple[int, int]:
    """ScalingConfig's num_workers: fixed, or the elastic (min, max) range when train.min_workers is set."""
    if cfg.min_workers is None or cfg.min_workers == cfg.num_workers:
        return cfg.num_workers
    return (cfg.min_workers, cfg.num_workers)


def loop_config(
    cfg: TrainConfig, train_rows: int, torch_threads: int, fault_dir: str | None = None, spec: TransformSpec | None = None
) -> dict:
    """The plain dict ``train_loop_per_worker`` unpacks."""
    run_dir = parent(fault_dir) if fault_dir else None
    return {
        "epochs": cfg.epochs_for(train_rows),  # train.epochs, capped by train.max_images
        "global_batch_size": cfg.global_batch_size,
        "learning_rate": cfg.learning_rate,
        "weight_decay": cfg.weight_decay,
        "label_smoothing": cfg.label_smoothing,
        "ema_decay": cfg.ema_decay,
        "seed": cfg.seed,
        "strategy": cfg.strategy,
        "train_rows": train_rows,
        "torch_threads": torch_threads,
        "hang_timeout_s": cfg.hang_timeout_s,
        "fault_dir": fault_dir,  # where test-only fault injection records what fired (tasks.common.faults)
        "run_dir": run_dir,  # Ray Train's run folder: checkpoints get deterministic names there (train_loop.report)
        "attempts_log": join(run_dir, ATTEMPTS_LOG) if run_dir else None,
        "history_path": join(run_dir, HISTORY_FILE) if run_dir else None,  # every epoch's metrics, from rank 0
        "checkpoint_every_steps": cfg.checkpoint_every_steps,
        # Each epoch builds its train pipeline from it (a resumed one without the rows already trained on).
        "transform": spec.model_dump(mode="json") if spec is not None else None,
        # Test-only: every rank logs the row_ids it trains on (tasks.common.faults.ROW_LOG_ENV).
        "row_log_dir": join(run_dir, "row_log") if run_dir and os.environ.get(ROW_LOG_ENV) else None,
    }


# Failures of a lost process or node, or a hang: worth another attempt from the latest checkpoint.
_INFRASTRUCTURE_ERRORS = ("RayActorError", "ActorDiedError", "WorkerCrashedError", "NodeDiedError", "ActorUnavailableError",
                          "OwnerDiedError", "ObjectLostError", "TrainingHangError", "DistBackendError", "DistNetworkError")
_INFRASTRUCTURE_TEXT = ("Connection closed by peer", "Connection reset by peer", "timed out", "monitoredBarrier", "died")


def _failures(exc: BaseException) -> list[BaseException]:
    """``exc`` and every error inside it: causes, contexts, each failed rank's and the controller's."""
    seen: set[int] = set()
    found: list[BaseException] = []
    pending = [exc]
    while pending:
        error = pending.pop(0)
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        found.append(error)
        pending.extend((getattr(error, "worker_failures", None) or {}).values())
        pending.extend([getattr(error, "controller_failure", None), error.__cause__, error.__context__])
    return found


def storage_failure(exc: BaseException, run_dir: str) -> StorageWriteError | None:
    """The training stage's `StorageWriteError` when ``exc`` failed because the storage root took no more writes.

    Looks through Ray Train's errors (``WorkerGroupError.worker_failures``, ``ControllerError``,
    the exception chain) for, best first: a rank's own `StorageWriteError` (it names the
    checkpoint folder), an OSError with ENOSPC / EROFS / EDQUOT / EACCES (named by its file, else
    the run folder), an error whose text alone says so (named by the run folder).
    """
    failures = _failures(exc)
    for error in failures:
        if isinstance(error, StorageWriteError):
            return error
    for by_text in (False, True):
        for error in failures:
            if storage_errno(error, by_text=by_text) is not None:
                return storage_write_error("train", error, run_dir)
    return None


def is_infrastructure_failure(exc: BaseException) -> bool:
    """True when ``exc`` (or a rank's failure inside a Ray Train error) is a lost worker, node or a hang.

    ``ray.train.WorkerGroupError`` carries each failed rank's exception; when every one of them
    is an ordinary exception (a bug, bad data) a retry would only fail again, so it is not one.
    Neither is a full, read-only or over-quota storage root, even when the other ranks lost
    their peer because of it: another attempt would only meet the same disk.
    """
    failures = _failures(exc)
    if any(isinstance(error, StorageWriteError) or storage_errno(error) is not None for error in failures):
        return False
    for error in failures:
        names = {cls.__name__ for cls in type(error).__mro__}
        if names & set(_INFRASTRUCTURE_ERRORS) or any(text in str(error) for text in _INFRASTRUCTURE_TEXT):
            return True
    return False


def retry_infrastructure_failures(task, task_run, state) -> bool:
    """Prefect ``retry_condition_fn`` of the training stage: retry infrastructure failures only."""
    try:
        state.result()
    except BaseException as exc:  # noqa: BLE001 - classifying it is the point
        return is_infrastructure_failure(exc)
    return False


def raise_storage_failure(exc: BaseException, run_dir: str) -> None:
    """Raise the stage's `StorageWriteError` (from ``exc``) when ``exc`` is a storage failure; else return."""
    error = storage_failure(exc, run_dir)
    if error is None:
        return
    # A fresh error raised here, so the message is the stage's own and ``exc`` (Ray Train's, with
    # every rank's traceback) stays attached as its cause.
    raise _copy(error) from exc


def _copy(error: StorageWriteError) -> StorageWriteError:
    copy = StorageWriteError(str(error))
    copy.errno = error.errno
    return copy


def summarize_result(result, run_dir: str, num_workers: int, cpus: float, score: str = "val_accuracy") -> TrainedModel:
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


def read_attempts(path: str) -> list[dict]:
    """The training attempts recorded in ``train_attempts.jsonl`` (empty when there is none)."""
    return read_lines(path)


@task(name="train")
def train(spec: TransformSpec, cfg: TrainConfig, layout: StorageLayout) -> TrainedModel:
    """Train ResNet-18 with Ray Train on the transformed data; checkpoints go to the run folder."""
    logger = stage_logger(__name__)
    resources = ray.cluster_resources()
    if cfg.mode == "single":
        return train_single(spec, cfg, layout, threads=max(1, int(resources.get("CPU", 1))))
    # Ray Train writes checkpoints through a pyarrow filesystem: the local one, or S3 for an s3:// root.
    storage_fs, storage_path = filesystem(layout.runs_dir)
    use_gpu, cpus, threads = plan_resources(cfg, resources.get("CPU", 0), resources.get("GPU", 0))
    logger.info("Training with %d workers x %.3g CPUs (gpu=%s), %g CPUs left to Ray Data", cfg.num_workers, cpus, use_gpu, cfg.data_cpus)
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config=loop_config(cfg, spec.dataset.rows["train"], threads, join(layout.run_dir, "faults"), spec),
        # Collectives (DDP's all-reduce) give up after the hang timeout instead of gloo's 30 minutes.
        torch_config=TorchConfig(timeout_s=int(cfg.hang_timeout_s) + 60 if cfg.hang_timeout_s else 1800),
        scaling_config=ScalingConfig(num_workers=worker_range(cfg), use_gpu=use_gpu, resources_per_worker={"CPU": cpus}),
        run_config=RunConfig(
            storage_path=storage_path,
            storage_filesystem=storage_fs if layout.remote else None,
            name=layout.run_name,
            failure_config=FailureConfig(max_failures=cfg.max_failures),
            checkpoint_config=CheckpointConfig(
                num_to_keep=cfg.num_to_keep,
                checkpoint_score_attribute=cfg.checkpoint_score,
                checkpoint_score_order=SCORE_ORDER[cfg.checkpoint_score],
            ),
            # Live progress in the Prefect UI: the callback runs in the Train controller process.
            callbacks=training_progress_callbacks(cfg.epochs_for(spec.dataset.rows["train"]), layout.run_name),
        ),
        # No datasets= here: every worker builds its Ray Data pipelines inside the loop, the train
        # rows per epoch (their order and augmentation depend on it; train_loop.EpochShards) and
        # its share of the validation rows once (train_loop.train_loop_per_worker).
    )
    try:
        result = trainer.fit()
    except Exception as exc:  # Ray Train's TrainingFailedError: a full disk becomes the stage's StorageWriteError
        raise_storage_failure(exc, layout.run_dir)
        raise
    trained = summarize_result(result, layout.run_dir, cfg.num_workers, cpus, cfg.checkpoint_score)
    attempts = read_attempts(join(layout.run_dir, ATTEMPTS_LOG))
    resumed = next((a["start_epoch"] for a in attempts if a["start_epoch"] > 0), None)
    trained = trained.model_copy(update={"attempts": attempts, "resumed_from_epoch": resumed})
    if len(attempts) > 1:
        logger.info("Training took %d attempts, starting at epochs %s", len(attempts), [a["start_epoch"] for a in attempts])
    logger.info("Best checkpoint %s (val accuracy %.4f)", trained.best_checkpoint, trained.best_val_accuracy)
    return trained


def train_single(spec: TransformSpec, cfg: TrainConfig, layout: StorageLayout, threads: int) -> TrainedModel:
    """``train.mode: single``: the loop in this process with every CPU's threads (tasks.common.single_process)."""
    logger = stage_logger(__name__)
    logger.info("Training in one process without Ray Train (train.mode=single), %d torch threads", threads)
    config = loop_config(cfg, spec.dataset.rows["train"], threads, join(layout.run_dir, "faults"), spec)
    found, history = fit_single(config, spec, layout.run_dir, cfg.num_to_keep, cfg.checkpoint_score)
    kept = [
        CheckpointInfo(path=str(path), epoch=int(m["epoch"]), val_accuracy=float(m["val_accuracy"]), val_loss=float(m["val_loss"]))
        for path, m in found
    ]
    best = max(kept, key=lambda c: checkpoint_rank(c, cfg.checkpoint_score))
    attempts = read_attempts(join(layout.run_dir, ATTEMPTS_LOG))
    logger.info("Best checkpoint %s (val accuracy %.4f)", best.path, best.val_accuracy)
    return TrainedModel(
        run_dir=layout.run_dir,
        best_checkpoint=best.path,
        best_val_accuracy=best.val_accuracy,
        checkpoints=kept,
        history=history,
        num_workers=1,
        cpus_per_worker=float(threads),
        score=cfg.checkpoint_score,
        attempts=attempts,
        resumed_from_epoch=next((a["start_epoch"] for a in attempts if a["start_epoch"] > 0), None),
    )
