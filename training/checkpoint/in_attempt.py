"""Checkpoints inside a training attempt: where to resume from, what ``extra_state.pt`` holds, and the report.

Every rank reports every epoch (and every ``checkpoint_every_steps`` steps when set); rank 0
attaches a checkpoint in the seeds' format (model.pt / optimizer.pt / extra_state.pt, the latter
also holding the raw training weights so a resume is exact) under a folder name known before its
upload (`checkpoint_dir_name`), so a failed upload can be removed by name. A mid-epoch checkpoint
records the data position (`Position`): the epoch, its steps done and the ``row_id``s they consumed.
"""

from __future__ import annotations

import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import ray.train
import torch
from torch.optim.swa_utils import AveragedModel

from storage_io import exists, join, remove, storage_write_error
from training.checkpoint.files import EXTRA_STATE_FILE, MODEL_FILE, OPTIMIZER_FILE
from training.checkpoint.model_files import load_state, save_checkpoint_files, unwrap
from training.manifests import Position
from training.model.weights import StartWeights
from training.worker.recipe import inference_model

logger = logging.getLogger(__name__)


def _fsdp_of(model):
    """``torch.distributed.fsdp`` when ``model`` is wrapped in FSDP, else None. Whoever wrapped it imported
    the module, so it is only looked up: importing it here cost 0.75-1.4 s in every process that imports
    this one (2-core AMD EPYC Zen 4), for a strategy that needs GPUs."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp if fsdp is not None and isinstance(model, fsdp.FullyShardedDataParallel) else None


def restore(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, ema: AveragedModel | None, scaler: torch.amp.GradScaler | None = None,
) -> Position:
    """Load the latest checkpoint Ray Train hands this attempt, if any; return where to go on from."""
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return Position()
    with checkpoint.as_directory() as ckpt_dir:
        return load_checkpoint(ckpt_dir, model, optimizer, ema, scaler)


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """``optimizer.load_state_dict(state)``, keeping this optimizer's kernel (fused or not).

    A state dict carries its writer's ``fused``, ``foreach`` and ``capturable`` flags, which loading would adopt:
    a checkpoint written before the fused AdamW would turn it off for the rest of the run, and one written by a
    captured GPU step (`training.worker.captured_step`) would make a CPU run's AdamW refuse to step.
    """
    kernels = [{key: group.get(key) for key in ("fused", "foreach", "capturable")} for group in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for group, kept in zip(optimizer.param_groups, kernels, strict=True):
        group.update(kept)
        if kept["fused"]:  # the fused kernel wants each step count as a float32 tensor beside its weight
            for param in group["params"]:
                param_state = optimizer.state.get(param, {})
                if torch.is_tensor(param_state.get("step")):
                    param_state["step"] = param_state["step"].to(device=param.device, dtype=torch.float32)


def load_checkpoint(
    ckpt_dir: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, ema: AveragedModel | None,
    scaler: torch.amp.GradScaler | None = None,
) -> Position:
    """Load weights, optimizer, EMA and (fp16) gradient-scaler state from a checkpoint folder; return where to go on from.

    A checkpoint without the scaler's state (written in another precision, or before it was kept)
    leaves ``scaler`` at its start: its scale is found again within a few steps."""
    shipped = load_state(ckpt_dir, MODEL_FILE)
    extra = load_state(ckpt_dir, EXTRA_STATE_FILE)
    optimizer_state = load_state(ckpt_dir, OPTIMIZER_FILE)
    fsdp = _fsdp_of(model)
    if fsdp is not None:  # full (unsharded) files; FSDP re-shards them on load
        with fsdp.FullyShardedDataParallel.state_dict_type(model, fsdp.StateDictType.FULL_STATE_DICT):
            model.load_state_dict(extra.get("train_weights", shipped))
            optimizer_state = fsdp.FullyShardedDataParallel.optim_state_dict_to_load(model, optimizer, optimizer_state)
    else:
        unwrap(model).load_state_dict(extra.get("train_weights", shipped))
    if ema is not None:
        ema.module.load_state_dict(shipped)
        ema.n_averaged.fill_(int(extra.get("ema_updates", 1)))
    load_optimizer_state(optimizer, optimizer_state)
    if scaler is not None and scaler.is_enabled() and isinstance(extra.get("grad_scaler"), dict) and extra["grad_scaler"]:
        scaler.load_state_dict(extra["grad_scaler"])
    if "position" in extra:  # a mid-epoch checkpoint
        position = extra["position"]
        return Position(int(position["epoch"]), int(position["step"]), position["row_ids"])
    return Position(int(extra["epoch"]) + 1)


def checkpoint_extra(
    metrics: dict, model, epoch: int, ema: AveragedModel | None, position: dict | None = None, model_spec: dict | None = None,
    precision: str | None = None, scaler: torch.amp.GradScaler | None = None,
) -> dict[str, Any]:
    """``extra_state.pt``: the seeds' ``epoch`` (last completed), metrics, what an exact resume needs, and
    ``model``: the `training.model.catalog.ModelSpec` the weights belong to (``model_spec``); ``weights``: what a fresh
    start loaded (``model_spec``'s ``weights``, `training.model.weights.StartWeights.record`: source, file, sha256);
    ``precision``: the training step's (bf16, fp16, fp32; `training.worker.device.resolve_precision`); ``grad_scaler``:
    fp16's gradient scaler (``scaler``): its scale and growth count, so a resumed run does not start
    over from a scale its gradients overflow."""
    extra: dict[str, Any] = {"epoch": epoch, "metrics": metrics}
    if precision is not None:
        extra["precision"] = precision
    if scaler is not None and scaler.is_enabled():  # a disabled scaler's state is empty, and would not load
        extra["grad_scaler"] = scaler.state_dict()
    if model_spec is not None:
        extra["model"] = {key: value for key, value in model_spec.items() if key != "weights"}
        if model_spec.get("weights"):
            extra["weights"] = StartWeights.model_validate(model_spec["weights"]).record()
    if position is not None:
        extra["position"] = position
    if ema is not None:
        extra |= {"train_weights": unwrap(model).state_dict(), "ema_updates": int(ema.n_averaged)}
    return extra


def wait_for_committed_reports() -> None:
    """Block until Ray Train's controller has taken in every report so far (checkpoints committed).

    Ray Train V2 reports are queued on each worker and collected by the controller's status poll
    (every ``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S``, 2 s); a worker that dies first takes its queued
    report with it and the restart resumes from the checkpoint before. Fault injection calls this
    before it fires so a test knows which checkpoint the restart must use.
    """
    ray.train.get_all_reported_checkpoints(consistency_mode=ray.train.CheckpointConsistencyMode.COMMITTED, timeout_s=120)


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
    run_dir: str | None = None, model_spec: dict | None = None, precision: str | None = None,
    scaler: torch.amp.GradScaler | None = None,
) -> float | None:
    """Report on every rank; rank 0 attaches the checkpoint (model, optimizer, extra state) and returns the seconds
    writing its files took (the rest of a report is Ray Train's upload and bookkeeping); None on other ranks.

    ``extra_state.pt`` keeps the seeds' meaning of ``epoch`` (the last completed epoch); a
    mid-epoch checkpoint adds ``position`` (epoch in progress, steps done, consumed row_ids).
    With ``run_dir`` (Ray Train's run folder) the checkpoint gets a `checkpoint_dir_name` there;
    when its upload fails, rank 0 removes the folder and raises, a full or read-only storage root
    as a `StorageWriteError` naming the folder.
    """
    optimizer_state = None
    fsdp = _fsdp_of(model)
    if fsdp is not None:
        # Gathering full weights and optimizer state is a collective: every rank takes part and
        # rank 0 writes them, so the checkpoint loads into a plain ResNet-18. (Not exercised
        # here: PyTorch FSDP needs GPUs, and the test machine has none.)
        config = fsdp.FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with fsdp.FullyShardedDataParallel.state_dict_type(model, fsdp.StateDictType.FULL_STATE_DICT, config):
            full_state = model.state_dict()
            optimizer_state = fsdp.FullyShardedDataParallel.optim_state_dict(model, optimizer)
        model = _StateDictView(full_state)
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint, name, target, saved_in = None, None, None, None
        if ray.train.get_context().get_world_rank() == 0:
            began = time.perf_counter()
            extra = checkpoint_extra(metrics, model, epoch, ema, position, model_spec, precision, scaler)
            save_checkpoint_files(tmp, inference_model(model, ema), optimizer, extra, optimizer_state)
            saved_in = round(time.perf_counter() - began, 4)
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
    return saved_in


def report_mid_epoch(
    position: dict, model, optimizer, ema: AveragedModel | None, run_dir: str | None = None, model_spec: dict | None = None,
    precision: str | None = None, scaler: torch.amp.GradScaler | None = None,
) -> None:
    """Report a mid-epoch checkpoint carrying the data position (see `report`)."""
    metrics = {"epoch": position["epoch"], "step": position["step"], "mid_epoch": 1, **MID_EPOCH_SCORES}
    report(metrics, model, optimizer, position["epoch"] - 1, ema, position, run_dir, model_spec, precision, scaler)
