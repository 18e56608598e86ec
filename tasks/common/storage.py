"""Where everything lives under the storage root, and how files get there safely.

Every path a stage reads or writes is built here, from the storage root and the run name:

    <root>/raw/<source>/                  the four IDX .gz files of one data source
    <root>/datasets/mnist-<fingerprint>/  Parquet splits + _manifest.json (shared across runs)
    <root>/runs/<run>/                    the Ray Train run (checkpoints) + summary.json
    <root>/runs/<run>/evaluation/         metrics.json, confusion matrix, predictions
    <root>/locks/                         fcntl locks: one dataset build at a time
    <root>/leases/<run>.json              live runs and the folders they read (cleanup leaves those alone)

Writes are atomic: a temporary name in the same folder, then ``os.replace``, so a reader sees
the old state or the new one, never half a file; folders are published the same way. A full or
read-only storage root fails the stage with `StorageWriteError` naming the path and the fix; the
half-built staging folder is removed, so the last good state stays as it was.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
import socket
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
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


# errno values that mean "the storage cannot take this write", not a bug in the stage.
STORAGE_ERRNOS = {
    errno.ENOSPC: "the storage root is full (no space left on the device)",
    errno.EDQUOT: "the storage quota is exhausted",
    errno.EFBIG: "the file is larger than the storage allows",
    errno.EROFS: "the storage root is mounted read-only",
}


class StorageWriteError(OSError):
    """A stage could not write to the storage root (full, over quota or read-only)."""

    def __str__(self) -> str:  # the message alone, without OSError's "[Errno N]" prefix
        return str(self.args[0]) if self.args else super().__str__()


@contextmanager
def storage_writes(stage: str, where: str | os.PathLike[str] | None = None) -> Iterator[None]:
    """Turn a full or read-only storage root into one clear `StorageWriteError` naming the path.

    ``where``: the folder the stage writes to, named when the error itself carries no file name
    (pyarrow's write errors do not).
    """
    try:
        yield
    except StorageWriteError:
        raise
    except OSError as exc:
        reason = STORAGE_ERRNOS.get(exc.errno or 0)
        if reason is None and where is not None and "No space left on device" in str(exc):
            reason = STORAGE_ERRNOS[errno.ENOSPC]  # pyarrow raises a bare OSError with the text only
        if reason is None:
            raise
        target = exc.filename or (f"under {where}" if where is not None else "to the storage root")
        error = StorageWriteError(
            f"{stage}: cannot write {target}: {reason}. Nothing was published and the previous state is intact; "
            "free space (or make it writable, or pick another --storage-root) and run again with the same --run-name"
        )
        error.errno = exc.errno or errno.ENOSPC
        raise error from exc


@contextmanager
def building(final: Path) -> Iterator[Path]:
    """A staging folder for ``final`` that is removed again when the build fails (see `publish_dir`)."""
    staging = staging_dir(final)
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


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


@contextmanager
def file_lock(layout: StorageLayout, name: str, timeout_s: float = 3600.0) -> Iterator[Path]:
    """Hold an exclusive lock ``<root>/locks/<name>.lock`` (fcntl; shared by every process on this storage).

    Two runs building the same dataset take turns: the second waits, then finds the first's
    verified build and reuses it, so two writers never publish into the same folder.
    """
    path = layout.root_path / "locks" / f"{name}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout_s
    with open(path, "a+") as handle:
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"waited {timeout_s:g}s for {path}, held by another run") from None
                time.sleep(0.5)
        try:
            yield path
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


class RunInUseError(RuntimeError):
    """Another live process is running a run with the same name on the same storage root."""


def _lease_is_live(lease: dict) -> bool:
    if lease.get("host") != socket.gethostname():
        return True  # another machine's process: assume live (it removes its lease when it ends)
    try:
        os.kill(int(lease["pid"]), 0)
    except (ProcessLookupError, KeyError, ValueError, TypeError):
        return False
    except PermissionError:
        return True
    return True


def lease_path(layout: StorageLayout, run_name: str | None = None) -> Path:
    return layout.root_path / "leases" / f"{run_name or layout.run_name}.json"


def live_leases(layout: StorageLayout) -> dict[str, dict]:
    """Leases of live runs on this storage root other than ``layout``'s own: run name -> lease."""
    leases = {}
    for path in sorted((layout.root_path / "leases").glob("*.json")):
        lease = read_json(path)
        if isinstance(lease, dict) and path.stem != layout.run_name and _lease_is_live(lease):
            leases[path.stem] = lease
    return leases


def paths_in_use(layout: StorageLayout) -> list[Path]:
    """Folders other live runs on this storage root read (their raw data and Parquet datasets)."""
    return [Path(p) for lease in live_leases(layout).values() for p in lease.get("uses", [])]


@contextmanager
def run_lease(layout: StorageLayout) -> Iterator[Path]:
    """Mark this run live for its whole duration (``<root>/leases/<run>.json``); refuse a live duplicate."""
    path = lease_path(layout)
    path.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(layout, "leases", timeout_s=60):
        existing = read_json(path)
        if isinstance(existing, dict) and _lease_is_live(existing) and existing.get("pid") != os.getpid():
            raise RunInUseError(
                f"run {layout.run_name!r} is already running on {layout.root} (pid {existing.get('pid')} on "
                f"{existing.get('host')}, lease {path}); pick another run name or wait for it to end"
            )
        atomic_write_json(path, {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), "uses": []})
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)


def lease_uses(layout: StorageLayout, *folders: str) -> None:
    """Record in this run's lease that it reads ``folders``, so other runs' cleanup leaves them alone."""
    path = lease_path(layout)
    lease = read_json(path)
    if isinstance(lease, dict):
        lease["uses"] = sorted(set(lease.get("uses", [])) | set(folders))
        atomic_write_json(path, lease)
