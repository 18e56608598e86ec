"""The model and its checkpoint files, shared by training, evaluation and anyone restoring a run.

Checkpoint folders keep the seeds' contract so their restore and inference code works on ours:

    model.pt        state dict of the unwrapped model (no ``module.`` prefix)
    optimizer.pt    optimizer state dict
    extra_state.pt  {"epoch": last completed epoch, ...} plus scheduler state and metrics
    _checksums.json sha256 of the three files, verified on every load (a changed or truncated
                    file is refused with an IntegrityError naming it, never loaded)

Loading uses ``torch.load(weights_only=True)``: tensors and plain containers only, nothing else
from storage is unpickled.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from storage_io import join, local_copy, sha256_file
from training.checkpoint.files import (
    CHECKPOINT_FILES,
    CHECKSUMS_FILE,
    EXTRA_STATE_FILE,
    MODEL_FILE,
    OPTIMIZER_FILE,
    SEEDS_MODEL,
    verify_checkpoint_file,
)
from training.model.catalog import ModelSpec, resnet18_for

if TYPE_CHECKING:  # annotations only: torch is imported where it is used
    import torch


def build_resnet18() -> torch.nn.Module:
    """The seeds' model exactly: torchvision ResNet-18 with a one-channel 7x7/stride-2 stem and 10 classes.

    For the seeds' contract (their restore code loads our model.pt into it) and the benchmarks'
    plain PyTorch baselines; the pipeline builds through `training.model.catalog.ModelSpec`.
    """
    return resnet18_for(SEEDS_MODEL.in_channels, SEEDS_MODEL.num_classes)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The plain module inside a DDP/FSDP wrapper (or the model itself)."""
    return getattr(model, "module", model)


def save_checkpoint_files(
    directory: str | os.PathLike[str],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    extra_state: dict[str, Any],
    optimizer_state: dict[str, Any] | None = None,
) -> Path:
    """Write model.pt, optimizer.pt and extra_state.pt into ``directory``, then ``_checksums.json``.

    The checksums go last, from the files as written: a folder whose writing stopped early has
    none, so it never names a file that is not there. ``optimizer_state`` overrides
    ``optimizer.state_dict()`` (FSDP gathers a full one itself).
    """
    import torch  # torch: only where a model is built or run

    directory = Path(directory)
    torch.save(unwrap(model).state_dict(), directory / MODEL_FILE)
    torch.save(optimizer_state if optimizer_state is not None else optimizer.state_dict(), directory / OPTIMIZER_FILE)
    torch.save(extra_state, directory / EXTRA_STATE_FILE)
    checksums = {name: sha256_file(directory / name) for name in CHECKPOINT_FILES}
    (directory / CHECKSUMS_FILE).write_text(json.dumps(checksums, indent=2, sort_keys=True) + "\n")
    return directory


def load_state(directory: str | os.PathLike[str], name: str, origin: str | None = None) -> Any:
    """Load one checkpoint file with ``weights_only=True``: tensors and plain containers only.

    ``directory`` is a local folder; ``origin`` the checkpoint it was downloaded from, for messages.
    """
    import torch  # torch: only where a model is built or run

    path = Path(directory) / name
    if not path.is_file():
        try:
            listed = name in json.loads((Path(directory) / CHECKSUMS_FILE).read_text())
        except (OSError, ValueError, TypeError):
            listed = False
        raise FileNotFoundError(
            f"checkpoint file missing: {join(origin or str(directory), name)}"
            + (f" although {CHECKSUMS_FILE} names it (an incomplete checkpoint)" if listed else "")
        )
    verify_checkpoint_file(path, origin)
    return torch.load(path, map_location="cpu", weights_only=True)


def checkpoint_model(directory: str | os.PathLike[str]) -> ModelSpec:
    """The `ModelSpec` a checkpoint folder's extra_state.pt records (`SEEDS_MODEL` for one written before it did)."""
    with local_copy(directory, names=(EXTRA_STATE_FILE, CHECKSUMS_FILE)) as local:
        extra = load_state(local, EXTRA_STATE_FILE, origin=str(directory))
    recorded = extra.get("model") if isinstance(extra, dict) else None
    return ModelSpec.model_validate(recorded) if recorded else SEEDS_MODEL


def load_model(directory: str | os.PathLike[str], spec: ModelSpec | None = None) -> torch.nn.Module:
    """The model in eval mode with the weights of the checkpoint in ``directory`` (a folder or ``s3://`` URI).

    ``spec``: what to build; unset, what the checkpoint's extra_state.pt records (`checkpoint_model`).
    A registry version has no extra_state.pt: its model card's ``architecture`` is the spec.
    """
    spec = spec or checkpoint_model(directory)
    model = spec.build()
    # From S3 only the weights and their checksums are downloaded, then verified like local files.
    with local_copy(directory, names=(MODEL_FILE, CHECKSUMS_FILE)) as local:
        state = load_state(local, MODEL_FILE, origin=str(directory))
    try:
        model.load_state_dict(state)
    except RuntimeError as exc:
        raise ValueError(
            f"{join(directory, MODEL_FILE)} does not hold a model.name={spec.name} with {spec.in_channels} input "
            f"channel(s) and {spec.num_classes} classes: {exc}"
        ) from exc
    return model.eval()
