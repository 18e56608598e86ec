"""The per-worker training loop Ray Train runs on every rank (``train_loop_per_worker``).

One attempt: build the model, the recipe's optimizer and weight average (`training.worker.recipe`),
resume from the checkpoint Ray Train hands over (`training.checkpoint.in_attempt`), then per epoch train on
this rank's share of the rows (`training.worker.sharding`), each step behind the hang check and the
test-only fault hooks (`training.worker.guard`), validate the averaged weights, record the epoch
(`training.checkpoint.records`) and report it with its checkpoint. Every rank reports every epoch.

With ``checkpoint_every_steps`` > 0 every rank also reports every K optimizer steps, and the
checkpoint records the data position (`training.checkpoint.in_attempt.Position`): the epoch, its steps done
and the ``row_id``s they consumed, gathered from all ranks, so a restart with any world size
trains every row once per epoch (`training.worker.sharding.EpochShards`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
from torch.optim.swa_utils import AveragedModel

from storage_io import storage_writes
from training.checkpoint.in_attempt import report, report_mid_epoch, restore
from training.checkpoint.model_files import unwrap
from training.checkpoint.records import RowLog, record_attempt, record_epoch
from training.manifests import LoopConfig, Position
from training.model.catalog import ModelSpec, configure_cpu
from training.model.weights import start_from
from training.worker.captured_step import CapturedStep, use_captured_step
from training.worker.device import (
    StepClock,
    autocast,
    backward_and_step,
    grad_scaler,
    images_for,
    prepare_for,
    resolve_precision,
)
from training.worker.feeding import batches
from training.worker.guard import StepGuard, preempted, preemption_cadence
from training.worker.recipe import Plan, inference_model, make_ema, make_optimizer, plan_for
from training.worker.sharding import attempt_splits, gather_rows


@dataclass
class Attempt:
    """One training attempt's parts on one rank: what every step, validation and report uses."""

    cfg: LoopConfig
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    criterion: torch.nn.Module
    ema: AveragedModel | None
    device: torch.device
    batch_size: int  # this rank's share of the global batch
    steps_per_epoch: int
    plan: Plan  # the learning-rate schedule and the weight average's decay, sized by the run's steps
    checkpoint_every: int = 0  # mid-epoch reports every this many steps (0: never; Ray Train only)
    preemption_check: int = 0  # ray.train.get_preemption_info every this many steps (0: never; Ray Train only)
    saved_for_preemption: bool = False  # the just-in-time checkpoint of this attempt is written
    guard: StepGuard | None = None
    row_log: RowLog | None = None
    precision: str = "fp32"  # the step's arithmetic: bf16 / fp16 autocast or fp32 (`training.worker.device`)
    scaler: torch.amp.GradScaler | None = None  # fp16's gradient scaler
    captured: CapturedStep | None = None  # the step replayed from CUDA graphs (`use_captured_step`), else `train_step`
    busy: StepClock | None = None  # on a GPU: how long the device worked on each step (CUDA events)

    def weights(self) -> torch.nn.Module:
        """The weights validated and shipped: the moving average's, else the model's own."""
        return inference_model(self.model, self.ema)


def start_attempt(
    cfg: LoopConfig, world_size: int, device: torch.device, prepare: Callable[[torch.nn.Module], torch.nn.Module],
    fresh: bool = True,
) -> Attempt:
    """Seed, threads, the model (``prepare`` wraps or moves it), the recipe's optimizer, loss and weight average.

    The same for every rank of a Ray Train run and for single mode, in the same order, so one
    seed builds the same initial weights either way.
    """
    torch.manual_seed(cfg.seed)
    configure_cpu(cfg.torch_threads)
    batch_size = max(1, cfg.global_batch_size // world_size)
    model = ModelSpec.model_validate(cfg.model).build()
    if fresh:  # model.weights (training.model.weights): loaded for a fresh start only; a resume loads its checkpoint
        start_from(model, cfg.model.get("weights"))
    model = prepare(prepare_for(model, device))  # on a GPU: channels-last weights, cuDNN's autotuner
    precision = resolve_precision(cfg.precision, device)
    steps_per_epoch = max(1, math.ceil(cfg.train_rows / world_size / batch_size))
    plan = plan_for(cfg, steps_per_epoch * cfg.epochs)  # schedule and weight average sized by the run's steps
    return Attempt(
        cfg=cfg,
        model=model,
        optimizer=make_optimizer(model, cfg.learning_rate, cfg.weight_decay),
        criterion=torch.nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing),
        ema=make_ema(model, plan.ema_decay),
        device=device,
        batch_size=batch_size,
        steps_per_epoch=steps_per_epoch,
        plan=plan,
        precision=precision,
        scaler=grad_scaler(precision, device),
    )


def attach_step(attempt: Attempt, world_size: int) -> None:
    """After the attempt's checkpoint is restored: its step (captured or eager, ``train.cuda_graph``) and, on a GPU,
    its step clock."""
    cfg = attempt.cfg
    if use_captured_step(cfg.cuda_graph, attempt.device, world_size, attempt.precision):
        attempt.captured = CapturedStep(attempt, capture=attempt.device.type == "cuda")
    attempt.busy = StepClock() if attempt.device.type == "cuda" else None


