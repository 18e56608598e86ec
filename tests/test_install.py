"""The environment is the locked one, the lock satisfies pyproject.toml, and results name it."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from reporting import environment

PROJECT = environment.PROJECT_DIR


def locked_versions() -> dict[str, str]:
    """{canonical name: version} of every `name==version` line of requirements.lock."""
    pins = {}
    for line in environment.LOCK_FILE.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        assert sep, f"requirements.lock line {line!r} is not an exact pin"
        pins[canonicalize_name(name)] = version.strip()
    return pins


def test_installed_packages_are_the_locked_versions():
    """What `make install` (and CI) installed is exactly requirements.lock: no package drifted or is missing."""
    pins = locked_versions()
    assert len(pins) > 100  # the whole resolved set, not a hand-picked few
    mismatched = {}
    for name, version in pins.items():
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            installed = None
        if installed != version:
            mismatched[name] = (version, installed)
    assert not mismatched, f"installed versions differ from requirements.lock (locked, installed): {mismatched}"


def test_lock_satisfies_pyproject():
    """Every dependency range in pyproject.toml (with the test extra) admits its locked version: the lock is not stale."""
    project = tomllib.loads((PROJECT / "pyproject.toml").read_text())["project"]
    pins = locked_versions()
    for spec in [*project["dependencies"], *project["optional-dependencies"]["test"]]:
        req = Requirement(spec)
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} (pyproject.toml) is not in requirements.lock: run `make lock`"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"requirements.lock has {req.name}=={pins[name]}, outside pyproject.toml's {req.specifier}: run `make lock`"
        )


def test_environment_names_versions_machine_and_commit():
    env = environment.describe()
    assert env["packages"]["torch"] == metadata.version("torch")
    assert env["packages"]["prefect"] == metadata.version("prefect")
    assert set(env["packages"]) >= {"torch", "ray", "prefect", "numpy", "pyarrow"}
    assert env["python"].count(".") == 2
    assert env["cpu_cores"] >= 1 and env["cpu_model"]
    assert env["gpus"] == [] or all(isinstance(name, str) for name in env["gpus"])
    head = subprocess.run(["git", "-C", str(PROJECT), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:  # a git checkout (CI's is): the commit is named
        assert env["git_commit"].removesuffix("-dirty") == head.stdout.strip()
    else:
        assert env["git_commit"] is None
    assert len(env["requirements_lock_sha256"]) == 64
    rows = environment.environment_rows(env)
    assert {"what": "torch", "value": env["packages"]["torch"]} in rows
    # The CPU by family, model and vector extensions, as /proc/cpuinfo gives them ("AMD EPYC" alone
    # names CPUs whose training speed differs 3-4x)
    flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")).split()
    assert env["cpu"]["vector_extensions"] == [flag for flag in environment.VECTOR_FLAGS if flag in flags]
    assert env["cpu"]["cpu_family"].isdigit() and env["cpu"]["model"].isdigit()
    cpu_row = next(row["value"] for row in rows if row["what"] == "cpu")
    assert f"family {env['cpu']['cpu_family']} model {env['cpu']['model']}" in cpu_row
    assert ("avx2" in cpu_row) == ("avx2" in flags)


def test_the_gpus_a_run_names_are_read_without_loading_torch(tmp_path):
    """`environment.gpus` in a process without torch asks ``nvidia-smi`` (with ``CUDA_VISIBLE_DEVICES`` applied) and
    leaves torch unloaded, so the flow's process never holds it. There is no NVIDIA driver here: a two-line
    ``nvidia-smi`` script on PATH stands in for the real one (its ``--query-gpu=name --format=csv,noheader`` output)."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\nprintf 'NVIDIA H200\\nNVIDIA L4\\n'\n")
    smi.chmod(0o755)
    code = "import sys; from reporting import environment as e; print(e.gpus(), 'torch' in sys.modules)"
    answers = {}
    for visible in (None, "1", "", "1,7,0", "GPU-5f1c"):
        env = {**{k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
        if visible is not None:
            env["CUDA_VISIBLE_DEVICES"] = visible
        out = subprocess.run([sys.executable, "-c", code], cwd=PROJECT, env=env, capture_output=True, text=True, timeout=60,
                             check=False)
        assert out.returncode == 0, out.stderr
        answers[visible] = out.stdout.strip()
    assert answers == {
        None: "['NVIDIA H200', 'NVIDIA L4'] False",
        "1": "['NVIDIA L4'] False",
        "": "[] False",
        "1,7,0": "['NVIDIA L4'] False",  # CUDA stops at the first index that is not a device
        "GPU-5f1c": "['NVIDIA H200'] False",
    }
