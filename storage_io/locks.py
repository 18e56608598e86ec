"""Build locks and run leases on the storage root, local or S3.

A build lock (`file_lock`) makes two runs building the same dataset take turns. A run lease
(`run_lease`) marks a run live for its whole duration, refuses a second live run of the same
name, and lists the folders the run reads, so another run's cleanup leaves them alone.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from storage_io.errors import s3_write_error
from storage_io.filesystem import S3_SCHEME, S3Settings, join, list_files, read_bytes, read_json, remove
from storage_io.layout import StorageLayout
from storage_io.paths import StoredPathError, stored_places, to_stored
from storage_io.writes import atomic_write_json


def _holder() -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}


@contextmanager
def file_lock(layout: StorageLayout, name: str, timeout_s: float = 3600.0) -> Iterator[str]:
    """Hold an exclusive lock ``<root>/locks/<name>.lock`` shared by every process on this storage.

    Locally an fcntl lock; on S3 an object created with a conditional PUT (``If-None-Match: *``),
    which exactly one writer wins; a lock left by a dead process on this host is broken.
    Two runs building the same dataset take turns: the second waits, then finds the first's
    verified build and reuses it, so two writers never publish into the same folder.
    """
    path = join(layout.root, "locks", f"{name}.lock")
    deadline = time.monotonic() + timeout_s
    if layout.remote:
        with _s3_lock(path, deadline, timeout_s):
            yield path
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
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


# Tokens of the S3 locks this process holds right now. A lock object naming this process but a
# token not in here was left by an earlier holder in this process whose release failed (a bucket
# that turned read-only mid-stage, say): it is stale and broken like a dead process's lock.
_HELD_S3_LOCKS: set[str] = set()


@contextmanager
def _s3_lock(uri: str, deadline: float, timeout_s: float) -> Iterator[None]:
    from botocore.exceptions import ClientError  # botocore: only for an s3:// root

    client = S3Settings().boto3_client()
    bucket, _, key = uri[len(S3_SCHEME) :].partition("/")
    token = uuid.uuid4().hex
    body = json.dumps(_holder() | {"token": token}).encode()
    while True:
        try:
            client.put_object(Bucket=bucket, Key=key, Body=body, IfNoneMatch="*")
            break
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") not in ("PreconditionFailed", "ConditionalRequestConflict"):
                raise s3_write_error(exc, uri) from exc
        holder = _lock_holder(uri)
        if holder is _GONE:
            continue  # released meanwhile
        if holder is _NOT_A_LOCK or (isinstance(holder, dict) and _lock_is_stale(holder)):
            # left by a process that died holding it, or not an S3 lock at all: a local root's
            # lock file copied into the bucket with the rest of the root (aws s3 sync)
            client.delete_object(Bucket=bucket, Key=key)
            continue
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s:g}s for {uri}, held by {holder}") from None
        time.sleep(0.5)
    _HELD_S3_LOCKS.add(token)
    try:
        yield
    finally:
        _HELD_S3_LOCKS.discard(token)
        try:
            client.delete_object(Bucket=bucket, Key=key)
        except ClientError as exc:  # never hide the block's own error; the next taker breaks it
            logging.getLogger(__name__).warning("could not release the lock %s (%s); it is broken when taken next", uri, exc)


_GONE, _NOT_A_LOCK = object(), object()


def _lock_holder(uri: str):
    """The holder an S3 lock object names; _GONE when it is not there; _NOT_A_LOCK when its body is
    no holder (every S3 lock is written whole, with its holder, in one PUT); None when it cannot be read now."""
    try:
        body = read_bytes(uri)
    except FileNotFoundError:
        return _GONE
    except OSError:
        return None
    try:
        holder = json.loads(body)
    except ValueError:
        return _NOT_A_LOCK
    return holder if isinstance(holder, dict) and "pid" in holder else _NOT_A_LOCK


def _lock_is_stale(holder: dict) -> bool:
    """A lock whose process is gone, or one of this process's whose holder has let go."""
    if holder.get("host") == socket.gethostname() and holder.get("pid") == os.getpid():
        return holder.get("token") not in _HELD_S3_LOCKS
    return not _lease_is_live(holder)


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


def lease_path(layout: StorageLayout, run_name: str | None = None) -> str:
    return join(layout.root, "leases", f"{run_name or layout.run_name}.json")


def live_leases(layout: StorageLayout) -> dict[str, dict]:
    """Leases of live runs on this storage root other than ``layout``'s own: run name -> lease."""
    leases = {}
    folder = join(layout.root, "leases")
    for name in list_files(folder, ".json"):
        run = name.removesuffix(".json")
        lease = read_json(join(folder, name))
        if "/" not in run and isinstance(lease, dict) and run != layout.run_name and _lease_is_live(lease):
            leases[run] = lease
    return leases


def paths_in_use(layout: StorageLayout) -> list[str]:
    """Folders other live runs on this storage root read (their raw data and Parquet datasets).

    A lease stores them relative to the root (`storage_io.paths`); an older lease's absolute path
    counts as itself and as the same place under this root when that exists (a copied root).
    """
    places: list[str] = []
    for run, lease in live_leases(layout).items():
        uses = lease.get("uses", [])
        for stored in uses if isinstance(uses, list) else [uses]:
            try:
                found = stored_places(layout.root, stored, existing_only=True)
            except StoredPathError as exc:
                raise ValueError(f"{lease_path(layout, run)}: damaged lease ({exc}); cannot tell which folders run {run!r} reads") from exc
            places += [place for place in found if place not in places]
    return places


@contextmanager
def run_lease(layout: StorageLayout) -> Iterator[str]:
    """Mark this run live for its whole duration (``<root>/leases/<run>.json``); refuse a live duplicate."""
    path = lease_path(layout)
    with file_lock(layout, "leases", timeout_s=60):
        existing = read_json(path)
        if isinstance(existing, dict) and _lease_is_live(existing) and existing.get("pid") != os.getpid():
            raise RunInUseError(
                f"run {layout.run_name!r} is already running on {layout.root} (pid {existing.get('pid')} on "
                f"{existing.get('host')}, lease {path}); pick another run name or wait for it to end"
            )
        atomic_write_json(path, _holder() | {"uses": []})
    try:
        yield path
    finally:
        remove(path)


def lease_uses(layout: StorageLayout, *folders: str) -> None:
    """Record in this run's lease that it reads ``folders``, so other runs' cleanup leaves them alone."""
    path = lease_path(layout)
    lease = read_json(path)
    if isinstance(lease, dict):
        stored = {to_stored(layout.root, folder) for folder in folders}  # relative to the root: it can move
        lease["uses"] = sorted(set(lease.get("uses", [])) | stored)
        atomic_write_json(path, lease)
