"""A run too short to learn is said before training: the optimizer steps it makes, and the fix (issue 45).

The step count is the training loop's own (`training.worker.loop.start_attempt`); the warning reaches the
terminal, the training report and ``summary.json``.
"""

from __future__ import annotations

import io
import json
import logging
from types import SimpleNamespace

import pytest
import torch
from prefect.logging.configuration import ensure_logging_setup
from prefect.logging.handlers import PrefectConsoleHandler

from dataset.formats.parquet import ParquetDataset
from flows.stages import TRAIN
from flows.train import STAGES
from pipeline_config import PipelineConfig, TrainConfig
from pipeline_config.learning import FEW_STEPS, steps_per_epoch
from reporting.report_text import training_markdown
from runner import console
from runner.stages import StageRecorder
from storage_io import StorageLayout
from training.manifests import LoopConfig, TrainedModel
from training.model.catalog import ModelSpec
from training.trainer import loop_config
from training.worker.loop import start_attempt

SMALL = ModelSpec(name="training.model.catalog:small_cnn", in_channels=1, num_classes=10)
SHORT = (
    "this run makes 24 optimizer steps (190 training images / global batch 128 = 2 steps an epoch x 12 epochs); "
    "the default recipe needs about 100 or more to learn: lower train.global_batch_size (e.g. 16 gives 144) "
    "or raise train.epochs (e.g. 50 gives 100)"
)


@pytest.mark.parametrize(
    ("rows", "batch", "workers"),
    [(190, 128, 1), (190, 128, 2), (3800, 128, 1), (3800, 128, 3), (1000, 100, 3), (57_000, 256, 4), (5, 8, 4), (129, 1, 1)],
)
def test_the_step_count_is_the_training_loops(rows, batch, workers):
    cfg = TrainConfig(global_batch_size=batch, num_workers=workers)
    threads = torch.get_num_threads()  # start_attempt sets the process's threads: keep them
    loop = LoopConfig.model_validate(loop_config(cfg, rows, threads, SMALL))
    attempt = start_attempt(loop, workers, torch.device("cpu"), prepare=lambda model: model)
    assert steps_per_epoch(rows, batch, workers) == attempt.steps_per_epoch
    assert cfg.optimizer_steps(rows) == attempt.steps_per_epoch * loop.epochs
    assert cfg.optimizer_steps(rows, workers=1) == steps_per_epoch(rows, batch) * loop.epochs


def test_single_mode_counts_one_worker():
    assert TrainConfig(mode="single", num_workers=4, global_batch_size=8).optimizer_steps(30) == 4 * 12
    assert TrainConfig(num_workers=4, global_batch_size=8).optimizer_steps(30) == 4 * 12  # 2 rows a rank a step


def test_a_24_step_run_is_warned_with_its_numbers_and_the_fix():
    assert TrainConfig(global_batch_size=128).optimizer_steps(190) == 24  # the issue's case: the default before 64
    assert TrainConfig(global_batch_size=128).few_steps_warning(190) == SHORT
    assert TrainConfig().few_steps_warning(190).startswith(
        "this run makes 36 optimizer steps (190 training images / global batch 64 = 3 steps an epoch x 12 epochs)"
    )


def test_the_fix_follows_the_numbers():
    two = TrainConfig(num_workers=2, global_batch_size=128).few_steps_warning(190)
    assert "global batch 128 over 2 workers = 2 steps an epoch x 12 epochs" in two
    capped = TrainConfig(max_images=1000, global_batch_size=128).few_steps_warning(190)  # 6 epochs: the cap holds raised epochs back
    assert capped.startswith("this run makes 12 optimizer steps")
    assert "e.g. 8 gives 144" in capped and "raise train.epochs and train.max_images (e.g. 50 and 9500 give 100)" in capped
    tiny = TrainConfig(epochs=1).few_steps_warning(10)  # no batch size reaches 100 steps on 10 images in 1 epoch
    assert tiny.endswith("to learn: raise train.epochs (e.g. 100 gives 100)") and "1 optimizer step (" in tiny


def test_enough_steps_say_nothing():
    assert TrainConfig().optimizer_steps(3800) >= FEW_STEPS  # the bundled sample: 60 steps an epoch x 12
    assert TrainConfig().few_steps_warning(3800) is None
    assert TrainConfig(global_batch_size=16).few_steps_warning(190) is None


def _recorder(tmp_path, config: PipelineConfig, train_rows: int) -> StageRecorder:
    layout = StorageLayout.create(str(tmp_path), "short-run")
    recorder = StageRecorder(None, layout, config, {}, STAGES)
    dataset = ParquetDataset(
        directory=str(tmp_path / "datasets" / "shapes"), fingerprint="f", rows={"train": train_rows, "val": 10, "test": 50},
    )
    recorder.outputs["to-parquet"] = dataset
    return recorder


def _train_starts(recorder: StageRecorder) -> None:
    """What the training stage does before its task starts (`flows.stages.Train.starting`): the warning, if any."""
    spec = SimpleNamespace(dataset=recorder.outputs["to-parquet"])
    TRAIN.starting(recorder, {"cfg": recorder.config.train, "spec": spec})


def _terminal() -> PrefectConsoleHandler:
    """Prefect's console handler: what the CLI's terminal shows."""
    ensure_logging_setup()
    return next(h for h in logging.getLogger().handlers if isinstance(h, PrefectConsoleHandler))


def test_the_warning_reaches_the_terminal_and_summary_json(tmp_path, caplog):
    recorder = _recorder(tmp_path, PipelineConfig(train={"global_batch_size": 128}), 190)  # the issue's 24-step run
    terminal, shown = _terminal(), io.StringIO()
    screen, terminal.console.file = terminal.console.file, shown
    try:
        with console.quiet_terminal(), caplog.at_level(logging.INFO):
            _train_starts(recorder)
            _train_starts(recorder)  # a stage retried: said once
    finally:
        terminal.console.file = screen
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [SHORT]
    lines = [line for line in shown.getvalue().splitlines() if "optimizer steps" in line]
    assert len(lines) == 1 and "WARNING" in lines[0] and lines[0].endswith(SHORT)  # one line, through the quiet terminal
    summary = recorder.write_summary()
    assert summary.warnings == [SHORT]
    assert json.loads((tmp_path / "runs" / "short-run" / "summary.json").read_text())["warnings"] == [SHORT]


def test_a_run_with_enough_steps_has_no_warnings(tmp_path):
    recorder = _recorder(tmp_path, PipelineConfig(), 3800)
    _train_starts(recorder)
    assert recorder.write_summary().to_json()["warnings"] == []


def test_the_training_report_says_it():
    history = [{"epoch": e, "train_loss": 1.0 / (e + 1), "val_loss": 1.2 / (e + 1), "val_accuracy": 0.4} for e in range(3)]
    trained = TrainedModel(
        run_dir="/runs/r", model=SMALL, best_checkpoint="/runs/r/c", best_val_accuracy=0.425, checkpoints=[], history=history,
        num_workers=1, cpus_per_worker=1.0, warnings=[SHORT],
    )
    assert f"**Warning:** {SHORT}" in training_markdown(trained)
    assert "Warning" not in training_markdown(trained.model_copy(update={"warnings": []}))
