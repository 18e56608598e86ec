"""A run's memory as the operating system counts it: every process of the run (the driver, Prefect's server, Ray's
workers) sampled for its proportional set size, named by kind, the peak and who held it."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path


def _children() -> dict[int, list[int]]:
    """Parent pid -> child pids, from ``/proc/<pid>/stat``."""
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        parent = int(stat[stat.rindex(")") + 2 :].split()[1])
        tree.setdefault(parent, []).append(int(entry))
    return tree


PSS_PARTS = {"Pss_Anon:": "anon", "Pss_Shmem:": "shmem", "Pss_File:": "file"}


def pss_parts(pid: int) -> dict[str, float]:
    """The proportional set size of ``pid`` in MB, total and split: ``anon`` (heaps), ``shmem`` (Ray's object
    store pages this process maps), ``file`` (libraries); empty when it is gone."""
    out: dict[str, float] = {}
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            name = line.split(" ", 1)[0]
            if name == "Pss:":
                out["total"] = int(line.split()[1]) / 1024
            elif name in PSS_PARTS:
                out[PSS_PARTS[name]] = int(line.split()[1]) / 1024
    except (OSError, ValueError):
        return {}
    return out


def pss_mb(pid: int) -> float:
    """The proportional set size of ``pid`` in MB (0 when it is gone)."""
    return pss_parts(pid).get("total", 0.0)


def process_kind(pid: int, root: int) -> str:
    """What a process of the run is, from its command line: driver, raylet, ray::IDLE, prefect server, ..."""
    if pid == root:
        return "driver (flows.train)"
    try:
        args = [a.decode(errors="replace") for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
    except OSError:
        return "gone"
    if not args:
        return "unknown"
    first, line = args[0], " ".join(args)
    if first.startswith("ray::"):
        return first.split(" ")[0].split(".")[0].split("(")[0]
    for marker, kind in (("raylet", "raylet"), ("gcs_server", "ray gcs_server"), ("dashboard", "ray dashboard"),
                         ("log_monitor", "ray log_monitor"), ("runtime_env", "ray runtime_env agent"),
                         ("monitor.py", "ray monitor"), ("prefect", "prefect server"), ("mlflow", "mlflow")):
        if marker in line:
            return kind
    return os.path.basename(first)


class PssSampler:
    """Every ``poll_s``: the PSS of a process and all its descendants, summed; the peak in total and per kind.

    A process once seen below the root stays counted while it lives, even if it is reparented."""

    def __init__(self, root: int, poll_s: float = 0.5):
        self.root, self.poll_s = root, poll_s
        self.seen: set[int] = {root}
        self.peak_mb = 0.0
        self.peak_at_s = 0.0
        self.at_peak: dict[str, float] = {}
        self.at_peak_parts: dict[str, float] = {}  # anon / shmem / file MB summed over the processes at the peak
        self.kinds: dict[str, dict] = {}  # kind -> peak summed MB, peak single process MB, most processes
        self.samples = 0
        self._start = time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _descendants(self) -> set[int]:
        tree, found, todo = _children(), set(), [self.root]
        while todo:
            pid = todo.pop()
            found.add(pid)
            todo += [child for child in tree.get(pid, []) if child not in found]
        self.seen |= found
        self.seen = {pid for pid in self.seen if os.path.exists(f"/proc/{pid}")}
        return self.seen

    def sample(self) -> None:
        by_kind: dict[str, list[float]] = {}
        parts = dict.fromkeys(PSS_PARTS.values(), 0.0)
        for pid in self._descendants():
            kind = process_kind(pid, self.root)
            measured = pss_parts(pid) if kind != "gone" else {}
            mb = measured.get("total", 0.0)
            if mb > 0:
                by_kind.setdefault(kind, []).append(mb)
                for part in parts:
                    parts[part] += measured.get(part, 0.0)
        total = sum(sum(v) for v in by_kind.values())
        self.samples += 1
        for kind, values in by_kind.items():
            peak = self.kinds.setdefault(kind, {"peak_sum_mb": 0.0, "peak_one_process_mb": 0.0, "most_processes": 0})
            peak["peak_sum_mb"] = max(peak["peak_sum_mb"], sum(values))
            peak["peak_one_process_mb"] = max(peak["peak_one_process_mb"], max(values))
            peak["most_processes"] = max(peak["most_processes"], len(values))
        if total > self.peak_mb:
            self.peak_mb, self.peak_at_s = total, time.perf_counter() - self._start
            self.at_peak = {kind: round(sum(v)) for kind, v in sorted(by_kind.items(), key=lambda kv: -sum(kv[1]))}
            self.at_peak_parts = {part: round(mb) for part, mb in parts.items()}

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.sample()

    def __enter__(self) -> PssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join()

    def result(self) -> dict:
        kinds = {k: {name: round(v) for name, v in d.items()} for k, d in sorted(self.kinds.items(), key=lambda kv: -kv[1]["peak_sum_mb"])}
        return {"peak_pss_mb": round(self.peak_mb), "peak_at_s": round(self.peak_at_s, 1), "at_peak_mb": self.at_peak, "at_peak_parts_mb": self.at_peak_parts,
                "per_kind": kinds, "samples": self.samples}
