"""``train.mode: single``: the training loop in one process, without Ray Train (the seeds' first section).

Same model, recipe, Ray Data pipeline and checkpoint files as the distributed mode, so the two
can be compared on one machine (``benchmarks/``, or a run with ``--train.mode single``): what
is left between them is the price of distribution (worker-group start, DDP all-reduce, per-rank
data shards, reporting). Without Ray Train nothing restarts a failed process: a failure fails
the stage, and running it again (Prefect's retry or the same ``--run-name``) resumes from the
latest epoch checkpoint in ``<run>/single/``. It trains on the first GPU when the process sees one
(``train.use_gpu``: auto; never keeps it on CPUs).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from storage_io import building, publish_dir
from training.checkpoint.files import EXTRA_STATE_FILE
from training.checkpoint.in_attempt import checkpoint_extra, load_checkpoint
from training.checkpoint.model_files import load_state, save_checkpoint_files
from training.checkpoint.records import HISTORY_FILE, read_history, record_attempt, record_epoch
from training.manifests import LoopConfig, Position
from training.worker.device import pick_device, visible_gpus
from training.worker.loop import attach_step, start_attempt, train_epoch, validate
from training.worker.sharding import attempt_splits

SINGLE_DIR = "single"


def epoch_checkpoints(folder: Path) -> list[Path]:
    """The published checkpoint folders, oldest epoch first."""
    return sorted(folder.glob("checkpoint_epoch_*"))


def checkpoint_metrics(checkpoint: Path) -> dict[str, Any]:
    """The metrics saved with a checkpoint (in ``extra_state.pt``, checksum-verified)."""
    return dict(load_state(checkpoint, EXTRA_STATE_FILE)["metrics"])


def prune(folder: Path, num_to_keep: int, score: str) -> None:
    """Keep the ``num_to_keep`` best checkpoints by ``score``, and always the latest one."""
    found = epoch_checkpoints(folder)
    sign = 1 if score == "val_accuracy" else -1
    ranked = sorted(found, key=lambda p: (sign * checkpoint_metrics(p)[score], p.name), reverse=True)
    for path in set(ranked[num_to_keep:]) - {found[-1]}:
        trash = path.with_name(f".{path.name}.deleted")
        path.rename(trash)  # one rename, then delete: never a half-deleted checkpoint under its name
        shutil.rmtree(trash)


def fit_single(config: dict[str, Any], spec, run_dir: str, num_to_keep: int, score: str) -> tuple[list[tuple[Path, dict]], list[dict]]:
    """Train in this process; return the kept checkpoints with their metrics, and the per-epoch history.

    ``config`` is the dict of ``training.trainer.loop_config``; ``spec`` the transform's TransformSpec.
    ``run_dir`` is a local folder: the config refuses ``train.mode: single`` on an S3 storage root.
    """
    folder = Path(run_dir) / SINGLE_DIR
    folder.mkdir(parents=True, exist_ok=True)
    cfg = LoopConfig.model_validate(config)
    device = pick_device(cfg.use_gpu, visible_gpus())  # the first GPU when there is one (train.use_gpu: auto)
    existing = epoch_checkpoints(folder)
    # The Ray Train ranks' setup; model.weights loaded only when there is no checkpoint to resume from.
    attempt = start_attempt(cfg, 1, device, prepare=lambda model: model.to(device), fresh=not existing)
    start = load_checkpoint(existing[-1], attempt.model, attempt.optimizer, attempt.ema, attempt.scaler) if existing else Position()
    attach_step(attempt, 1)  # after the restore: the captured step binds the learning rate and reads the average's count
    if cfg.attempts_log:
        record_attempt(cfg.attempts_log, start, world_size=1, device=device.type, precision=attempt.precision)
    epoch_shard, val_shard = attempt_splits(cfg, device, start, rank=0, world_size=1)  # on the device, or Ray Data's
    history_path = folder / HISTORY_FILE
    history = [row for row in read_history(history_path) if row["epoch"] < start.epoch]  # later epochs were rolled back
    for epoch in range(start.epoch, cfg.epochs):
        metrics: dict[str, Any] = {"epoch": epoch}
        metrics |= train_epoch(attempt, epoch_shard(epoch), epoch)
        metrics |= validate(attempt, val_shard)
        metrics["finished_at"] = time.time()
        extra = checkpoint_extra(metrics, attempt.model, epoch, attempt.ema, model_spec=cfg.model, precision=attempt.precision,
                                 scaler=attempt.scaler)
        with building(folder / f"checkpoint_epoch_{epoch:04d}") as staging:
            save_checkpoint_files(staging, attempt.weights(), attempt.optimizer, extra)
            publish_dir(staging, folder / f"checkpoint_epoch_{epoch:04d}")
        history = record_epoch(history_path, metrics)
        prune(folder, num_to_keep, score)
    return [(path, checkpoint_metrics(path)) for path in epoch_checkpoints(folder)], history
