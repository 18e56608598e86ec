"""Where everything lives under the storage root, and how files get there safely.

The storage root is a local (or mounted) folder or an S3 bucket prefix ``s3://bucket/prefix``.
Every path a stage reads or writes is built here, from the storage root and the run name:

    <root>/raw/<source>/                  the four IDX .gz files of one data source
    <root>/datasets/mnist-<fingerprint>/  Parquet splits + _manifest.json (shared across runs)
    <root>/runs/<run>/                    the Ray Train run (checkpoints) + summary.json
    <root>/runs/<run>/evaluation/         metrics.json, confusion matrix, predictions
    <root>/locks/                         one dataset build at a time (fcntl, or a conditional PUT on S3)
    <root>/leases/<run>.json              live runs and the folders they read (cleanup leaves those alone)

Paths are strings: absolute local paths, or ``s3://`` URIs under an S3 root, so every manifest
and report names the object a user can look up. The helpers below (`read_bytes`,
`atomic_write_bytes`, `list_files`, `remove`, ...) work on both through a pyarrow filesystem,
the one Ray Train and Ray Data use too. S3 endpoint, region and credentials come from the
environment (`S3Settings`), never from flow parameters.

Writes are atomic: locally a temporary name in the same folder, then ``os.replace``; on S3 one
PUT (an object appears whole or not at all). A folder is published locally with one rename and
on S3 by uploading every file and its ``_manifest.json`` last: readers trust a folder only when
its manifest verifies. A full or read-only storage root fails the stage with `StorageWriteError`
naming the path and the fix; the half-built staging folder is removed, so the last good state
stays as it was.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import hashlib
import json
import logging
import os
import posixpath
import shutil
import socket
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

MANIFEST = "_manifest.json"
S3_SCHEME = "s3://"

# The environment variables an S3 storage root reads (forwarded to Ray workers by flows.runtime).
S3_ENV_VARS = (
    "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_REGION", "AWS_DEFAULT_REGION",
    "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
)


class S3Settings(BaseSettings):
    """Endpoint, region and credentials of an ``s3://`` storage root, from the standard AWS variables.

    Never flow parameters: those are stored in the Prefect database and shown in the UI. Unset
    keys fall back to the AWS SDK's own chain (instance profile, ~/.aws).
    """

    model_config = SettingsConfigDict(extra="ignore")

    endpoint_url: str | None = Field(None, validation_alias=AliasChoices("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"))
    region: str | None = Field(None, validation_alias=AliasChoices("AWS_REGION", "AWS_DEFAULT_REGION"))
    access_key_id: str | None = Field(None, validation_alias="AWS_ACCESS_KEY_ID")
    secret_access_key: SecretStr | None = Field(None, validation_alias="AWS_SECRET_ACCESS_KEY")
    session_token: SecretStr | None = Field(None, validation_alias="AWS_SESSION_TOKEN")

    def pyarrow_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"region": self.region} if self.region else {}  # unset: the SDK's chain
        if self.endpoint_url:
            scheme, _, host = self.endpoint_url.partition("://")
            kwargs |= {"endpoint_override": host.rstrip("/"), "scheme": scheme} if host else {"endpoint_override": scheme}
        if self.access_key_id and self.secret_access_key:
            kwargs |= {"access_key": self.access_key_id, "secret_key": self.secret_access_key.get_secret_value()}
            if self.session_token:
                kwargs["session_token"] = self.session_token.get_secret_value()
        return kwargs

    def boto3_client(self):
        import boto3  # only S3 roots need it (conditional PUTs for locks; pyarrow has none)

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name=self.region,
            aws_access_key_id=self.access_key_id,
            aws_secret_access_key=self.secret_access_key.get_secret_value() if self.secret_access_key else None,
            aws_session_token=self.session_token.get_secret_value() if self.session_token else None,
        )


def is_remote(path: str | os.PathLike[str]) -> bool:
    """True for an ``s3://`` URI."""
    return str(path).startswith(S3_SCHEME)


@functools.cache
def _s3_filesystem(settings_json: str) -> pafs.S3FileSystem:
    return pafs.S3FileSystem(**S3Settings.model_validate_json(settings_json).pyarrow_kwargs())


