"""The shipped default recipe meets its own gate on the bundled sample, and the gate still catches a broken pipeline.

Both run ``python -m flows.mnist`` as a user does (a fresh process, a temporary Prefect server, a
local Ray). Slow: the default recipe trains 30 epochs (about 5 minutes on 2 cores).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks.full_size import SAMPLE, idx_bytes, mirror_flags, read_idx
from pipeline_config import PipelineConfig

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent


def cli(*args: str, timeout: int = 1500) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    return subprocess.run([sys.executable, "-m", "flows.mnist", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_default_preset_passes_its_gate_on_the_bundled_sample_with_a_readable_terminal(tmp_path):
    """`make run` with its defaults, the data fixed to the bundled sample (what an offline machine gets)."""
    storage = tmp_path / "storage"
    out = cli("--download.source", "sample", "--storage-root", str(storage), "--run-name", "default")
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((storage / "runs" / "default" / "summary.json").read_text())
    gate = PipelineConfig().evaluate.min_accuracy
    assert summary["status"] == "completed" and summary["evaluation"]["min_accuracy"] == gate
    assert summary["test_accuracy"] >= gate
    terminal = (out.stdout + out.stderr).splitlines()
    epochs = [line for line in terminal if " - epoch " in line]
    assert len(epochs) == summary["epochs"] == 30 and "epoch 30/30" in epochs[-1]
    assert sum(" done in " in line for line in terminal) == 6  # one line per finished stage
    assert not any("Failed to query Ray Train Controller" in line or "Starting execution of Dataset" in line for line in terminal)
    assert len(terminal) < 60, "\n".join(terminal)
    assert any(line.startswith("Run default completed in ") for line in out.stdout.splitlines())


def test_the_default_gate_fails_a_model_trained_on_shuffled_labels(tmp_path):
    """A broken pipeline (every training label shuffled) cannot pass the default gate."""
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    checksums = {}
    for name in ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"):
        array = read_idx(SAMPLE / name)
        if name == "train-labels-idx1-ubyte.gz":
            array = np.random.default_rng(0).permutation(array)
        content = gzip.compress(idx_bytes(array), mtime=0)
        (mirror / name).write_bytes(content)
        checksums[name] = hashlib.sha256(content).hexdigest()
    storage = tmp_path / "storage"
    out = cli(*mirror_flags(mirror, checksums), "--storage-root", str(storage), "--run-name", "shuffled", "--train.epochs", "2")
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    summary = json.loads((storage / "runs" / "shuffled" / "summary.json").read_text())
    assert summary["stages"]["evaluate"]["status"] == "failed" and "QualityGateError" in summary["stages"]["evaluate"]["error"]
    assert summary["test_accuracy"] < 0.5  # about chance
