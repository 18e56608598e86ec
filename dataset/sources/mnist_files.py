"""Where the four MNIST IDX ``.gz`` files come from, and how they are fetched and verified.

Sources (``DownloadConfig.source``):

* ``official``  the official MNIST mirrors torchvision knows, verified against torchvision's md5;
* ``mirror``    any http(s):// or file:// base URL, verified against ``download.mirror_sha256``;
* ``sample``    the bundled 5,000-digit sample, i.e. a file:// mirror with the pinned sample sha256;
* ``auto``      official when a mirror answers within ``connect_timeout_s``, else sample (warned).

Every file is fetched to a temporary name in its final folder, verified, and only then renamed
into place, so a final name never holds a partial or unverified file. A re-run whose four files
are present and verified touches no network at all.

Fetching and verifying the files themselves is `dataset.sources.fetch`'s.
"""

from __future__ import annotations

import hashlib
import logging
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import NamedTuple
from urllib.parse import urlparse

from dataset.sources.fetch import SourceUnreachableError, verified_files
from dataset.sources.interface import SourceName
from pipeline_config.common import MNIST_FILES, SAMPLE_DIR
from pipeline_config.data import DownloadConfig, MirrorChecksums
from storage_io import StorageLayout, local_copy, redact_url

logger = logging.getLogger(__name__)


# The official mirrors and checksums are read from torchvision (not copied), so the official
# source stays whatever torchvision maintains. Read when first needed: importing torchvision costs
# 2.3 s, on the critical path of every run's first stage even when the files are already verified
# (benchmarks/start/deployment_overhead.py). Module-level on purpose: tests point them at loopback
# servers or closed ports by setting them.
OFFICIAL_MIRRORS: tuple[str, ...] | None = None


OFFICIAL_MD5: dict[str, str] | None = None


def official_mirrors() -> tuple[str, ...]:
    """torchvision's MNIST mirrors, in its order of preference (or what a test set)."""
    if OFFICIAL_MIRRORS is not None:
        return OFFICIAL_MIRRORS
    from torchvision.datasets import MNIST  # torchvision: only where a model is built

    return tuple(MNIST.mirrors)


def official_md5() -> dict[str, str]:
    """torchvision's md5 of each official MNIST file (or what a test set)."""
    if OFFICIAL_MD5 is not None:
        return OFFICIAL_MD5
    from torchvision.datasets import MNIST  # torchvision: only where a model is built

    return dict(MNIST.resources)


class SourcePlan(NamedTuple):
    """What to fetch: ``expected`` maps each file name to ``"<md5|sha256>:<hex>"``."""

    source: SourceName
    base_url: str
    expected: dict[str, str]
    fell_back: bool = False  # auto chose the sample because the official mirrors were unreachable


def resolve_source(cfg: DownloadConfig, layout: StorageLayout | None = None) -> SourcePlan:
    """Decide where the files come from and how each one is verified.

    Args:
        cfg: The download configuration.
        layout: When given, ``auto`` reuses an already verified official copy under it without
            probing the network (so a re-run stays offline-safe).

    Returns:
        The source, its base URL (ending in '/') and the expected checksum of every file.

    Raises:
        SourceUnreachableError: ``source=official`` and no official mirror answered.
    """
    if cfg.source == "mirror":
        assert cfg.mirror_url is not None  # DownloadConfig refuses source=mirror without a URL
        return SourcePlan("mirror", cfg.mirror_url, _prefixed("sha256", cfg.mirror_sha256.by_file()))
    if cfg.source == "sample":
        return _sample_plan()

    expected_md5 = _prefixed("md5", {name: official_md5()[name] for name in MNIST_FILES})
    if cfg.source == "auto" and layout is not None:
        with local_copy(layout.raw_dir("official")) as official:
            if verified_files(official, expected_md5):
                return SourcePlan("official", official_mirrors()[0], expected_md5)

    mirror, failures = _probe_mirrors(official_mirrors(), cfg.connect_timeout_s)
    if mirror is not None:
        return SourcePlan("official", mirror, expected_md5)
    if cfg.source == "auto":
        return _sample_plan()._replace(fell_back=True)
    tried = "; ".join(f"{redact_url(url)} ({why})" for url, why in failures.items())
    raise SourceUnreachableError(
        f"the official MNIST source is unreachable: no mirror accepted a connection within "
        f"{cfg.connect_timeout_s:g}s (tried {tried}). Use download.source=auto to fall back to the "
        f"bundled sample automatically, download.source=sample to use it directly, or "
        f"download.source=mirror with download.mirror_url pointing at a reachable copy."
    )


