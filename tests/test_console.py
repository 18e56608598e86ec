"""What the terminal shows: stage and epoch lines, the quiet filter, the short summary, epochs per data size."""

from __future__ import annotations

import json
import logging
import sys
import time

import pytest
from prefect.logging.handlers import PrefectConsoleHandler

from pipeline_config import TrainConfig
from runner import console, watchers
from runner.summary import RunSummary
from training.checkpoint.records import record_epoch


def test_duration_reads_like_a_clock():
    assert console.duration(12.34) == "12.3s"
    assert console.duration(75.2) == "1m15s"
    assert console.duration(3725) == "1h02m05s"


def test_epoch_line_has_progress_loss_accuracy_speed_and_time_left():
    row = {"epoch": 2, "train_loss": 0.41234, "val_accuracy": 0.985, "images_per_s": 511.7}
    line = watchers.epoch_line(row, 30, elapsed_s=130, seconds_per_epoch=40)
    assert line == "epoch 3/30  loss 0.412  val acc 98.50%  512 img/s  2m10s elapsed, ~18m00s left"
    last = watchers.epoch_line(row | {"epoch": 29}, 30, elapsed_s=1200, seconds_per_epoch=40)
    assert last.endswith("20m00s elapsed")  # nothing left to estimate


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_epoch_watcher_says_each_new_epoch_once_and_skips_a_resumed_runs_earlier_epochs(tmp_path):
    history = str(tmp_path / "history.jsonl")
    record_epoch(history, {"epoch": 0, "train_loss": 1.0, "val_accuracy": 0.5, "images_per_s": 100.0})  # before a resume
    collected = _Records()
    logging.getLogger("runner.console").addHandler(collected)  # the watcher's logger outside a Prefect run
    try:
        with watchers.EpochWatcher(history, epochs=4, poll_s=0.05):
            for epoch in (1, 2, 3):
                time.sleep(0.2)
                record_epoch(history, {"epoch": epoch, "train_loss": 0.5, "val_accuracy": 0.9, "images_per_s": 200.0})
            time.sleep(0.3)
    finally:
        logging.getLogger("runner.console").removeHandler(collected)
    lines = [r.getMessage() for r in collected.records if getattr(r, console.CONSOLE_FLAG, False)]
    assert [line.split("  ")[0] for line in lines] == ["epoch 2/4", "epoch 3/4", "epoch 4/4"]
    # No estimate from the first epoch seen (it carries the start-up), one from the second on, none at the end.
    assert ["left" in line for line in lines] == [False, True, False]


def test_trial_watcher_says_each_trial_epoch_once_and_skips_a_restored_searchs_earlier_ones(tmp_path):
    trials = tmp_path / "trials"
    record_epoch(str(trials / "t_00000" / "history.jsonl"), {"epoch": 0, "val_ce": 0.9, "val_accuracy": 0.7})  # before a restore
    collected = _Records()
    logging.getLogger("runner.console").addHandler(collected)
    try:
        with watchers.TrialWatcher(str(trials), epochs=2, metric="val_ce", poll_s=0.05):
            time.sleep(0.2)
            record_epoch(str(trials / "t_00000" / "history.jsonl"), {"epoch": 1, "val_ce": 0.5, "val_accuracy": 0.8})
            record_epoch(str(trials / "t_00001" / "history.jsonl"), {"epoch": 0, "val_ce": 1.5, "val_accuracy": 0.4})
            time.sleep(0.3)
    finally:
        logging.getLogger("runner.console").removeHandler(collected)
    lines = sorted(r.getMessage() for r in collected.records if getattr(r, console.CONSOLE_FLAG, False))
    assert [line.split("  ")[:3] for line in lines] == [
        ["trial t_00000 epoch 2/2", "val_ce 0.5000", "val acc 80.00%"], ["trial t_00001 epoch 1/2", "val_ce 1.5000", "val acc 40.00%"]]


def _console_handler() -> PrefectConsoleHandler:
    from prefect.logging.configuration import ensure_logging_setup

    ensure_logging_setup()
    return next(h for h in logging.getLogger().handlers if isinstance(h, PrefectConsoleHandler))


def _record(level: int, message: str, console_line: bool = False, exc_info=None) -> logging.LogRecord:
    record = logging.LogRecord("tests.console", level, __file__, 1, message, None, exc_info)
    if console_line:
        setattr(record, console.CONSOLE_FLAG, True)
    return record