def _all_reduce_sum(values: list[torch.Tensor | float], device: torch.device) -> list[float]:
    """The sums across ranks of ``values`` (device tensors or numbers): the one read from the device they need."""
    tensor = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device) for v in values])
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor.tolist()


def _mean_across_ranks(value: float, device: torch.device) -> float:
    """``value``'s mean over the ranks (the same number on each); ``value`` itself without a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return value
    return _all_reduce_sum([value], device)[0] / dist.get_world_size()


def zero_total(device: torch.device) -> torch.Tensor:
    """A running total kept on ``device``: added to every step, read once an epoch (`_all_reduce_sum`)."""
    return torch.zeros((), dtype=torch.float64, device=device)


def train_epoch(attempt: Attempt, shard, epoch: int, start: Position | None = None) -> dict:
    """One pass over this rank's shard; returns global loss, accuracy, images/s and this rank's data wait.

    ``start`` resumes an interrupted epoch: step numbering (and the learning-rate schedule) go on
    from ``start.step`` and ``start.consumed`` is carried into the next mid-epoch checkpoint.
    Every ``attempt.checkpoint_every`` steps (0: never) all ranks report a mid-epoch checkpoint holding
    the data position: the steps done and every row_id they consumed (into the run folder, see `report`).
    """
    cfg, model, optimizer, ema, guard, row_log = attempt.cfg, attempt.model, attempt.optimizer, attempt.ema, attempt.guard, attempt.row_log
    steps_per_epoch = attempt.steps_per_epoch
    model.train()
    first_step = start.step if start is not None else 0
    earlier = [start.consumed] if start is not None and start.consumed is not None else []
    consumed: list[torch.Tensor] = []  # row_ids as they came (on the device on a GPU): copied to the host at a checkpoint
    loss_sum, correct, seen, start_time = zero_total(attempt.device), zero_total(attempt.device), 0, time.perf_counter()
    data_wait, mark, first_step_at = 0.0, start_time, None
    lr = attempt.plan.lr(epoch * steps_per_epoch)
    captured, busy = attempt.captured, attempt.busy
    if captured is not None:
        captured.begin_epoch(epoch * steps_per_epoch + first_step)
    if busy is not None:
        busy.begin_epoch()
    steps = 0
    for step, batch in enumerate(batches(attempt, shard, training=True), start=first_step):
        data_wait += time.perf_counter() - mark  # time this rank waited for its next batch
        if first_step_at is None:
            first_step_at = time.time()  # wall clock: the fixed overhead ends here (benchmarks/start/deployment_overhead.py)
        if guard is not None:
            guard.before_step(epoch, step)
        lr = attempt.plan.lr(epoch * steps_per_epoch + min(step, steps_per_epoch))
        if busy is not None:
            busy.start()
        if captured is not None:  # the same step, its learning rate read on the device (`training.worker.captured_step`)
            captured(batch["image"], batch["label"])
        else:
            batch_loss, batch_correct = train_step(attempt, batch["image"], batch["label"], lr)
            loss_sum += batch_loss
            correct += batch_correct
        if busy is not None:
            busy.stop()
        seen += len(batch["label"])
        steps += 1
        consumed.append(batch["row_id"])
        if row_log is not None:  # test-only
            row_log.write(epoch, step, batch["row_id"].cpu())
        periodic = attempt.checkpoint_every and (step + 1) % attempt.checkpoint_every == 0
        if periodic or preempted(attempt, step, run_step=epoch * steps_per_epoch + step):
            rows = gather_rows([torch.cat(consumed).cpu()])
            position = {"epoch": epoch, "step": step + 1, "row_ids": torch.cat([*earlier, rows])}
            report_mid_epoch(position, model, optimizer, ema, cfg.run_dir, cfg.model, attempt.precision, attempt.scaler)
        mark = time.perf_counter()
    if captured is not None:
        loss_sum, correct = captured.totals()
    # The read of the totals waits for the device: on a GPU the host queues steps ahead of it (a whole small epoch of
    # captured steps), so the epoch's seconds are taken after it (before: 390,000 img/s on an H200, the queuing's pace).
    loss_sum, correct, seen = _all_reduce_sum([loss_sum, correct, seen], attempt.device)
    elapsed = time.perf_counter() - start_time
    step_s = _mean_across_ranks(elapsed / max(steps, 1), attempt.device)
    busy_s = busy.seconds() if busy is not None else None  # every step has finished
    metrics = {
        "train_loss": loss_sum / max(seen, 1),
        "train_accuracy": correct / max(seen, 1),
        "images_per_s": seen / max(elapsed, 1e-9),
        # Of the epoch's seconds, how many this rank spent waiting for data (the rest is compute).
        "epoch_train_s": elapsed,
        "data_wait_s": data_wait,
        "lr": lr,
        "step_s": step_s,  # seconds a step took, the ranks' mean: the same number on every rank
    }
    if busy_s is not None:  # the share of the epoch's seconds the GPU spent on its steps
        metrics["gpu_busy"] = round(min(1.0, busy_s / max(elapsed, 1e-9)), 4)
    if first_step_at is not None:  # none: a resumed epoch already done
        metrics["first_step_at"] = first_step_at
    return metrics


def train_step(attempt: Attempt, images: torch.Tensor, labels: torch.Tensor, lr: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step on a batch at learning rate ``lr`` in the attempt's precision, then the weight average's update.

    Nothing here reads a value back from the device, so on a GPU the host queues the next step at once.

    Returns:
        (the batch's summed loss, its count of correct predictions) as device tensors, for the epoch's totals.
    """
    for group in attempt.optimizer.param_groups:
        group["lr"] = lr
    with autocast(attempt.precision, attempt.device):
        logits = attempt.model(images_for(images, attempt.device))
        loss = attempt.criterion(logits, labels)
    attempt.optimizer.zero_grad(set_to_none=True)
    backward_and_step(loss, attempt.optimizer, attempt.scaler)
    if attempt.ema is not None:
        attempt.ema.update_parameters(unwrap(attempt.model))
    return loss.detach().double() * len(labels), (logits.argmax(1) == labels).sum()


