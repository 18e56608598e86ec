"""Fetching files into place and verifying them: a temporary name, a checksum, then one rename.

Retries transient errors with backoff; a file whose checksum does not match is discarded, never
kept under its final name. Which source and which checksums: `dataset.sources.mnist_files`.
"""

from __future__ import annotations

import http.client
import logging
import os
import shutil
import socket
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from urllib.parse import urlparse

from storage_io import STORAGE_ERRNOS, redact_text, redact_url, sha256_file

logger = logging.getLogger(__name__)


class DownloadError(RuntimeError):
    """A file could not be fetched (after the retries transient errors get)."""


class ChecksumMismatchError(DownloadError):
    """A fetched file's checksum differs from the expected one; the file was discarded."""


class SourceUnreachableError(DownloadError):
    """source=official, but no official mirror accepted a connection."""


def file_checksum(path: str | os.PathLike[str], algorithm: str) -> str:
    """Hex digest of a file with ``algorithm`` (``md5`` or ``sha256``)."""
    if algorithm == "md5":
        from torchvision.datasets.utils import calculate_md5  # torchvision: only where a model is built

        return calculate_md5(path)  # torchvision's, so official files are checked exactly as it does
    if algorithm == "sha256":
        return sha256_file(path)
    raise ValueError(f"unsupported checksum algorithm {algorithm!r}")


def check_file(path: Path, checksum: str) -> tuple[bool, str, str]:
    """Verify ``path`` against ``"<algorithm>:<hex>"``.

    Returns:
        (matches, actual digest with the expected algorithm, sha256 of the file).
    """
    algorithm, _, expected = checksum.partition(":")
    actual = file_checksum(path, algorithm)
    sha256 = actual if algorithm == "sha256" else sha256_file(path)
    return actual == expected, actual, sha256


def verified_files(directory: Path, expected: dict[str, str]) -> dict[str, str] | None:
    """sha256 of every expected file when all are present and verify, else None (read-only)."""
    files = {}
    for name, checksum in expected.items():
        path = directory / name
        if not path.is_file():
            return None
        ok, _, sha256 = check_file(path, checksum)
        if not ok:
            return None
        files[name] = sha256
    return files


def is_transient(exc: BaseException) -> bool:
    """True for errors worth retrying: HTTP 5xx, resets, refusals, timeouts, cut-off bodies."""
    if isinstance(exc, urllib.error.HTTPError):
        return exc.code >= 500  # 4xx (missing file, forbidden) will not fix itself
    if isinstance(exc, urllib.error.URLError) and isinstance(exc.reason, BaseException):
        exc = exc.reason  # urllib wraps connection-level errors
    if isinstance(exc, socket.gaierror):
        return exc.errno == socket.EAI_AGAIN  # "try again" is transient; "no such host" is not
    return isinstance(exc, (ConnectionError, TimeoutError, http.client.IncompleteRead))


