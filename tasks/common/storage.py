"""Where everything lives under the storage root, and how files get there safely.

Every path a stage reads or writes is built here, from the storage root and the run name:

    <root>/raw/<source>/                  the four IDX .gz files of one data source
    <root>/datasets/mnist-<fingerprint>/  Parquet splits + _manifest.json (shared across runs)
    <root>/runs/<run>/                    the Ray Train run (checkpoints) + summary.json
    <root>/runs/<run>/evaluation/         metrics.json, confusion matrix, predictions

Writes are atomic: a temporary name in the same folder, then ``os.replace``, so a reader sees
the old state or the new one, never half a file; folders are published the same way.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

MANIFEST = "_manifest.json"


class StorageLayout(BaseModel):
    """Paths of one run under one storage root (passed to every stage)."""

    model_config = ConfigDict(frozen=True)

    root: str
    run_name: str

    @classmethod
    def create(cls, root: str, run_name: str) -> StorageLayout:
        """Layout with ``root`` made absolute (relative roots are relative to the working directory)."""
        return cls(root=str(Path(root).expanduser().absolute()), run_name=run_name)

    @property
    def root_path(self) -> Path:
        return Path(self.root)

    def raw_dir(self, source_key: str) -> Path:
        return self.root_path / "raw" / source_key

    def dataset_dir(self, fingerprint: str) -> Path:
        return self.root_path / "datasets" / f"mnist-{fingerprint}"

    @property
    def runs_dir(self) -> Path:
        return self.root_path / "runs"

    @property
    def run_dir(self) -> Path:
        return self.runs_dir / self.run_name

    @property
    def summary_path(self) -> Path:
        return self.run_dir / "summary.json"

    @property
    def evaluation_dir(self) -> Path:
        return self.run_dir / "evaluation"

    def contains(self, path: str | os.PathLike[str]) -> bool:
        """True when ``path`` (symlinks resolved) lies strictly inside the storage root."""
        root = self.root_path.resolve()
        target = Path(path).resolve()
        return target != root and target.is_relative_to(root)


def sha256_file(path: str | os.PathLike[str], chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def sha256_json(obj: Any) -> str:
    """Hex sha256 of the canonical JSON form of ``obj``."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` through a temporary file in the same folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_json(path: str | os.PathLike[str], obj: Any) -> Path:
    """Write ``obj`` as indented JSON, atomically."""
    return atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def read_json(path: str | os.PathLike[str]) -> Any | None:
    """Parsed JSON at ``path``, or None when the file is missing or unreadable as JSON."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def staging_dir(final: Path) -> Path:
    """A fresh, empty sibling folder to build ``final`` in before publishing it."""
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = final.parent / f".{final.name}.{uuid.uuid4().hex[:8]}.staging"
    staging.mkdir()
    return staging


def publish_dir(staging: Path, final: Path) -> Path:
    """Move a fully written ``staging`` folder to ``final`` in one rename.

    An existing ``final`` (an earlier, incomplete or stale build) is moved aside first and
    removed only after the new folder is in place.
    """
    old = None
    if final.exists():
        old = final.parent / f".{final.name}.{uuid.uuid4().hex[:8]}.old"
        os.replace(final, old)
    os.replace(staging, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final
