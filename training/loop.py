"""The per-worker training loop Ray Train runs on every rank (``train_loop_per_worker``).

One attempt: build the model, the recipe's optimizer and weight average (`training.recipe`),
resume from the checkpoint Ray Train hands over (`training.checkpoints`), then per epoch train on
this rank's share of the rows (`training.sharding`), each step behind the hang check and the
test-only fault hooks (`training.guard`), validate the averaged weights, record the epoch
(`training.records`) and report it with its checkpoint. Every rank reports every epoch.

With ``checkpoint_every_steps`` > 0 every rank also reports every K optimizer steps, and the
checkpoint records the data position (`training.checkpoints.Position`): the epoch, its steps done
and the ``row_id``s they consumed, gathered from all ranks, so a restart with any world size
trains every row once per epoch (`training.sharding.EpochShards`).
"""

from __future__ import annotations

import math
import time
from typing import Any

import ray.train
import ray.train.torch
import torch
import torch.distributed as dist

from dataset.transform import TransformSpec, build_split
from storage_io import storage_writes
from training.checkpoints import Position, report, report_mid_epoch, restore
from training.guard import StepGuard
from training.models import ModelSpec, configure_cpu
from training.model import unwrap
from training.recipe import inference_model, make_ema, make_optimizer, one_cycle_lr
from training.records import RowLog, record_attempt, record_epoch
from training.sharding import EpochShards, gather_rows


def _all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor.tolist()


def train_epoch(
    model, optimizer, criterion, shard, batch_size, epoch, epochs, steps_per_epoch, peak_lr, device, ema=None, guard=None,
    start: Position | None = None, checkpoint_every: int = 0, row_log: RowLog | None = None, run_dir: str | None = None,
    model_spec: dict | None = None,
) -> dict:
    """One pass over this rank's shard; returns global loss, accuracy, images/s and this rank's data wait.

    ``start`` resumes an interrupted epoch: step numbering (and the learning-rate schedule) go on
    from ``start.step`` and ``start.consumed`` is carried into the next mid-epoch checkpoint.
    Every ``checkpoint_every`` steps (0: never) all ranks report a mid-epoch checkpoint holding
    the data position: the steps done and every row_id they consumed (into ``run_dir``, see `report`).
    """
    model.train()
    first_step = start.step if start is not None else 0
    earlier = [start.consumed] if start is not None and start.consumed is not None else []
    consumed: list[torch.Tensor] = []
    loss_sum, correct, seen, start_time = 0.0, 0.0, 0.0, time.perf_counter()
    data_wait, mark, first_step_at = 0.0, start_time, None
    lr = one_cycle_lr(epoch / epochs, peak_lr)
    for step, batch in enumerate(shard.iter_torch_batches(batch_size=batch_size, device=device), start=first_step):
        data_wait += time.perf_counter() - mark  # time this rank waited for its next batch
        if first_step_at is None:
            first_step_at = time.time()  # wall clock: the fixed overhead ends here (benchmarks/deployment_overhead.py)
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
        row_ids = batch["row_id"].cpu()
        consumed.append(row_ids)
        if row_log is not None:
            row_log.write(epoch, step, row_ids)
        if checkpoint_every and (step + 1) % checkpoint_every == 0:
            rows = gather_rows(consumed)
            position = {"epoch": epoch, "step": step + 1, "row_ids": torch.cat([*earlier, rows])}
            report_mid_epoch(position, model, optimizer, ema, run_dir, model_spec)
        mark = time.perf_counter()
    elapsed = time.perf_counter() - start_time
    loss_sum, correct, seen = _all_reduce_sum([loss_sum, correct, seen], device)
    return {
        "train_loss": loss_sum / max(seen, 1),
        "train_accuracy": correct / max(seen, 1),
        "images_per_s": seen / max(elapsed, 1e-9),
        # Of the epoch's seconds, how many this rank spent waiting for data (the rest is compute).
        "epoch_train_s": elapsed,
        "data_wait_s": data_wait,
        "lr": lr,
    } | ({"first_step_at": first_step_at} if first_step_at is not None else {})  # no step: a resumed epoch already done


