"""Atomic writes and publishing a folder whole.

A file is written locally under a temporary name in its folder, then ``os.replace``d; on S3 in
one PUT (an object appears whole or not at all). A folder is built in a local staging folder
(`building`) and published (`publish_dir`) locally with one rename and on S3 by uploading every
file with ``_manifest.json`` last: readers trust a folder only when its manifest verifies.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs

from storage_io.errors import s3_write_error
from storage_io.filesystem import basename, filesystem, is_dir, is_file, is_remote, join, read_bytes, remove

MANIFEST = "_manifest.json"


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> str:
    """Write ``data`` to ``path``: locally through a temporary file in the same folder, on S3 in one PUT."""
    if is_remote(path):
        fs, where = filesystem(path)
        try:
            with fs.open_output_stream(where, compression=None) as handle:
                handle.write(data)
        except OSError as exc:
            raise s3_write_error(exc, str(path)) from exc
        return str(path)
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
    return str(path)


def atomic_write_json(path: str | os.PathLike[str], obj: Any) -> str:
    """Write ``obj`` as indented JSON, atomically."""
    return atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def append_line(path: str | os.PathLike[str], obj: Any) -> None:
    """Add one JSON line to a small log (S3 has no append: the object is rewritten)."""
    line = json.dumps(obj) + "\n"
    if is_remote(path):
        old = read_bytes(path) if is_file(path) else b""
        atomic_write_bytes(path, old + line.encode())
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:  # one short line per call; appends are atomic enough for a log
        handle.write(line)


@contextmanager
def local_copy(
    path: str | os.PathLike[str], write_back: bool = False, names: tuple[str, ...] | None = None
) -> Iterator[Path]:
    """A local folder holding ``path``'s files: the folder itself when it is local.

    For an ``s3://`` folder the files (or only those of ``names`` that exist) are downloaded into
    a temporary folder; with ``write_back`` every file there that is new or changed is uploaded
    again when the block ends without an error.
    """
    if not is_remote(path):
        if write_back:
            Path(path).mkdir(parents=True, exist_ok=True)
        yield Path(path)
        return
    fs, where = filesystem(path)
    with tempfile.TemporaryDirectory(prefix="mnist-s3-") as tmp:
        if names is not None:
            for name in names:
                try:  # one GET per file; a missing one is simply not there locally either
                    Path(tmp, name).write_bytes(read_bytes(join(path, name)))
                except FileNotFoundError:
                    pass
        elif is_dir(path):
            pafs.copy_files(where, tmp, source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem())
        before = _snapshot(Path(tmp))
        yield Path(tmp)
        if write_back:  # only what is new or changed
            upload_dir(Path(tmp), path, only={n for n, stat in _snapshot(Path(tmp)).items() if before.get(n) != stat})


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*") if p.is_file()}


def upload_dir(local: Path, path: str | os.PathLike[str], last: str | None = None, only: set[str] | None = None) -> None:
    """Copy every file (or those named in ``only``) under the local folder ``local`` to ``path``.

    The file named ``last`` goes last (a manifest: the folder verifies only once it is complete).
    """
    names = sorted(str(p.relative_to(local)) for p in local.rglob("*") if p.is_file())
    names = [n for n in names if only is None or n in only]
    if last in names:
        names.remove(last)
        names.append(last)
    for name in names:
        atomic_write_bytes(join(path, *name.split(os.sep)), (local / name).read_bytes())


@contextmanager
def building(final: str) -> Iterator[Path]:
    """A local staging folder for ``final`` that is removed again when the build fails (see `publish_dir`).

    Locally a sibling of ``final`` (so publishing is one rename); for an S3 ``final`` a temporary folder.
    """
    staging = staging_dir(final)
    try:
        yield staging
    finally:
        if staging.exists():  # left over only when the build failed or publishing uploaded copies
            shutil.rmtree(staging, ignore_errors=True)


def staging_dir(final: str) -> Path:
    """A fresh, empty local folder to build ``final`` in before publishing it."""
    if is_remote(final):
        return Path(tempfile.mkdtemp(prefix=f".{basename(final)}.", suffix=".staging"))
    final_path = Path(final)
    final_path.parent.mkdir(parents=True, exist_ok=True)
    staging = final_path.parent / f".{final_path.name}.{uuid.uuid4().hex[:8]}.staging"
    staging.mkdir()
    return staging


def publish_dir(staging: Path, final: str) -> str:
    """Make the fully written local ``staging`` folder the content of ``final``.

    Locally one rename: an existing ``final`` (an earlier, incomplete or stale build) is moved
    aside first and removed only after the new folder is in place. On S3 the old objects are
    deleted and every file uploaded, ``_manifest.json`` last, so the folder verifies only once
    it is complete (callers hold the build lock, so no second writer publishes there meanwhile).
    """
    if is_remote(final):
        remove(final)
        upload_dir(staging, final, last=MANIFEST)
        return final
    final_path = Path(final)
    old = None
    if final_path.exists():
        old = final_path.parent / f".{final_path.name}.{uuid.uuid4().hex[:8]}.old"
        os.replace(final_path, old)
    os.replace(staging, final_path)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final
