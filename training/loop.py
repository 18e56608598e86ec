"""The per-worker training loop Ray Train runs on every rank (``train_loop_per_worker``).

Recipe: AdamW with a one-cycle schedule (linear warm-up, cosine decay), label smoothing, random
shifts / rotations / zoom (applied in the Ray Data transform) and an exponential moving average
(EMA) of the weights, which is what gets validated and saved as ``model.pt``. Every rank reports
every epoch; rank 0 attaches a checkpoint in the seeds' format (model.pt / optimizer.pt /
extra_state.pt, the latter also holding the raw training weights so a resume is exact).

With ``checkpoint_every_steps`` > 0 every rank also reports every K optimizer steps, and the
checkpoint records the data position (`Position`): the epoch, its steps done and the ``row_id``s
they consumed, gathered from all ranks. Each epoch's order and augmentation are fixed by (seed,
epoch) (`dataset.transform.build_split`); a restart with any world size rebuilds the interrupted
epoch without the consumed rows (`EpochShards`), so every row is trained on once per epoch and
the rest come in the order they would have.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullStateDictConfig, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.optim.swa_utils import AveragedModel

from dataset.transform import TransformSpec, build_split, fits_in_memory
from storage_io import append_line, atomic_write_bytes, exists, join, read_lines, remove, storage_write_error, storage_writes
from training.faults import FaultInjector
from training.models import ModelSpec, configure_cpu
from training.model import (
    EXTRA_STATE_FILE,
    MODEL_FILE,
    OPTIMIZER_FILE,
    load_state,
    save_checkpoint_files,
    unwrap,
)

logger = logging.getLogger(__name__)


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


def make_optimizer(model: torch.nn.Module, learning_rate: float, weight_decay: float) -> torch.optim.AdamW:
    """The recipe's AdamW, with PyTorch's fused kernel: one pass over the weights a step.

    The default (per-tensor) AdamW step took about a third as long as a whole forward and backward
    pass of ResNet-18 at batch 64 on a 2-core CPU; the fused one about a twentieth (docs/performance.md).
    """
    return torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=weight_decay, fused=True)


def make_ema(model: torch.nn.Module, decay: float) -> AveragedModel | None:
    """An EMA copy of the unwrapped model (buffers included), or None when ``decay`` is 0.

    Averaged a dtype group at a time (``multi_avg_fn``, one ``_foreach_lerp_`` for the float
    weights), not a tensor at a time: per tensor it cost about as much as the default AdamW step.
    """
    if decay <= 0:
        return None

    @torch.no_grad()
    def average(averaged: list[torch.Tensor], current: list[torch.Tensor], updates: torch.Tensor) -> None:
        d = ema_decay_at(decay, int(updates))
        if torch.is_floating_point(averaged[0]):
            torch._foreach_lerp_(averaged, current, 1.0 - d)
        else:  # BatchNorm's num_batches_tracked
            for a, c in zip(averaged, current, strict=True):
                a.copy_(a * d + c * (1.0 - d))

    return AveragedModel(unwrap(model), multi_avg_fn=average, use_buffers=True)


def inference_model(model: torch.nn.Module, ema: AveragedModel | None) -> torch.nn.Module:
    """The weights to validate and ship: the EMA when there is one, else the model itself."""
    return ema.module if ema is not None else unwrap(model)


@dataclass
class Position:
    """Where a training attempt starts: the epoch, the optimizer steps of it already done and their rows.

    ``consumed`` holds the ``row_id``s that the steps before ``step`` trained on (every rank's,
    gathered into the checkpoint), so a resumed epoch trains on exactly the rest.
    """

    epoch: int = 0
    step: int = 0
    consumed: torch.Tensor | None = None


def restore(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ema: AveragedModel | None) -> Position:
    """Load the latest checkpoint Ray Train hands this attempt, if any; return where to go on from."""
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return Position()
    with checkpoint.as_directory() as ckpt_dir:
        return load_checkpoint(ckpt_dir, model, optimizer, ema)


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """``optimizer.load_state_dict(state)``, keeping this optimizer's kernel (fused or not).

    A state dict carries its writer's ``fused`` and ``foreach`` flags, which loading would adopt:
    a checkpoint written before the fused AdamW would turn it off for the rest of the run.
    """
    kernels = [{key: group.get(key) for key in ("fused", "foreach")} for group in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for group, kept in zip(optimizer.param_groups, kernels, strict=True):
        group.update(kept)
        if kept["fused"]:  # the fused kernel wants each step count as a float32 tensor beside its weight
            for param in group["params"]:
                param_state = optimizer.state.get(param, {})
                if torch.is_tensor(param_state.get("step")):
                    param_state["step"] = param_state["step"].to(device=param.device, dtype=torch.float32)


def load_checkpoint(ckpt_dir: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, ema: AveragedModel | None) -> Position:
    """Load weights, optimizer and EMA state from a checkpoint folder; return where to go on from."""
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
    load_optimizer_state(optimizer, optimizer_state)
    if "position" in extra:  # a mid-epoch checkpoint
        position = extra["position"]
        return Position(int(position["epoch"]), int(position["step"]), position["row_ids"])
    return Position(int(extra["epoch"]) + 1)


def checkpoint_extra(
    metrics: dict, model, epoch: int, ema: AveragedModel | None, position: dict | None = None, model_spec: dict | None = None,
) -> dict[str, Any]:
    """``extra_state.pt``: the seeds' ``epoch`` (last completed), metrics, what an exact resume needs, and
    ``model``: the `training.models.ModelSpec` the weights belong to (``model_spec``)."""
    extra: dict[str, Any] = {"epoch": epoch, "metrics": metrics}
    if model_spec is not None:
        extra["model"] = dict(model_spec)
    if position is not None:
        extra["position"] = position
    if ema is not None:
        extra |= {"train_weights": unwrap(model).state_dict(), "ema_updates": int(ema.n_averaged)}
    return extra


HISTORY_FILE = "history.jsonl"


def read_history(path: str) -> list[dict]:
    """Every finished epoch's metrics from ``history.jsonl`` (empty when there is none)."""
    return read_lines(path)


