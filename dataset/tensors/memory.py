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
def _glibc(function: str):
    """glibc's ``function`` (``malloc_trim``, ``mallopt``), or None where the C library is not glibc (macOS, musl)."""
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), function)
    except (OSError, AttributeError):
        return None


def release_memory() -> None:
    """Give freed heap back to the OS: Arrow's pool releases its unused pages, glibc trims every arena."""
    pa.default_memory_pool().release_unused()
    trim = _glibc("malloc_trim")
    if trim is not None:
        trim(0)


# glibc's mallopt parameters: M_TRIM_THRESHOLD, M_MMAP_THRESHOLD.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
# What a process that trains or scores keeps in its heap: allocations up to this size, and this much freed
# memory at the heap's top.
KEEP_IN_HEAP_MB = 512


def keep_large_blocks_in_heap(mb: int = KEEP_IN_HEAP_MB) -> None:
    """glibc's malloc takes allocations of up to ``mb`` MB from the heap and keeps up to ``mb`` MB of freed heap,
    instead of a fresh ``mmap`` (zeroed, faulted in page by page) for every block over its dynamic threshold
    (at most 32 MB) and handing it back when freed.

    A forward pass of the small CNN over 250 64x64 RGB images makes 131 MB activations: scoring 8,000 of them
    took 3-8 million page faults and 7-17 s of system time, and 12-21 s against 11.1-11.4 s with this
    (2-core AMD EPYC Zen 4, docs/performance.md). Set by `training.model.catalog.configure_cpu`, which every process
    that trains or scores calls first. `release_memory`, at a stage's end, still hands the heap back."""
    mallopt = _glibc("mallopt")
    if mallopt is None:  # not glibc: its own allocator's defaults
        return
    mallopt(_M_MMAP_THRESHOLD, mb << 20)
    mallopt(_M_TRIM_THRESHOLD, mb << 20)
