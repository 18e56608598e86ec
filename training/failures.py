"""Which failures of a training run are whose: infrastructure's (a lost worker or node, retried by Ray Train and then Prefect) or the storage root's (named with the stage and the folder, never retried)."""

from __future__ import annotations

from storage_io import StorageWriteError, storage_errno, storage_write_error

# Failures of a lost process or node, or a hang: worth another attempt from the latest checkpoint.
_INFRASTRUCTURE_ERRORS = ("RayActorError", "ActorDiedError", "WorkerCrashedError", "NodeDiedError", "ActorUnavailableError",
                          "OwnerDiedError", "ObjectLostError", "TrainingHangError", "DistBackendError", "DistNetworkError")


_INFRASTRUCTURE_TEXT = ("Connection closed by peer", "Connection reset by peer", "timed out", "monitoredBarrier", "died")


def _failures(exc: BaseException) -> list[BaseException]:
    """``exc`` and every error inside it: causes, contexts, each failed rank's and the controller's."""
    seen: set[int] = set()
    found: list[BaseException] = []
    pending = [exc]
    while pending:
        error = pending.pop(0)
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        found.append(error)
        pending.extend((getattr(error, "worker_failures", None) or {}).values())
        pending.extend([getattr(error, "controller_failure", None), error.__cause__, error.__context__])
    return found


def storage_failure(exc: BaseException, run_dir: str) -> StorageWriteError | None:
    """The training stage's `StorageWriteError` when ``exc`` failed because the storage root took no more writes.

    Looks through Ray Train's errors (``WorkerGroupError.worker_failures``, ``ControllerError``,
    the exception chain) for, best first: a rank's own `StorageWriteError` (it names the
    checkpoint folder), an OSError with ENOSPC / EROFS / EDQUOT / EACCES (named by its file, else
    the run folder), an error whose text alone says so (named by the run folder).
    """
    failures = _failures(exc)
    for error in failures:
        if isinstance(error, StorageWriteError):
            return error
    for by_text in (False, True):
        for error in failures:
            if storage_errno(error, by_text=by_text) is not None:
                return storage_write_error("train", error, run_dir)
    return None


def is_infrastructure_failure(exc: BaseException) -> bool:
    """True when ``exc`` (or a rank's failure inside a Ray Train error) is a lost worker, node or a hang.

    ``ray.train.WorkerGroupError`` carries each failed rank's exception; when every one of them
    is an ordinary exception (a bug, bad data) a retry would only fail again, so it is not one.
    Neither is a full, read-only or over-quota storage root, even when the other ranks lost
    their peer because of it: another attempt would only meet the same disk.
    """
    failures = _failures(exc)
    if any(isinstance(error, StorageWriteError) or storage_errno(error) is not None for error in failures):
        return False
    for error in failures:
        names = {cls.__name__ for cls in type(error).__mro__}
        if names & set(_INFRASTRUCTURE_ERRORS) or any(text in str(error) for text in _INFRASTRUCTURE_TEXT):
            return True
    return False


def raise_storage_failure(exc: BaseException, run_dir: str) -> None:
    """Raise the stage's `StorageWriteError` (from ``exc``) when ``exc`` is a storage failure; else return."""
    error = storage_failure(exc, run_dir)
    if error is None:
        return
    # A fresh error raised here, so the message is the stage's own and ``exc`` (Ray Train's, with
    # every rank's traceback) stays attached as its cause.
    raise _copy(error) from exc


def _copy(error: StorageWriteError) -> StorageWriteError:
    copy = StorageWriteError(str(error))
    copy.errno = error.errno
    return copy
