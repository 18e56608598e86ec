"""What a run or a benchmark ran on: library versions, the machine, the code version.

Every result the project writes (a run's ``summary.json``, the run's environment report in the
Prefect UI, ``benchmarks/results/latest.json``) carries ``describe()``, so a reported number
can be reproduced and a bug report names its environment. Reading it is cheap (package
metadata, ``/proc/cpuinfo``, one ``git`` call) and never fails: what cannot be read is ``None``.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

PROJECT_DIR = Path(__file__).resolve().parents[1]
LOCK_FILE = PROJECT_DIR / "requirements.lock"
# The libraries whose versions move results (kernels, data handling, orchestration).
PACKAGES = ("torch", "torchvision", "ray", "prefect", "numpy", "pyarrow", "pandas", "pydantic")


def package_versions(names: tuple[str, ...] = PACKAGES) -> dict[str, str | None]:
    """Installed version of each distribution in ``names`` (None when it is not installed)."""
    versions: dict[str, str | None] = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def cpu_model() -> str | None:
    """The CPU's model name from /proc/cpuinfo (Linux), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


# The x86 vector extensions that set how fast PyTorch's CPU kernels run, as /proc/cpuinfo flags them.
VECTOR_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_bf16")


def cpu_details() -> dict[str, Any]:
    """CPU family and model numbers and the vector extensions of `VECTOR_FLAGS` it has (Linux; empty elsewhere).

    "AMD EPYC" names CPUs whose training speed differs by 3-4x (an AVX2 one and a Zen 5 with
    AVX-512); the family, model and flags tell them apart."""
    details: dict[str, Any] = {}
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return details
    for line in lines:
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key in ("cpu family", "model") and key.replace(" ", "_") not in details:
            details[key.replace(" ", "_")] = value
        elif key == "flags":
            flags = set(value.split())
            details["vector_extensions"] = [flag for flag in VECTOR_FLAGS if flag in flags]
            break
    return details


def usable_cores() -> int | None:
    """Cores this process may run on (the affinity mask: what a container or taskset allows)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count()


def gpus() -> list[str]:
    """Names of the CUDA devices this process may use (empty on a CPU machine or without a driver).

    Asked of torch only where torch is already loaded; otherwise of ``nvidia-smi`` (with ``CUDA_VISIBLE_DEVICES``'s
    indices applied), so describing a run's environment neither imports torch into the flow's process (about
    300 MB for the whole run, issue 67) nor starts CUDA there."""
    try:
        if "torch" in sys.modules:
            import torch  # torch: only where a model is built or run

            if not torch.cuda.is_available():
                return []
            return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        smi = shutil.which("nvidia-smi")
        if smi is None:
            return []
        names = subprocess.run([smi, "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True,
                               timeout=10, check=True).stdout.split("\n")
        names = [name.strip() for name in names if name.strip()]
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is None:
            return names
        return _visible(names, [item.strip() for item in visible.split(",") if item.strip()])
    except Exception:  # noqa: BLE001 - a broken driver or nvidia-smi must not fail a run's summary
        return []


def _visible(names: list[str], entries: list[str]) -> list[str]:
    """The devices of ``names`` (nvidia-smi's order) that ``CUDA_VISIBLE_DEVICES``'s ``entries`` leave visible: indices
    up to the first one that is not a device (as CUDA reads them); UUIDs (``GPU-...``, ``MIG-...``) one device each."""
    if entries and entries[0].startswith(("GPU-", "MIG-")):
        return names[: len(entries)]
    shown = []
    for entry in entries:
        if not entry.isdigit() or int(entry) >= len(names):
            break
        shown.append(names[int(entry)])
    return shown


def git_commit(directory: Path = PROJECT_DIR) -> str | None:
    """The checked-out commit of the project, with ``-dirty`` when tracked files changed; None outside git."""
    try:
        head = subprocess.run(
            ["git", "-C", str(directory), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(directory), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{head}-dirty" if dirty else head or None


def lock_sha256(path: Path = LOCK_FILE) -> str | None:
    """sha256 of the lock file the environment was installed from (None when there is none)."""
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def describe() -> dict[str, Any]:
    """The environment of this process: Python, key library versions, CPU, cores, GPUs, git commit."""
    return {
        "python": platform.python_version(),
        "packages": package_versions(),
        "platform": platform.platform(),
        "cpu_model": cpu_model(),
        "cpu": cpu_details(),
        "cpu_cores": usable_cores(),
        "gpus": gpus(),
        "git_commit": git_commit(),
        "requirements_lock_sha256": lock_sha256(),
    }


def cpu_suffix(details: dict[str, Any]) -> str:
    """", family 26 model 2, avx2 fma avx512f" from `cpu_details` (empty when unknown)."""
    parts = []
    if details.get("cpu_family"):
        parts.append(f"family {details['cpu_family']} model {details.get('model', '?')}")
    if details.get("vector_extensions") is not None:
        parts.append(" ".join(details["vector_extensions"]) or "no AVX2")
    return "".join(f", {part}" for part in parts)


def environment_rows(env: dict[str, Any]) -> list[dict[str, str]]:
    """``describe()`` as two-column table rows (what / value) for a Prefect table artifact."""
    rows = [{"what": "python", "value": env.get("python") or "?"}]
    rows += [{"what": name, "value": version or "not installed"} for name, version in (env.get("packages") or {}).items()]
    rows += [
        {"what": "cpu", "value": f"{env.get('cpu_model') or '?'} ({env.get('cpu_cores') or '?'} cores){cpu_suffix(env.get('cpu') or {})}"},
        {"what": "gpus", "value": ", ".join(env.get("gpus") or []) or "none"},
        {"what": "platform", "value": env.get("platform") or "?"},
        {"what": "git commit", "value": env.get("git_commit") or "unknown (not a git checkout)"},
        {"what": "requirements.lock sha256", "value": env.get("requirements_lock_sha256") or "no lock file"},
    ]
    return rows
