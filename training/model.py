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
from typing import Any

import torch

from storage_io import exists, join, local_copy, read_bytes, sha256_file
from training.models import ModelSpec, resnet18_for

MODEL_FILE = "model.pt"
OPTIMIZER_FILE = "optimizer.pt"
EXTRA_STATE_FILE = "extra_state.pt"
CHECKSUMS_FILE = "_checksums.json"
CHECKPOINT_FILES = (MODEL_FILE, OPTIMIZER_FILE, EXTRA_STATE_FILE)


class IntegrityError(RuntimeError):
    """A checkpoint file does not match the checksum written with it."""


# What a checkpoint holds when its extra_state.pt names no model: every checkpoint written before
# model.name existed, all of them the seeds' one-channel, ten-class ResNet-18.
SEEDS_MODEL = ModelSpec(name="resnet18", in_channels=1, num_classes=10)


def build_resnet18() -> torch.nn.Module:
    """The seeds' model exactly: torchvision ResNet-18 with a one-channel 7x7/stride-2 stem and 10 classes.

    For the seeds' contract (their restore code loads our model.pt into it) and the benchmarks'
    plain PyTorch baselines; the pipeline builds through `training.models.ModelSpec`.
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
    directory = Path(directory)
    torch.save(unwrap(model).state_dict(), directory / MODEL_FILE)
    torch.save(optimizer_state if optimizer_state is not None else optimizer.state_dict(), directory / OPTIMIZER_FILE)
    torch.save(extra_state, directory / EXTRA_STATE_FILE)
    checksums = {name: sha256_file(directory / name) for name in CHECKPOINT_FILES}
    (directory / CHECKSUMS_FILE).write_text(json.dumps(checksums, indent=2, sort_keys=True) + "\n")
    return directory


def verify_checkpoint_file(path: Path, origin: str | None = None) -> None:
    """Raise IntegrityError unless ``path`` matches its sha256 in the folder's _checksums.json.

    ``origin``: the checkpoint folder the messages name (an ``s3://`` URI whose files were
    downloaded to ``path``'s folder); ``path``'s own folder when not given.
    """
    shown = origin or str(path.parent)
    sums_path, path = join(shown, CHECKSUMS_FILE), Path(path)
    local_sums = path.parent / CHECKSUMS_FILE
    try:
        expected = json.loads(local_sums.read_text()).get(path.name)
    except (OSError, ValueError, AttributeError):
        raise IntegrityError(
            f"{sums_path} is missing or unreadable: the checkpoint cannot be verified, so {join(shown, path.name)} is not loaded"
        ) from None
    if expected is None:
        raise IntegrityError(f"{path.name} is not listed in {sums_path}; refusing to load {join(shown, path.name)}")
    if sha256_file(path) != expected:
        raise IntegrityError(
            f"{join(shown, path.name)} does not match its sha256 in {sums_path} (modified or truncated); refusing to load it"
        )


def load_state(directory: str | os.PathLike[str], name: str, origin: str | None = None) -> Any:
    """Load one checkpoint file with ``weights_only=True``: tensors and plain containers only.

    ``directory`` is a local folder; ``origin`` the checkpoint it was downloaded from, for messages.
    """
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


def checkpoint_problem(directory: str | os.PathLike[str]) -> str | None:
    """Why the checkpoint folder ``directory`` (local or ``s3://``) is not complete, or None when it is.

    Complete means: ``_checksums.json`` is there, names model.pt, optimizer.pt and
    extra_state.pt, and every file it names is there with that sha256. A folder whose upload
    stopped early fails one of these (pyarrow copies the files in no fixed order, so the
    checksums may have arrived before a truncated model.pt). A storage error while reading
    (other than a missing file) is raised, not taken for an answer.
    """
    try:
        checksums = json.loads(read_bytes(join(directory, CHECKSUMS_FILE)))
    except FileNotFoundError:
        return f"no {CHECKSUMS_FILE}"
    except ValueError as exc:
        return f"{CHECKSUMS_FILE} is unreadable ({exc})"
    if not isinstance(checksums, dict):
        return f"{CHECKSUMS_FILE} is not a mapping of file names to sha256"
    unlisted = [name for name in CHECKPOINT_FILES if name not in checksums]
    if unlisted:
        return f"{CHECKSUMS_FILE} does not name {', '.join(unlisted)}"
    for name, expected in sorted(checksums.items()):
        path = join(directory, name)
        if not exists(path):
            return f"{name} is missing although {CHECKSUMS_FILE} names it"
        if sha256_file(path) != expected:
            return f"{name} does not match its sha256 (truncated or modified)"
    return None


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
