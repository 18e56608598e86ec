"""Freed memory handed back to the operating system, so an idle Ray worker does not keep its last task's peak.

A Ray worker process is reused: the one that ran the transform stage's checks, or a window of a streamed
split, goes idle holding what glibc's malloc and Arrow's allocator kept after the task freed it (both keep
freed memory for reuse). Measured on a 10,000-image folder (docs/performance.md, "Folders bigger than
memory"): five idle workers held 1.7 GB at the run's peak. Trimming from outside (``MALLOC_TRIM_THRESHOLD_``
for every worker) gave it back but made training 65% slower (every large tensor a fresh ``mmap``), so the
data path trims where it knows a big task ended instead.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from functools import cache

import pyarrow as pa


@cache
def _malloc_trim():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to call
        return None


def release_memory() -> None:
    """Give freed heap back to the OS: Arrow's pool releases its unused pages, glibc trims every arena."""
    pa.default_memory_pool().release_unused()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
