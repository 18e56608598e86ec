"""A checkpoint folder's files and their checksums, without torch: names, verification, completeness.

What reads or checks a checkpoint folder without loading it (cleanup, the model registry, storage
checks) imports this; loading the weights is `training.checkpoint.model_files`'s (torch).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from storage_io import exists, join, read_bytes, sha256_file
from training.model.catalog import ModelSpec

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