def fetch_file(
    url: str,
    dest: Path,
    checksum: str,
    attempts: int = 4,
    backoff_s: float = 0.5,
    log: logging.Logger | logging.LoggerAdapter = logger,
    read_timeout_s: float = 30.0,
) -> str:
    """Download ``url`` to ``dest`` atomically, retrying transient errors, and verify it.

    The bytes land in a temporary name next to ``dest`` and are renamed to ``dest`` only after
    they verify, so ``dest`` never holds a partial or corrupt file.

    Args:
        url: http(s):// or file:// URL of the file.
        dest: Final path.
        checksum: Expected ``"<md5|sha256>:<hex>"``.
        attempts: Tries for transient errors (HTTP 5xx, resets, timeouts); 4xx is tried once.
        backoff_s: Delay before the first retry; doubles on every further retry.
        log: Where retry warnings go (the task passes the Prefect run logger).
        read_timeout_s: Longest silence from the server before the attempt counts as failed.

    Returns:
        sha256 of the verified file.

    Raises:
        DownloadError: The file could not be fetched.
        ChecksumMismatchError: The fetched bytes do not match ``checksum`` (they were deleted).
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    for attempt in range(1, attempts + 1):
        try:
            return _fetch_once(url, dest, checksum, read_timeout_s)
        except ChecksumMismatchError:
            raise  # a wrong file is a wrong file: retrying the same source will not fix it
        except Exception as exc:
            if isinstance(exc, OSError) and exc.errno in STORAGE_ERRNOS:
                raise  # a full or read-only storage root: retrying the download cannot help
            transient = is_transient(exc)
            if not transient or attempt == attempts:
                why = f"gave up after {attempts} attempts" if transient else "not retried"
                raise DownloadError(f"cannot download {dest.name} from {redact_url(url)}: {_describe(exc)} ({why})") from exc
            delay = backoff_s * 2 ** (attempt - 1)
            log.warning(
                "attempt %d/%d for %s from %s failed (%s); retrying in %.2fs",
                attempt, attempts, dest.name, redact_url(url), _describe(exc), delay,
            )
            time.sleep(delay)
    raise AssertionError("unreachable")  # pragma: no cover - the loop returns or raises


def _fetch_once(url: str, dest: Path, checksum: str, read_timeout_s: float) -> str:
    """One attempt of `fetch_file`: the bytes into a fresh temporary name, verified, then renamed to ``dest``.

    The temporary file is gone when this returns or raises, so a failed attempt leaves nothing behind.
    """
    # A name that does not exist yet: torchvision's download_url returns early, without
    # downloading, when its target already exists and no md5 is given.
    tmp = dest.parent / f".{dest.name}.{uuid.uuid4().hex[:8]}.part"
    try:
        _transfer(url, tmp, read_timeout_s)
        ok, actual, sha256 = check_file(tmp, checksum)
        if not ok:
            algorithm, _, expected = checksum.partition(":")
            raise ChecksumMismatchError(
                f"checksum mismatch for {dest.name} from {redact_url(url)}: expected {algorithm} {expected}, "
                f"got {actual}; the download was discarded (check the source or its configured checksums)"
            )
        _fsync(tmp)  # durable before it becomes visible under the final name
        os.replace(tmp, dest)
        return sha256
    finally:
        tmp.unlink(missing_ok=True)  # no-op after a successful rename


def sync_files(
    base_url: str,
    directory: Path,
    expected: dict[str, str],
    attempts: int = 4,
    backoff_s: float = 0.5,
    log: logging.Logger | logging.LoggerAdapter = logger,
    read_timeout_s: float = 30.0,
) -> tuple[dict[str, str], bool]:
    """Make ``directory`` hold every expected file, verified, fetching only what is missing or bad.

    Returns:
        (file name -> sha256, True when nothing had to be fetched).
    """
    files: dict[str, str] = {}
    fetched = False
    for name, checksum in expected.items():
        dest = directory / name
        if dest.is_file():
            ok, _, sha256 = check_file(dest, checksum)
            if ok:
                files[name] = sha256
                continue
            # Never used, and removed now so the final name does not keep a bad file if the
            # re-download fails.
            log.warning("%s in %s does not match its checksum; deleting and downloading it again", name, directory)
            dest.unlink()
        files[name] = fetch_file(base_url + name, dest, checksum, attempts, backoff_s, log, read_timeout_s)
        fetched = True
    return files, not fetched


def _transfer(url: str, tmp: Path, read_timeout_s: float = 30.0) -> None:
    """Copy ``url`` to ``tmp`` (which must not exist); no verification, no retries."""
    parsed = urlparse(url)
    if parsed.scheme == "file":
        # torchvision's download_url cannot do file:// (its progress bar reads response.length,
        # which file responses lack) and would leave an empty file behind, so copy directly.
        if parsed.netloc not in ("", "localhost"):
            raise DownloadError(f"file:// URL {redact_url(url)} names a remote host; only local paths are supported")
        shutil.copyfile(urllib.request.url2pathname(parsed.path), tmp)
    else:
        # md5=None: we verify ourselves, to name expected and actual checksums in the error.
        # download_url takes no timeout and a stalled server would hang it forever; the socket
        # default applies to the sockets urllib opens inside it. Process-wide, but this stage
        # runs alone in its Ray worker, and the previous value is restored.
        from torchvision.datasets.utils import download_url

        previous = socket.getdefaulttimeout()
        socket.setdefaulttimeout(read_timeout_s)
        try:
            download_url(url, root=str(tmp.parent), filename=tmp.name)
        finally:
            socket.setdefaulttimeout(previous)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, urllib.error.HTTPError):
        return f"HTTP {exc.code} {exc.reason}"
    if isinstance(exc, urllib.error.URLError):
        return str(exc.reason)
    return redact_text(f"{type(exc).__name__}: {exc}")
