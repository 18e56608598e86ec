"""Storage write errors: what a full, read-only or over-quota storage root looks like, and how it is said.

A stage wraps its writes in `storage_writes`; an OSError whose errno (or, for pyarrow and S3,
whose text) means the storage takes no more writes becomes a `StorageWriteError` naming the
stage, the path and the fix. Anything else is raised as it was.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from contextlib import contextmanager

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