@torch.no_grad()
def validate(attempt: Attempt, shard) -> dict:
    """Loss and accuracy of the attempt's shipped weights (`Attempt.weights`) over the validation split (summed across ranks).

    ``val_loss`` is the training criterion (label smoothing included); ``val_ce`` is plain
    cross-entropy, which compares runs trained with different label smoothing (the tune flow's metric).
    """
    model, criterion, device = attempt.weights(), attempt.criterion, attempt.device
    model.eval()
    loss_sum, ce_sum, correct, seen = zero_total(device), zero_total(device), zero_total(device), 0
    for batch in batches(attempt, shard):
        logits = model(images_for(batch["image"], device))
        loss_sum += criterion(logits, batch["label"]).double() * len(batch["label"])
        ce_sum += torch.nn.functional.cross_entropy(logits, batch["label"], reduction="sum").double()
        correct += (logits.argmax(1) == batch["label"]).sum()
        seen += len(batch["label"])
    loss_sum, ce_sum, correct, seen = _all_reduce_sum([loss_sum, ce_sum, correct, seen], device)
    return {"val_loss": loss_sum / max(seen, 1), "val_ce": ce_sum / max(seen, 1), "val_accuracy": correct / max(seen, 1)}


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Ray Train entry point: ``config`` is a `LoopConfig` as a dict (``training.trainer.loop_config``)."""
    cfg = LoopConfig.model_validate(config)
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    attempt = start_attempt(
        cfg, world_size, ray.train.torch.get_device(),
        prepare=lambda model: ray.train.torch.prepare_model(model, parallel_strategy=cfg.strategy),
        fresh=ray.train.get_checkpoint() is None,
    )
    start = restore(attempt.model, attempt.optimizer, attempt.ema, attempt.scaler)
    if rank == 0 and cfg.attempts_log:
        with storage_writes("train", cfg.attempts_log):
            record_attempt(cfg.attempts_log, start, world_size, local_world_size=context.get_local_world_size(),
                           device=attempt.device.type, precision=attempt.precision)
    attempt.checkpoint_every = cfg.checkpoint_every_steps
    attempt.preemption_check = cfg.preemption_check_steps
    attempt.guard = StepGuard(rank, world_size, cfg.hang_timeout_s, cfg.fault_dir)
    attempt.row_log = RowLog(cfg.row_log_dir, start, world_size, rank) if cfg.row_log_dir else None
    attach_step(attempt, world_size)

    epoch_shard, val_shard = attempt_splits(cfg, attempt.device, start, rank, world_size)
    reported_in: dict = {}  # the last epoch's report seconds (and of them writing the files), kept with the next epoch
    for epoch in range(start.epoch, cfg.epochs):
        begin = time.perf_counter()
        resuming = epoch == start.epoch and start.step > 0
        metrics = {"epoch": epoch} | reported_in
        metrics |= train_epoch(attempt, epoch_shard(epoch), epoch, start=start if resuming else None)
        metrics |= validate(attempt, val_shard)
        attempt.preemption_check = preemption_cadence(cfg.preemption_check_steps, cfg.preemption_check_s, metrics["step_s"])
        metrics["epoch_seconds"] = time.perf_counter() - begin
        metrics["finished_at"] = time.time()  # wall clock, for time-to-accuracy (benchmarks/speed/accuracy.py)
        if rank == 0 and cfg.history_path:
            with storage_writes("train", cfg.history_path):
                record_epoch(cfg.history_path, metrics)
        reporting = time.perf_counter()
        saved_in = report(metrics, attempt.model, attempt.optimizer, epoch, attempt.ema, run_dir=cfg.run_dir,
                          model_spec=cfg.model, precision=attempt.precision, scaler=attempt.scaler)
        reported_in = {"previous_report_s": round(time.perf_counter() - reporting, 4), "previous_checkpoint_save_s": saved_in}
