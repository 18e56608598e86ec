"""The shipped default recipe meets its own gate on the bundled sample.

It runs ``python -m flows.mnist`` as a user does (a fresh process, a temporary Prefect server, a
local Ray). Slow: the default recipe trains ResNet-18 for 12 epochs (about 2 minutes on 2 cores);
its Ray Train checkpoint is where the seeds' contract is checked (model.pt loads into a torchvision
ResNet-18 built the seeds' way). That the default gate still catches a broken pipeline (every
training label shuffled, the small model) is checked by tests/test_flow_e2e.py's failed-gate run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flows.train import STAGE_CPUS
from pipeline_config import PipelineConfig
from pipeline_config.evaluation import OWN_GATES
from tests.support.runs import torchvision_resnet18_seed_style
from training.checkpoint.files import SEEDS_MODEL
from training.checkpoint.model_files import checkpoint_model

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent


def cli(*args: str, timeout: int = 1500) -> subprocess.CompletedProcess:
    # Only the arguments choose the recipe: no MNIST_* setting (a model, a test hook) from this shell
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API", "MNIST_"))}
    return subprocess.run([sys.executable, "-m", "flows.mnist", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_default_preset_passes_its_gate_on_the_bundled_sample_with_a_readable_terminal(tmp_path):
    """`make run` with its defaults, the data fixed to the bundled sample (what an offline machine gets).

    Its Ray Train run and checkpoints keep the seeds' contract: `Result.from_path` reads the run,
    the best checkpoint holds model.pt, optimizer.pt and extra_state.pt, and model.pt loads into a
    torchvision ResNet-18 built the seeds' way."""
    from ray.train import Result

    storage = tmp_path / "storage"
    out = cli("--download.source", "sample", "--storage-root", str(storage), "--run-name", "default")
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((storage / "runs" / "default" / "summary.json").read_text())
    gate = OWN_GATES["idx"]  # evaluate.min_accuracy unset: MNIST's digits' own gate
    assert summary["status"] == "completed" and summary["evaluation"]["min_accuracy"] == gate
    assert summary["config"]["model"]["name"] == "resnet18" == PipelineConfig().model.name
    assert summary["test_accuracy"] >= gate
    # Scored with test-time augmentation, the accuracy without it reported beside it
    assert summary["evaluation"]["tta"] is True and 0.9 < summary["evaluation"]["accuracy_without_tta"] <= 1
    terminal = (out.stdout + out.stderr).splitlines()
    epochs = [line for line in terminal if " - epoch " in line]
    assert len(epochs) == summary["epochs"] == 12 and "epoch 12/12" in epochs[-1]
    assert sum(" done in " in line for line in terminal) == len(STAGE_CPUS) == 7  # one line per finished stage
    assert not any("Failed to query Ray Train Controller" in line or "Starting execution of Dataset" in line for line in terminal)
    assert len(terminal) < 60, "\n".join(terminal)
    assert any(line.startswith("Run default completed in ") for line in out.stdout.splitlines())

    # The seeds' contract, on a real ResNet-18 checkpoint written by Ray Train
    result = Result.from_path(summary["run_dir"])
    assert result.checkpoint is not None
    best = Path(summary["best_checkpoint"])
    assert best.parent == storage / "runs" / "default"
    assert {"model.pt", "optimizer.pt", "extra_state.pt"} <= {p.name for p in best.iterdir()}
    model = torchvision_resnet18_seed_style()
    model.load_state_dict(torch.load(best / "model.pt", map_location="cpu", weights_only=True))  # strict
    extra = torch.load(best / "extra_state.pt", weights_only=True)
    assert best.name == f"checkpoint_epoch-{extra['epoch']:04d}" and 0 <= extra["epoch"] < 12
    assert extra["metrics"]["epoch"] == extra["epoch"] and extra["metrics"]["val_accuracy"] == summary["best_val_accuracy"]
    assert extra["model"] == SEEDS_MODEL.model_dump() and checkpoint_model(best) == SEEDS_MODEL