def source_key(plan: SourcePlan) -> str:
    """Folder name under ``raw/``: ``official``, ``sample`` or ``mirror-<12 hex of sha256(url)>``."""
    if plan.source == "mirror":
        # One folder per base URL, so two mirrors with different contents never mix files.
        return "mirror-" + hashlib.sha256(plan.base_url.encode()).hexdigest()[:12]
    return plan.source


def official_reachable(timeout: float, mirrors: Sequence[str] | None = None) -> str | None:
    """First official mirror (in preference order) accepting a TCP connection within ``timeout``.

    Args:
        timeout: Seconds the whole probe may take, DNS resolution included.
        mirrors: Base URLs to probe; defaults to `official_mirrors`.

    Returns:
        The mirror's base URL, or None when none answered in time.
    """
    return _probe_mirrors(official_mirrors() if mirrors is None else mirrors, timeout)[0]


def _probe_mirrors(mirrors: Sequence[str], timeout: float) -> tuple[str | None, dict[str, str]]:
    """Probe all mirrors in parallel; returns the winner and, per failed mirror, why."""
    deadline = time.monotonic() + timeout
    outcome: dict[str, str | None] = {}  # url -> None (connected) or the reason it did not
    done = {url: threading.Event() for url in mirrors}

    def probe(url: str) -> None:
        try:
            with socket.create_connection(_connect_target(url), timeout=timeout):
                outcome[url] = None
        except Exception as exc:  # anything (bad URL, DNS, refused) means "not reachable"
            outcome[url] = f"{type(exc).__name__}: {exc}"
        finally:
            done[url].set()

    # Daemon threads because getaddrinfo ignores socket timeouts and can block for many seconds
    # on an offline machine; the caller waits at most `timeout` and abandons stragglers.
    for url in mirrors:
        threading.Thread(target=probe, args=(url,), name="mnist-probe", daemon=True).start()
    failures: dict[str, str] = {}
    for url in mirrors:  # preference order: a later mirror wins only if earlier ones failed
        if not done[url].wait(max(0.0, deadline - time.monotonic())):
            failures[url] = f"no answer within {timeout:g}s"
        elif outcome[url] is None:
            return url, failures
        else:
            failures[url] = outcome[url] or ""
    logger.info("official MNIST mirrors unreachable: %s", failures)
    return None, failures


def _connect_target(url: str) -> tuple[str, int]:
    """host:port a request to ``url`` connects to: the proxy's when one applies (as urllib does)."""
    parsed = urlparse(url)
    if not parsed.hostname:
        raise ValueError(f"no host in {url!r}")
    proxy = urllib.request.getproxies().get(parsed.scheme)
    if proxy and not urllib.request.proxy_bypass(parsed.hostname):
        parsed = urlparse(proxy if "://" in proxy else f"http://{proxy}")
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    return parsed.hostname or "", port


def _sample_plan() -> SourcePlan:
    # The bundled sample is served like any mirror, pinned to its own checksums (never the
    # configured mirror_sha256, which describe a different mirror).
    return SourcePlan("sample", SAMPLE_DIR.as_uri() + "/", _prefixed("sha256", MirrorChecksums().by_file()))


def _prefixed(algorithm: str, digests: dict[str, str]) -> dict[str, str]:
    return {name: f"{algorithm}:{digest}" for name, digest in digests.items()}