def s3_filesystem() -> pafs.S3FileSystem:
    """The pyarrow S3 filesystem for the current environment's `S3Settings` (one per settings)."""
    settings = S3Settings()
    return _s3_filesystem(_settings_key(settings))


def _settings_key(settings: S3Settings) -> str:
    """The settings as JSON with the secrets in clear (only a cache key, never logged)."""
    data = settings.model_dump()
    data["secret_access_key"] = settings.secret_access_key.get_secret_value() if settings.secret_access_key else None
    data["session_token"] = settings.session_token.get_secret_value() if settings.session_token else None
    return json.dumps(data)


def filesystem(path: str | os.PathLike[str]) -> tuple[pafs.FileSystem, str]:
    """(pyarrow filesystem, path on it) for a local path or an ``s3://`` URI."""
    text = str(path)
    if is_remote(text):
        return s3_filesystem(), text[len(S3_SCHEME) :].rstrip("/")
    return pafs.LocalFileSystem(), str(Path(text).absolute())


def join(base: str | os.PathLike[str], *parts: str) -> str:
    """``base/part/...`` for a local path or an ``s3://`` URI."""
    text = str(base)
    if is_remote(text):
        return "/".join([text.rstrip("/"), *(p.strip("/") for p in parts)])
    return str(Path(text, *parts))


def basename(path: str | os.PathLike[str]) -> str:
    return posixpath.basename(str(path).rstrip("/"))


def parent(path: str | os.PathLike[str]) -> str:
    text = str(path).rstrip("/")
    return text.rsplit("/", 1)[0] if is_remote(text) else str(Path(text).parent)


def _info(path: str | os.PathLike[str]) -> pafs.FileInfo:
    fs, where = filesystem(path)
    return fs.get_file_info(where)


def exists(path: str | os.PathLike[str]) -> bool:
    return _info(path).type != pafs.FileType.NotFound


def is_file(path: str | os.PathLike[str]) -> bool:
    return _info(path).type == pafs.FileType.File


def is_dir(path: str | os.PathLike[str]) -> bool:
    return _info(path).type == pafs.FileType.Directory


def read_bytes(path: str | os.PathLike[str]) -> bytes:
    """The content of a file; FileNotFoundError naming ``path`` when there is none."""
    fs, where = filesystem(path)
    try:
        with fs.open_input_stream(where, compression=None) as handle:
            return handle.readall()
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, "no such file", str(path)) from None
    except OSError as exc:
        if "not found" in str(exc).lower() or "NoSuchKey" in str(exc):
            raise FileNotFoundError(errno.ENOENT, "no such file", str(path)) from exc
        raise


def read_lines(path: str | os.PathLike[str]) -> list[dict]:
    """Every JSON line of a ``.jsonl`` file (empty when there is none)."""
    if not is_file(path):
        return []
    return [json.loads(line) for line in read_bytes(path).decode().splitlines() if line.strip()]


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


def list_files(directory: str | os.PathLike[str], suffix: str = "") -> list[str]:
    """Relative paths (with '/') of every file under ``directory`` ending in ``suffix``, sorted."""
    fs, where = filesystem(directory)
    try:
        infos = fs.get_file_info(pafs.FileSelector(where, recursive=True, allow_not_found=True))
    except NotADirectoryError:
        return []
    return sorted(
        posixpath.relpath(info.path, where) for info in infos if info.type == pafs.FileType.File and info.path.endswith(suffix)
    )


def list_dirs(directory: str | os.PathLike[str]) -> list[str]:
    """Names of the folders directly inside ``directory`` (prefixes on S3), sorted; empty when it is missing."""
    fs, where = filesystem(directory)
    try:
        infos = fs.get_file_info(pafs.FileSelector(where, recursive=False, allow_not_found=True))
    except NotADirectoryError:
        return []
    return sorted(posixpath.basename(info.path.rstrip("/")) for info in infos if info.type == pafs.FileType.Directory)


def total_bytes(path: str | os.PathLike[str]) -> int:
    """Size of a file, or of every file under a folder."""
    fs, where = filesystem(path)
    info = fs.get_file_info(where)
    if info.type == pafs.FileType.File:
        return info.size or 0
    if info.type == pafs.FileType.NotFound:
        return 0
    return sum(i.size or 0 for i in fs.get_file_info(pafs.FileSelector(where, recursive=True)) if i.type == pafs.FileType.File)


