"""The per-worker training loop Ray Train runs on every rank (``train_loop_per_worker``).

Recipe: AdamW with a one-cycle schedule (linear warm-up, cosine decay), label smoothing, random
shifts / rotations / zoom (applied in the Ray Data transform) and an exponential moving average
(EMA) of the weights, which is what gets validated and saved as ``model.pt``. Every rank reports
every epoch; rank 0 attaches a checkpoint in the seeds' format (model.pt / optimizer.pt /
extra_state.pt, the latter also holding the raw training weights so a resume is exact).
"""

from __future__ import annotations

import json
import math
import tempfile
import time
from datetime import timedelta
from typing import Any

import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullStateDictConfig, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.optim.swa_utils import AveragedModel

from tasks.common.faults import FaultInjector
from tasks.common.model import (
    EXTRA_STATE_FILE,
    MODEL_FILE,
    OPTIMIZER_FILE,
    build_resnet18,
    load_state,
    save_checkpoint_files,
    unwrap,
)


def one_cycle_lr(progress: float, peak: float, warmup: float = 0.2, floor: float = 1e-3) -> float:
    """Learning rate at ``progress`` in [0, 1]: linear warm-up to ``peak``, then cosine to ``peak*floor``."""
    progress = min(max(progress, 0.0), 1.0)
    if progress < warmup:
        return peak * (floor + (1 - floor) * progress / warmup)
    decay = (progress - warmup) / (1 - warmup)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * decay)))


def _all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor.tolist()


def ema_decay_at(decay: float, updates: int) -> float:
    """EMA decay after ``updates`` averaging steps: warms up as (1+n)/(10+n), capped at ``decay``.

    Without the warm-up a short run's average would still be mostly its random initial weights.
    """
    return min(decay, (1.0 + updates) / (10.0 + updates))


def make_ema(model: torch.nn.Module, decay: float) -> AveragedModel | None:
    """An EMA copy of the unwrapped model (buffers included), or None when ``decay`` is 0."""
    if decay <= 0:
        return None

    def average(averaged: torch.Tensor, current: torch.Tensor, updates: torch.Tensor) -> torch.Tensor:
        d = ema_decay_at(decay, int(updates))
        return averaged * d + current * (1.0 - d)

    return AveragedModel(unwrap(model), avg_fn=average, use_buffers=True)


def inference_model(model: torch.nn.Module, ema: AveragedModel | None) -> torch.nn.Module:
    """The weights to validate and ship: the EMA when there is one, else the model itself."""
    return ema.module if ema is not None else unwrap(model)


def restore(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ema: AveragedModel | None) -> int:
    """Load the latest checkpoint Ray Train hands this attempt, if any; return the next epoch."""
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return 0
    with checkpoint.as_directory() as ckpt_dir:
        shipped = load_state(ckpt_dir, MODEL_FILE)
        extra = load_state(ckpt_dir, EXTRA_STATE_FILE)
        optimizer_state = load_state(ckpt_dir, OPTIMIZER_FILE)
        if isinstance(model, FSDP):  # full (unsharded) files; FSDP re-shards them on load
            with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
                model.load_state_dict(extra.get("train_weights", shipped))
                optimizer_state = FSDP.optim_state_dict_to_load(model, optimizer, optimizer_state)
        else:
            unwrap(model).load_state_dict(extra.get("train_weights", shipped))
        if ema is not None:
            ema.module.load_state_dict(shipped)
            ema.n_averaged.fill_(int(extra.get("ema_updates", 1)))
        optimizer.load_state_dict(optimizer_state)
        return int(extra["epoch"]) + 1


def record_attempt(path: str, start_epoch: int, world_size: int) -> None:
    """Append one line per training attempt (Ray Train restart or Prefect retry) to ``train_attempts.jsonl``."""
    line = {"start_epoch": start_epoch, "world_size": world_size, "time": time.time()}
    with open(path, "a") as handle:  # one short line per attempt; appends are atomic enough for a log
        handle.write(json.dumps(line) + "\n")


class TrainingHangError(RuntimeError):
    """A rank did not reach a training step within ``train.hang_timeout_s``."""


class StepGuard:
    """What runs before every training step: test-only fault injection, then the hang check.

    The hang check is a gloo ``monitored_barrier`` with ``timeout_s``: rank 0 waits for every
    rank and, when one does not arrive, the error names it ("Ranks 1 failed to pass
    monitoredBarrier"), so a deadlocked or stalled worker fails the attempt instead of hanging
    the flow forever. It needs the gloo backend (CPU training); with NCCL only the process
    group timeout (``TorchConfig(timeout_s)``, set from the same field) applies.
    """

    def __init__(self, rank: int, world_size: int, timeout_s: float, fault_dir: str | None):
        self.rank, self.timeout_s = rank, timeout_s
        self.faults = FaultInjector(fault_dir, rank) if fault_dir else None
        self.monitored = (
            timeout_s > 0 and world_size > 1 and dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo"
        )

    def before_step(self, epoch: int, step: int) -> None:
        if self.faults:
            self.faults.check(epoch, step)
        if not self.monitored:
            return
        try:
            dist.monitored_barrier(timeout=timedelta(seconds=self.timeout_s), wait_all_ranks=True)
        except RuntimeError as exc:
            raise TrainingHangError(
                f"rank {self.rank}: a training worker did not reach step {step} of epoch {epoch} within "
                f"train.hang_timeout_s={self.timeout_s:g}s (stalled, deadlocked or died): {exc}"
            ) from exc


