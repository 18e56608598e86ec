"""The training stage's manifest, the run folder's records of its checkpoints, and the light types training passes
around (`Position`, `LoopConfig`): no torch, no Ray Train.

`TrainedModel` is what the training stage hands to evaluation, promotion and cleanup; the Ray Train
snapshot readers say which checkpoint folders a run keeps (cleanup) and which one a resumed run
starts from (the run summary). They live apart from the TorchTrainer (`training.trainer`) so that
the stages that only read them import neither torch nor Ray Train.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict

from storage_io import join, read_bytes, read_lines
from training.model.catalog import ModelSpec

if TYPE_CHECKING:  # annotations only
    import torch

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
    model: ModelSpec  # what was trained (model.name, input channels, classes): what loads its checkpoints
    best_checkpoint: str
    best_val_accuracy: float
    checkpoints: list[CheckpointInfo]
    history: list[dict]
    num_workers: int
    cpus_per_worker: float
    score: str = "val_accuracy"
    attempts: list[dict] = []  # one per attempt: start_epoch, world_size (train_attempts.jsonl)
    resumed_from_epoch: int | None = None  # the first attempt's start epoch when it resumed an earlier run
    weights: dict[str, str] | None = None  # model.weights a fresh start loaded: source, file, sha256 (tasks.train)
    warnings: list[str] = []  # what the run was warned of before training (`TrainConfig.few_steps_warning`)
    device: str | None = None  # where the last attempt trained: cpu or cuda (train_attempts.jsonl)
    precision: str | None = None  # its step's arithmetic: bf16, fp16 or fp32 (`training.worker.device.resolve_precision`)

    def compute(self) -> dict[str, str]:
        """``{"device": ..., "precision": ...}`` as far as known: what the model card and summary.json record."""
        return {key: value for key, value in (("device", self.device), ("precision", self.precision)) if value}

    def terminal_detail(self) -> str:
        """What the training stage's closing terminal line adds after its name and seconds."""
        return f": best validation accuracy {self.best_val_accuracy:.2%}"


RAY_TRAIN_SNAPSHOT = "checkpoint_manager_snapshot.json"


class UnreadableSnapshot(ValueError):
    """Ray Train's snapshot is there but cannot be read: which checkpoints it keeps is unknown."""


def read_snapshot(run_dir: str) -> dict | None:
    """Ray Train's checkpoint snapshot of the run in ``run_dir``, or None when it has written none."""
    path = join(run_dir, RAY_TRAIN_SNAPSHOT)
    try:
        snapshot = json.loads(read_bytes(path))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise UnreadableSnapshot(f"{path} is unreadable: {exc}") from exc
    if not isinstance(snapshot, dict):
        raise UnreadableSnapshot(f"{path} is not a Ray Train checkpoint snapshot")
    return snapshot


def ray_train_checkpoints(run_dir: str) -> set[str]:
    """Names of the checkpoint folders Ray Train's snapshot in ``run_dir`` records (empty when there is none).

    Kept, latest and pending ones alike: any of them may be what a resumed run restores.
    """
    snapshot = read_snapshot(run_dir) or {}
    results = [*(snapshot.get("checkpoint_results") or []), snapshot.get("latest_checkpoint_result"),
               *(snapshot.get("pending_training_results") or [])]
    return {r["checkpoint_dir_name"] for r in results if isinstance(r, dict) and r.get("checkpoint_dir_name")}


def latest_checkpoint(run_dir: str) -> dict | None:
    """The latest checkpoint Ray Train recorded for the run in ``run_dir`` (what a resumed run starts from):
    path, epoch, mid-epoch or not, step; None when there is none or the snapshot is unreadable."""
    try:
        latest = (read_snapshot(run_dir) or {}).get("latest_checkpoint_result")
    except UnreadableSnapshot:
        return None
    if not isinstance(latest, dict) or not latest.get("checkpoint_dir_name"):
        return None
    metrics = latest.get("metrics") or {}
    return {
        "path": join(run_dir, latest["checkpoint_dir_name"]),
        "epoch": metrics.get("epoch"),
        "mid_epoch": bool(metrics.get("mid_epoch")),
        "step": metrics.get("step"),
    }


def read_attempts(path: str) -> list[dict]:
    """The training attempts recorded in ``train_attempts.jsonl`` (empty when there is none)."""
    return read_lines(path)


@dataclass
class Position:
    """Where a training attempt starts: the epoch, the optimizer steps of it already done and their rows.

    ``consumed`` holds the ``row_id``s that the steps before ``step`` trained on (every rank's,
    gathered into the checkpoint), so a resumed epoch trains on exactly the rest.
    """

    epoch: int = 0
    step: int = 0
    consumed: torch.Tensor | None = None


class LoopConfig(BaseModel):
    """What every rank's loop needs, built by ``training.trainer.loop_config``.

    Ray Train hands it to each worker as a plain dict (``train_loop_config``), which the loop
    validates into this on arrival; single mode takes the same dict.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: dict[str, Any]  # the `training.model.catalog.ModelSpec` every rank builds, recorded in each checkpoint
    epochs: int  # train.epochs, capped by train.max_images
    global_batch_size: int
    learning_rate: float  # the one-cycle schedule's peak
    weight_decay: float
    label_smoothing: float
    ema_decay: float
    seed: int
    strategy: str = "ddp"
    train_rows: int
    torch_threads: int
    hang_timeout_s: float = 0.0
    fault_dir: str | None = None  # where test-only fault injection records what fired (training.worker.faults)
    run_dir: str | None = None  # Ray Train's run folder: checkpoints get deterministic names there
    attempts_log: str | None = None
    history_path: str | None = None  # every epoch's metrics, from rank 0
    checkpoint_every_steps: int = 0
    preemption_check_steps: int = 0  # ask Ray Train about a preempted node every this many steps (0: never)
    preemption_check_s: float = 0.0  # ... and after the first epoch about this many seconds apart (`training.worker.guard.preemption_cadence`)
    cuda_graph: str = "auto"  # train.cuda_graph: the step replayed from CUDA graphs (`training.worker.captured_step`)
    resident_data: str = "auto"  # train.resident_data: the splits held by each worker (`dataset.tensors.resident`)
    transform: dict[str, Any] | None = None  # the TransformSpec each epoch builds its rows from
    row_log_dir: str | None = None  # test-only: every rank logs the row_ids it trains on
    precision: str = "auto"  # train.precision, resolved per device (`training.worker.device.resolve_precision`)
    use_gpu: str = "auto"  # train.use_gpu: single mode's device (Ray Train's workers get theirs from Ray Train)