@torch.no_grad()
def validate(model, criterion, shard, batch_size, device) -> dict:
    """Loss and accuracy over the validation split (summed across ranks).

    ``val_loss`` is the training criterion (label smoothing included); ``val_ce`` is plain
    cross-entropy, which compares runs trained with different label smoothing (the tune flow's metric).
    """
    model.eval()
    loss_sum, ce_sum, correct, seen = 0.0, 0.0, 0.0, 0.0
    for batch in shard.iter_torch_batches(batch_size=batch_size, device=device):
        logits = model(batch["image"])
        loss_sum += criterion(logits, batch["label"]).item() * len(batch["label"])
        ce_sum += torch.nn.functional.cross_entropy(logits, batch["label"], reduction="sum").item()
        correct += (logits.argmax(1) == batch["label"]).sum().item()
        seen += len(batch["label"])
    loss_sum, ce_sum, correct, seen = _all_reduce_sum([loss_sum, ce_sum, correct, seen], device)
    return {"val_loss": loss_sum / max(seen, 1), "val_ce": ce_sum / max(seen, 1), "val_accuracy": correct / max(seen, 1)}


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Ray Train entry point: config keys are documented in ``training.trainer.loop_config``."""
    epochs, global_batch, peak_lr = config["epochs"], config["global_batch_size"], config["learning_rate"]
    torch.manual_seed(config["seed"])
    configure_cpu(config["torch_threads"])
    world_size = ray.train.get_context().get_world_size()
    batch_size = max(1, global_batch // world_size)
    steps_per_epoch = max(1, math.ceil(config["train_rows"] / world_size / batch_size))
    device = ray.train.torch.get_device()

    model = ray.train.torch.prepare_model(ModelSpec.model_validate(config["model"]).build(), parallel_strategy=config["strategy"])
    optimizer = make_optimizer(model, peak_lr, config["weight_decay"])
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=config["label_smoothing"])
    ema = make_ema(model, config["ema_decay"])
    start = restore(model, optimizer, ema)
    rank = ray.train.get_context().get_world_rank()
    if rank == 0 and config.get("attempts_log"):
        with storage_writes("train", config["attempts_log"]):
            record_attempt(config["attempts_log"], start, world_size)
    guard = StepGuard(rank, world_size, config.get("hang_timeout_s", 0), config.get("fault_dir"))
    row_log = RowLog(config["row_log_dir"], start, world_size, rank) if config.get("row_log_dir") else None

    # This rank's share of the validation rows, built here once per attempt: a Ray Train dataset
    # shard would start a split coordinator actor first (measured: 8.6 s for epoch 0's validation
    # of 200 rows with it, against 0.2-0.4 s for every later epoch).
    val_shard = build_split(TransformSpec.model_validate(config["transform"]), "val", part=(rank, world_size))
    epoch_shard = EpochShards(config, start, rank, world_size)
    for epoch in range(start.epoch, epochs):
        begin = time.perf_counter()
        resuming = epoch == start.epoch and start.step > 0
        shard = epoch_shard(epoch)
        metrics = {"epoch": epoch}
        metrics |= train_epoch(
            model, optimizer, criterion, shard, batch_size, epoch, epochs, steps_per_epoch, peak_lr, device, ema, guard,
            start=start if resuming else None, checkpoint_every=config.get("checkpoint_every_steps", 0), row_log=row_log,
            run_dir=config.get("run_dir"), model_spec=config["model"],
        )
        metrics |= validate(inference_model(model, ema), criterion, val_shard, batch_size, device)
        metrics["epoch_seconds"] = time.perf_counter() - begin
        metrics["finished_at"] = time.time()  # wall clock, for time-to-accuracy (benchmarks/accuracy.py)
        if rank == 0 and config.get("history_path"):
            with storage_writes("train", config["history_path"]):
                record_epoch(config["history_path"], metrics)
        report(metrics, model, optimizer, epoch, ema, run_dir=config.get("run_dir"), model_spec=config["model"])