def record_epoch(path: str, metrics: dict) -> list[dict]:
    """Add one epoch's metrics to ``history.jsonl``, replacing that epoch and any later one.

    The run's per-epoch record for the training curves and benchmarks. Ray Train V2's
    ``Result.metrics_dataframe`` holds only the kept checkpoints' metrics (num_to_keep of them),
    so it cannot be the history. An epoch rerun after a restart replaces what the failed attempt
    wrote from that epoch on. Rewritten whole (atomic rename, or one PUT on S3): one short line per epoch.
    """
    rows = [row for row in read_history(path) if row["epoch"] < metrics["epoch"]] + [metrics]
    atomic_write_bytes(path, "".join(json.dumps(row) + "\n" for row in rows).encode())
    return rows


def process_start_time() -> float | None:
    """Wall-clock time this process started (Linux: /proc/self/stat field 22 after the boot time), None elsewhere."""
    try:
        with open("/proc/self/stat") as handle:
            ticks = int(handle.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as handle:
            boot = next(int(line.split()[1]) for line in handle if line.startswith("btime"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def record_attempt(path: str, start: Position, world_size: int) -> None:
    """Append one line per training attempt (Ray Train restart or Prefect retry) to ``train_attempts.jsonl``.

    ``time`` is when the attempt's model is ready; ``process_started_at`` when its (rank 0) worker
    process started, which splits a worker group's start (benchmarks/deployment_overhead.py).
    """
    append_line(path, {"start_epoch": start.epoch, "start_step": start.step, "world_size": world_size, "time": time.time(),
                       "process_started_at": process_start_time()})


def wait_for_committed_reports() -> None:
    """Block until Ray Train's controller has taken in every report so far (checkpoints committed).

    Ray Train V2 reports are queued on each worker and collected by the controller's status poll
    (every ``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S``, 2 s); a worker that dies first takes its queued
    report with it and the restart resumes from the checkpoint before. Fault injection calls this
    before it fires so a test knows which checkpoint the restart must use.
    """
    ray.train.get_all_reported_checkpoints(consistency_mode=ray.train.CheckpointConsistencyMode.COMMITTED, timeout_s=120)


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
        self.faults = FaultInjector(fault_dir, rank, settle=wait_for_committed_reports) if fault_dir else None
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


class RowLog:
    """Test-only record of the ``row_id``s a rank trained on, one JSON line per step.

    Written only when the driver sets ``MNIST_RECORD_ROWS`` (training.faults); the exactly-once
    test reads it back. One file per rank and attempt: ``<run>/row_log/from-e<E>s<S>-w<W>-rank<R>.jsonl``.
    """

    def __init__(self, directory: str, start: Position, world_size: int, rank: int):
        self.path = join(directory, f"from-e{start.epoch}s{start.step}-w{world_size}-rank{rank}.jsonl")

    def write(self, epoch: int, step: int, row_ids: torch.Tensor) -> None:
        append_line(self.path, {"epoch": epoch, "step": step, "rows": row_ids.tolist()})


def gather_rows(local: list[torch.Tensor]) -> torch.Tensor:
    """Every rank's consumed ``row_id``s since the epoch (or attempt) began, concatenated (a collective)."""
    mine = torch.cat(local) if local else torch.empty(0, dtype=torch.int64)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return mine
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return torch.cat(everyone)


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


class _StateDictView(torch.nn.Module):
    """Stands in for a model whose full state dict was already gathered (FSDP)."""

    def __init__(self, state: dict):
        super().__init__()
        self._state = state

    def state_dict(self, *args, **kwargs):  # noqa: D102 - same contract as nn.Module
        return self._state


# Mid-epoch checkpoints are reported with the worst possible scores: they exist to resume from
# (Ray Train always keeps the latest checkpoint), never to be picked as the best one.
MID_EPOCH_SCORES = {"val_loss": 1e30, "val_accuracy": -1.0}


def checkpoint_dir_name(epoch: int, step: int | None = None) -> str:
    """The folder name of a checkpoint in the run folder: ``checkpoint_epoch-0003`` at the end of epoch 3,
    ``checkpoint_epoch-0003_step-000120`` after step 120 of it.

    Known before the upload starts, so a failed upload's folder can be removed by name.
    """
    name = f"checkpoint_epoch-{epoch:04d}"
    return name if step is None else f"{name}_step-{step:06d}"


def unused_checkpoint_dir(run_dir: str, name: str) -> str:
    """``name``, or ``name_retry-N`` when the run folder already has a folder of that name.

    Ray Train uploads into an existing folder file by file and would then track two checkpoints
    under one path (deleting the older as ``num_to_keep`` says deletes the newer one too). An
    epoch is reported again under a name that exists only when an earlier attempt's folder was
    never registered (its upload failed and could not be removed, or the worker died before the
    controller took the report in); that folder stays as it is and cleanup judges it.
    """
    candidate, n = name, 0
    while exists(join(run_dir, candidate)):
        n += 1
        candidate = f"{name}_retry-{n}"
    return candidate


def discard_failed_upload(path: str) -> None:
    """Remove the folder of a checkpoint whose upload failed.

    Ray Train never registered it, so nothing else would: left behind it holds the space the
    restart needs and, with ``_checksums.json`` copied before a truncated model.pt, looks like a
    checkpoint. When even removing fails (a read-only root), cleanup finds it later as incomplete.
    """
    try:
        remove(path)
    except Exception as exc:  # noqa: BLE001 - the upload's own error is the one to raise
        logger.warning("could not remove the partly uploaded checkpoint %s (%s); cleanup removes it later", path, exc)
    else:
        logger.warning("removed the partly uploaded checkpoint %s", path)


def report(
    metrics: dict, model, optimizer, epoch: int, ema: AveragedModel | None = None, position: dict | None = None,
    run_dir: str | None = None, model_spec: dict | None = None,
) -> None:
    """Report on every rank; rank 0 attaches the checkpoint (model, optimizer, extra state).

    ``extra_state.pt`` keeps the seeds' meaning of ``epoch`` (the last completed epoch); a
    mid-epoch checkpoint adds ``position`` (epoch in progress, steps done, consumed row_ids).
    With ``run_dir`` (Ray Train's run folder) the checkpoint gets a `checkpoint_dir_name` there;
    when its upload fails, rank 0 removes the folder and raises, a full or read-only storage root
    as a `StorageWriteError` naming the folder.
    """
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
        checkpoint, name, target = None, None, None
        if ray.train.get_context().get_world_rank() == 0:
            extra = checkpoint_extra(metrics, model, epoch, ema, position, model_spec)
            save_checkpoint_files(tmp, inference_model(model, ema), optimizer, extra, optimizer_state)
            checkpoint = ray.train.Checkpoint.from_directory(tmp)
            if run_dir is not None:  # only rank 0's name counts: Ray Train broadcasts it to the others
                name = unused_checkpoint_dir(run_dir, checkpoint_dir_name(metrics["epoch"], metrics.get("step")))
                target = join(run_dir, name)
        try:
            ray.train.report(metrics, checkpoint=checkpoint, checkpoint_dir_name=name)
        except Exception as exc:
            if target is None:
                raise
            discard_failed_upload(target)  # a fresh name: the folder is this upload's alone
            error = storage_write_error("train", exc, target)
            if error is None:
                raise
            raise error from exc


def report_mid_epoch(
    position: dict, model, optimizer, ema: AveragedModel | None, run_dir: str | None = None, model_spec: dict | None = None,
) -> None:
    """Report a mid-epoch checkpoint carrying the data position (see `report`)."""
    metrics = {"epoch": position["epoch"], "step": position["step"], "mid_epoch": 1, **MID_EPOCH_SCORES}
    report(metrics, model, optimizer, position["epoch"] - 1, ema, position, run_dir, model_spec)


class EpochShards:
    """Each rank's share of an epoch's training rows, in the epoch's (seed, epoch) order.

    Built per epoch, not once for the run, because the order depends on the epoch, without the
    rows ``start`` says an interrupted attempt already trained on when resuming that epoch, and
    split across the current world size (which may differ from the failed attempt's). A training
    split held in memory (`dataset.transform.fits_in_memory`) is cut by every rank itself
    (`build_split(part=...)`): no coordinator, nothing sent between ranks. A streamed one is built
    by rank 0 and split with ``streaming_split``, whose coordinator actor takes seconds to start,
    so the next epoch's split is set up while this one trains; the other ranks receive their
    iterators from it, as Ray Train hands out `get_dataset_shard` iterators. One worker iterates
    its pipeline directly.
    """

    def __init__(self, config: dict[str, Any], start: Position, rank: int, world_size: int):
        self.config, self.start, self.rank, self.world_size = config, start, rank, world_size
        self.spec = TransformSpec.model_validate(config["transform"])
        self.per_rank = world_size == 1 or fits_in_memory(self.spec, "train")
        self._ahead: dict[int, Any] = {}

    def _build(self, epoch: int):
        resuming = epoch == self.start.epoch and self.start.consumed is not None
        exclude = self.start.consumed.numpy() if resuming else None
        if self.per_rank:
            part = (self.rank, self.world_size) if self.world_size > 1 else None
            return build_split(self.spec, "train", self.config["seed"], epoch, exclude=exclude, part=part)
        dataset = build_split(self.spec, "train", self.config["seed"], epoch, exclude=exclude)
        return dataset.streaming_split(self.world_size, equal=True)

    def __call__(self, epoch: int):
        if self.per_rank:
            return self._build(epoch)
        splits: list[Any] = [None]
        if self.rank == 0:
            splits = [self._ahead.pop(epoch, None) or self._build(epoch)]
            if epoch + 1 < self.config["epochs"]:
                self._ahead[epoch + 1] = self._build(epoch + 1)
        dist.broadcast_object_list(splits, src=0)
        return splits[0][self.rank]


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