def train_epoch(
    model, optimizer, criterion, shard, batch_size, epoch, epochs, steps_per_epoch, peak_lr, device, ema=None, guard=None
) -> dict:
    """One pass over this rank's shard; returns global loss, accuracy and images/s."""
    model.train()
    loss_sum, correct, seen, start = 0.0, 0.0, 0.0, time.perf_counter()
    for step, batch in enumerate(shard.iter_torch_batches(batch_size=batch_size, device=device)):
        if guard is not None:
            guard.before_step(epoch, step)
        lr = one_cycle_lr((epoch + min(step / steps_per_epoch, 1.0)) / epochs, peak_lr)
        for group in optimizer.param_groups:
            group["lr"] = lr
        images, labels = batch["image"], batch["label"]
        logits = model(images)
        loss = criterion(logits, labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if ema is not None:
            ema.update_parameters(unwrap(model))
        loss_sum += loss.item() * len(labels)
        correct += (logits.argmax(1) == labels).sum().item()
        seen += len(labels)
    elapsed = time.perf_counter() - start
    loss_sum, correct, seen = _all_reduce_sum([loss_sum, correct, seen], device)
    return {
        "train_loss": loss_sum / max(seen, 1),
        "train_accuracy": correct / max(seen, 1),
        "images_per_s": seen / max(elapsed, 1e-9),
        "lr": lr,
    }


@torch.no_grad()
def validate(model, criterion, shard, batch_size, device) -> dict:
    """Loss and accuracy over the validation split (summed across ranks)."""
    model.eval()
    loss_sum, correct, seen = 0.0, 0.0, 0.0
    for batch in shard.iter_torch_batches(batch_size=batch_size, device=device):
        logits = model(batch["image"])
        loss_sum += criterion(logits, batch["label"]).item() * len(batch["label"])
        correct += (logits.argmax(1) == batch["label"]).sum().item()
        seen += len(batch["label"])
    loss_sum, correct, seen = _all_reduce_sum([loss_sum, correct, seen], device)
    return {"val_loss": loss_sum / max(seen, 1), "val_accuracy": correct / max(seen, 1)}


class _StateDictView(torch.nn.Module):
    """Stands in for a model whose full state dict was already gathered (FSDP)."""

    def __init__(self, state: dict):
        super().__init__()
        self._state = state

    def state_dict(self, *args, **kwargs):  # noqa: D102 - same contract as nn.Module
        return self._state


def report(metrics: dict, model, optimizer, epoch: int, ema: AveragedModel | None = None) -> None:
    """Report on every rank; rank 0 attaches the checkpoint (model, optimizer, extra state)."""
    optimizer_state = None
    if isinstance(model, FSDP):
        # Gathering full weights and optimizer state is a collective: every rank takes part and
        # rank 0 writes them, so the checkpoint loads into a plain ResNet-18. (Not exercised
        # here: PyTorch FSDP needs GPUs, and the test machine has none.)
        config = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
            full_state = model.state_dict()
            optimizer_state = FSDP.optim_state_dict(model, optimizer)
        model = _StateDictView(full_state)
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = None
        if ray.train.get_context().get_world_rank() == 0:
            extra = {"epoch": epoch, "metrics": metrics}
            if ema is not None:
                extra |= {"train_weights": unwrap(model).state_dict(), "ema_updates": int(ema.n_averaged)}
            save_checkpoint_files(tmp, inference_model(model, ema), optimizer, extra, optimizer_state)
            checkpoint = ray.train.Checkpoint.from_directory(tmp)
        ray.train.report(metrics, checkpoint=checkpoint)


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Ray Train entry point: config keys are documented in ``tasks.train.loop_config``."""
    epochs, global_batch, peak_lr = config["epochs"], config["global_batch_size"], config["learning_rate"]
    torch.manual_seed(config["seed"])
    torch.set_num_threads(config["torch_threads"])
    world_size = ray.train.get_context().get_world_size()
    batch_size = max(1, global_batch // world_size)
    steps_per_epoch = max(1, math.ceil(config["train_rows"] / world_size / batch_size))
    device = ray.train.torch.get_device()

    model = ray.train.torch.prepare_model(build_resnet18(), parallel_strategy=config["strategy"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=peak_lr, weight_decay=config["weight_decay"])
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=config["label_smoothing"])
    ema = make_ema(model, config["ema_decay"])
    start_epoch = restore(model, optimizer, ema)
    rank = ray.train.get_context().get_world_rank()
    if rank == 0 and config.get("attempts_log"):
        record_attempt(config["attempts_log"], start_epoch, world_size)
    guard = StepGuard(rank, world_size, config.get("hang_timeout_s", 0), config.get("fault_dir"))

    train_shard = ray.train.get_dataset_shard("train")
    val_shard = ray.train.get_dataset_shard("val")
    for epoch in range(start_epoch, epochs):
        start = time.perf_counter()
        metrics = {"epoch": epoch}
        metrics |= train_epoch(
            model, optimizer, criterion, train_shard, batch_size, epoch, epochs, steps_per_epoch, peak_lr, device, ema, guard
        )
        metrics |= validate(inference_model(model, ema), criterion, val_shard, batch_size, device)
        metrics["epoch_seconds"] = time.perf_counter() - start
        report(metrics, model, optimizer, epoch, ema)