def remove(path: str | os.PathLike[str]) -> None:
    """Delete a file or a folder tree (nothing when it is gone already)."""
    if not is_remote(path):
        target = Path(path)
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        else:
            target.unlink(missing_ok=True)
        return
    fs, where = filesystem(path)
    info = fs.get_file_info(where)
    try:
        if info.type == pafs.FileType.Directory:
            fs.delete_dir(where)
        elif info.type == pafs.FileType.File:
            fs.delete_file(where)
    except OSError as exc:
        raise s3_write_error(exc, str(path)) from exc


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


class StorageLayout(BaseModel):
    """Paths of one run under one storage root (passed to every stage)."""

    model_config = ConfigDict(frozen=True)

    root: str
    run_name: str

    @classmethod
    def create(cls, root: str, run_name: str) -> StorageLayout:
        """Layout with ``root`` made absolute (relative roots are relative to the working directory)."""
        if is_remote(root):
            return cls(root=root.rstrip("/"), run_name=run_name)
        return cls(root=str(Path(root).expanduser().absolute()), run_name=run_name)

    @property
    def remote(self) -> bool:
        return is_remote(self.root)

    def raw_dir(self, source_key: str) -> str:
        return join(self.root, "raw", source_key)

    def dataset_dir(self, fingerprint: str) -> str:
        return join(self.root, "datasets", f"mnist-{fingerprint}")

    @property
    def runs_dir(self) -> str:
        return join(self.root, "runs")

    @property
    def run_dir(self) -> str:
        return join(self.runs_dir, self.run_name)

    @property
    def summary_path(self) -> str:
        return join(self.run_dir, "summary.json")

    @property
    def evaluation_dir(self) -> str:
        return join(self.run_dir, "evaluation")

    def contains(self, path: str | os.PathLike[str]) -> bool:
        """True when ``path`` (symlinks resolved; no '..' on S3) lies strictly inside the storage root."""
        if self.remote or is_remote(path):
            text = str(path).rstrip("/")
            if not (self.remote and is_remote(text)) or ".." in text[len(S3_SCHEME) :].split("/"):
                return False
            return text.startswith(self.root + "/")
        root = Path(self.root).resolve()
        target = Path(path).resolve()
        return target != root and target.is_relative_to(root)

    def check_reachable(self) -> None:
        """Fail before any work when an S3 root cannot be listed (naming the root and the endpoint)."""
        if not self.remote:
            return
        fs, where = filesystem(self.root)
        bucket = where.split("/", 1)[0]
        try:
            info = fs.get_file_info(bucket)
        except OSError as exc:
            raise ValueError(
                f"storage_root {self.root}: cannot reach the bucket at {S3Settings().endpoint_url or 'AWS'}: {exc}; "
                "check AWS_ENDPOINT_URL, AWS_REGION and the credentials in the environment"
            ) from exc
        if info.type == pafs.FileType.NotFound:
            raise ValueError(f"storage_root {self.root}: bucket {bucket!r} does not exist at {S3Settings().endpoint_url or 'AWS'}")