def test_quiet_terminal_passes_console_lines_and_warnings_without_tracebacks():
    """Prefect's console handler, while quiet: engine chatter held back, errors in one line; restored after."""
    handler = _console_handler()
    chatter = _record(logging.INFO, "Created task run 'train-123'")
    stage_line = _record(logging.INFO, "[4/6] train done in 1.0s", console_line=True)
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        error = _record(logging.ERROR, "stage failed", exc_info=sys.exc_info())
    with console.quiet_terminal():
        assert not handler.filter(chatter)
        assert handler.filter(stage_line) and handler.filter(error)
        shown = handler.format(error)
        assert "stage failed" in shown and "Traceback" not in shown  # the UI keeps the traceback
    assert error.exc_info is not None  # the record other handlers (the UI's) see is untouched
    assert handler.filter(chatter)
    assert "Traceback" in handler.format(error)


def test_summary_lines_for_a_failed_gate_name_the_gate_folder_and_resume_command():
    summary = {
        "run_name": "r1", "storage_root": "/data", "run_dir": "/data/runs/r1",
        "stages": {"train": {"status": "completed"}, "evaluate": {"status": "failed"}},
        "evaluation": {"accuracy": 0.984, "min_accuracy": 0.985, "rows": 1000},
    }
    lines = console.summary_lines(RunSummary.model_validate(summary), RuntimeError("gate"), 250.0, "http://127.0.0.1:4200/api", False)
    text = "\n".join(lines)
    assert lines[0] == "Run r1 FAILED in stage evaluate after 4m10s: RuntimeError: gate"
    assert "98.40% on 1000 images (gate 98.50%: FAILED)" in text
    assert "/data/runs/r1/summary.json" in text and "Prefect UI     http://127.0.0.1:4200\n" in text + "\n"
    assert "python -m flows.mnist --run-name r1 --storage-root /data" in text
    ok = console.summary_lines(RunSummary.model_validate(summary | {"evaluation": {"accuracy": 0.99, "min_accuracy": 0.985, "rows": 1000}}), None, 61, None, True)
    assert ok[0] == "Run r1 completed in 1m01s." and not any("resume" in line for line in ok)
    linked = console.summary_lines(RunSummary.model_validate(summary | {"flow_run_id": "abc"}), None, 61, "http://127.0.0.1:4200/api", False)
    assert "  Prefect UI     http://127.0.0.1:4200/runs/flow-run/abc" in linked


@pytest.mark.parametrize(("rows", "epochs"), [(3_800, 12), (57_000, 3), (1_000_000, 1), (100, 12)])
def test_epochs_follow_the_data_size(rows, epochs):
    assert TrainConfig().epochs_for(rows) == epochs


def test_max_images_zero_keeps_every_epoch():
    assert TrainConfig(max_images=0, epochs=30).epochs_for(57_000) == 30
    assert json.loads(TrainConfig().model_dump_json())["max_images"] == 150_000


def test_summary_lines_say_whether_the_model_was_promoted_and_how_to_predict_with_the_champion():
    summary = {"run_name": "r2", "storage_root": "/data/my root", "run_dir": "/data/my root/runs/r2"}
    promoted = {"model": "mnist-resnet18", "promoted": True, "version": 3, "reason": "test accuracy 99.10% beats champion v2's 98.90%"}
    text = "\n".join(console.summary_lines(RunSummary.model_validate(summary | {"promotion": promoted}), None, 61, None, True))
    assert "  model          promoted: mnist-resnet18 v3 is the champion (test accuracy 99.10% beats champion v2's 98.90%)" in text
    assert "-m flows.predict --storage-root '/data/my root' --input <folder" in text
    assert "  serve          " in text and "-m deployments.serve_model --storage-root '/data/my root'  (the champion" in text
    lost = {"model": "digits", "promoted": False, "version": 2, "reason": "test accuracy 98.00% does not beat champion v2's 98.90%"}
    text = "\n".join(console.summary_lines(RunSummary.model_validate(summary | {"promotion": lost}), None, 61, None, True))
    assert "  model          not promoted: test accuracy 98.00% does not beat champion v2's 98.90%" in text
    assert "--model digits" in text
    first_failed = {"model": "mnist-resnet18", "promoted": False, "version": None, "reason": "gate failed (test accuracy 40.00%)"}
    lines = console.summary_lines(RunSummary.model_validate(summary | {"promotion": first_failed}), RuntimeError("gate"), 61, None, True)
    assert "  model          not promoted: gate failed (test accuracy 40.00%)" in lines
    assert not any("flows.predict" in line or "serve_model" in line for line in lines)  # no champion to predict with