def sha256_file(path: str | os.PathLike[str], chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file (local or ``s3://``), read in chunks."""
    digest = hashlib.sha256()
    if is_remote(path):
        fs, where = filesystem(path)
        with fs.open_input_stream(where, compression=None) as handle:
            while block := handle.read(chunk):
                digest.update(block)
        return digest.hexdigest()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def sha256_json(obj: Any) -> str:
    """Hex sha256 of the canonical JSON form of ``obj``."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


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


def read_json(path: str | os.PathLike[str]) -> Any | None:
    """Parsed JSON at ``path``, or None when the file is missing or unreadable as JSON."""
    try:
        return json.loads(read_bytes(path))
    except (OSError, ValueError):
        return None


# errno values that mean "the storage cannot take this write", not a bug in the stage.
STORAGE_ERRNOS = {
    errno.ENOSPC: "the storage root is full (no space left on the device)",
    errno.EDQUOT: "the storage quota is exhausted",
    errno.EFBIG: "the file is larger than the storage allows",
    errno.EROFS: "the storage root is mounted read-only",
    errno.EACCES: "the storage root refuses writes (permission denied: a read-only bucket or folder, "
    "or credentials without write access)",
}

# How S3 servers say "no" to a write, as pyarrow (AWS SDK error names, HTTP status) and boto3
# (error codes) report it: AWS and MinIO deny with 403 AccessDenied; MinIO answers 507
# XMinioStorageFull when its drives are full and XMinioAdminBucketQuotaExceeded over a bucket quota.
_S3_DENIED = ("ACCESS_DENIED", "AccessDenied", "HTTP status 403", "AllAccessDisabled")
_S3_FULL = ("XMinioStorageFull", "HTTP status 507", "QuotaExceeded", "InsufficientStorage")


def s3_write_error(exc: Exception, uri: str) -> Exception:
    """An S3 write failure as an OSError carrying the errno `storage_writes` maps and the object's URI.

    Other failures (network, throttling) come back unchanged.
    """
    text = str(exc)
    if any(marker in text for marker in _S3_DENIED):
        return PermissionError(errno.EACCES, f"access denied by the object store: {' '.join(text.split())}", uri)
    if any(marker in text for marker in _S3_FULL):
        return OSError(errno.ENOSPC, f"the object store is out of space: {' '.join(text.split())}", uri)
    return exc


class StorageWriteError(OSError):
    """A stage could not write to the storage root (full, over quota or read-only)."""

    def __str__(self) -> str:  # the message alone, without OSError's "[Errno N]" prefix
        return str(self.args[0]) if self.args else super().__str__()

    def __reduce__(self):
        # Ray ships a worker's exception to the driver by pickling it; OSError's own reduce keeps
        # only ``args``, and the errno (set after construction) would be lost on the way.
        return (_rebuild_storage_write_error, (str(self), self.errno))


def _rebuild_storage_write_error(message: str, code: int | None) -> StorageWriteError:
    error = StorageWriteError(message)
    error.errno = code
    return error


# How a storage errno reads when only the text of an error survived (pyarrow, or a remote rank's
# error flattened into a message).
_STORAGE_TEXT = {
    "No space left on device": errno.ENOSPC,
    "Read-only file system": errno.EROFS,
    "Disk quota exceeded": errno.EDQUOT,
}


def storage_errno(exc: BaseException, by_text: bool = True) -> int | None:
    """The storage errno (`STORAGE_ERRNOS`) ``exc`` stands for, or None when it is another failure.

    ``by_text``: also recognize the errno from the message alone (pyarrow raises bare OSErrors).
    """
    code = getattr(exc, "errno", None) if isinstance(exc, OSError) else None
    if code in STORAGE_ERRNOS:
        return code
    if by_text:
        text = str(exc)
        return next((value for marker, value in _STORAGE_TEXT.items() if marker in text), None)
    return None


def storage_write_error(stage: str, exc: BaseException, where: str | os.PathLike[str] | None = None) -> StorageWriteError | None:
    """``exc`` as the `StorageWriteError` `storage_writes` raises, or None when it is not a storage failure.

    A `StorageWriteError` comes back as it is. ``where``: the folder named when ``exc`` carries
    no file name; without it only a real errno counts, not the error's text.
    """
    if isinstance(exc, StorageWriteError):
        return exc
    code = storage_errno(exc, by_text=where is not None)
    if code is None:
        return None
    filename = getattr(exc, "filename", None)
    target = filename or (f"under {where}" if where is not None else "to the storage root")
    error = StorageWriteError(
        f"{stage}: cannot write {target}: {STORAGE_ERRNOS[code]}. Nothing was published and the previous state is intact; "
        "free space (or make it writable, or pick another --storage-root) and run again with the same --run-name"
    )
    error.errno = code
    return error


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
        error = storage_write_error(stage, exc, where)
        if error is None:
            raise
        raise error from exc


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
    from botocore.exceptions import ClientError

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
        holder = read_json(uri)
        if isinstance(holder, dict) and _lock_is_stale(holder):
            client.delete_object(Bucket=bucket, Key=key)  # left by a process that died holding it
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
    """Folders other live runs on this storage root read (their raw data and Parquet datasets)."""
    return [str(p) for lease in live_leases(layout).values() for p in lease.get("uses", [])]


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
        lease["uses"] = sorted(set(lease.get("uses", [])) | set(folders))
        atomic_write_json(path, lease)
