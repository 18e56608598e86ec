"""The lines said while a stage runs: one per finished epoch of training, one per trial epoch of a search.

Both poll the run's ``history.jsonl`` files on storage from a daemon thread of the driver (never
the workers), so they read the same for a local Ray, a remote cluster and an ``s3://`` root; what
they say goes through `runner.console.say`, like every line for people.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from runner.console import duration, run_logger, say
from storage_io import join, list_dirs
from training.checkpoint.records import HISTORY_FILE, read_history


def epoch_line(row: dict[str, Any], epochs: int, elapsed_s: float, seconds_per_epoch: float | None) -> str:
    """``epoch 3/30  loss 0.412  val acc 98.50%  512 img/s  2m10s elapsed, ~19m left``."""
    epoch = int(row["epoch"]) + 1
    parts = [f"epoch {epoch}/{epochs}"]
    if "train_loss" in row:
        parts.append(f"loss {row['train_loss']:.3f}")
    if "val_accuracy" in row:
        parts.append(f"val acc {row['val_accuracy']:.2%}")
    if "images_per_s" in row:
        parts.append(f"{row['images_per_s']:.0f} img/s")
    timing = f"{duration(elapsed_s)} elapsed"
    if seconds_per_epoch is not None and epochs > epoch:
        timing += f", ~{duration(seconds_per_epoch * (epochs - epoch))} left"
    return "  ".join(parts) + "  " + timing


class _Watcher:
    """A daemon thread that says new lines every ``poll_s`` while a stage runs (a context manager).

    Subclasses give `_seen` (what is on storage already) and `_say_new` (say what is new). What is
    there when it starts (a resumed run) is not repeated; reading storage never fails the run.
    """

    def __init__(self, poll_s: float):
        self.poll_s = poll_s
        self.logger = run_logger()  # taken here, in the run's thread
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=type(self).__name__, daemon=True)
        self._start = time.monotonic()

    def _seen(self) -> None:
        raise NotImplementedError

    def _say_new(self) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self._say_new()

    def __enter__(self):
        self._seen()
        self._start = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        if exc_info[0] is None:
            self._say_new()  # the last lines, when the stage finished between two polls


class EpochWatcher(_Watcher):
    """Says one line per finished epoch while the training stage runs, by polling ``history.jsonl``."""

    def __init__(self, history_path: str, epochs: int, poll_s: float = 2.0, on_epoch: Callable[[], None] | None = None,
                 on_row: Callable[[dict], None] | None = None):
        super().__init__(poll_s)
        self.history_path, self.epochs = history_path, epochs
        self.on_epoch = on_epoch  # called after new epoch lines (the MLflow tracker logs them live)
        self.on_row = on_row  # called with each new epoch's row (its metrics for Prometheus, `reporting.metrics.epoch`)
        self._said: set[int] = set()
        self._finished: list[float] = []  # when each epoch was seen finished (monotonic seconds)

    def _rows(self) -> list[dict]:
        try:
            return read_history(self.history_path)
        except Exception:  # a half-written object, a storage hiccup: try again next round
            return []

    def _seen(self) -> None:
        self._said = {int(row["epoch"]) for row in self._rows()}  # a resumed run's earlier epochs

    def _seconds_per_epoch(self) -> float | None:
        """Mean time between the epochs seen finishing; None before two (the first carries the worker group's start)."""
        seen = self._finished
        return (seen[-1] - seen[0]) / (len(seen) - 1) if len(seen) >= 2 else None

    def _say_new(self) -> None:
        new = False
        for row in sorted(self._rows(), key=lambda r: r["epoch"]):
            epoch = int(row["epoch"])
            if epoch in self._said or row.get("mid_epoch"):
                continue
            self._said.add(epoch)
            self._finished.append(time.monotonic())
            line = epoch_line(row, self.epochs, self._finished[-1] - self._start, self._seconds_per_epoch())
            say(line, logger=self.logger)
            if self.on_row is not None:
                self.on_row(row)
            new = True
        if new and self.on_epoch is not None:
            self.on_epoch()


class TrialWatcher(_Watcher):
    """Says one line per finished trial epoch while the tune stage runs, by polling each trial's ``history.jsonl``.

    ``trial 36bed_00001 epoch 2/2  val_ce 0.1838  val acc 97.00%  1m41s elapsed``.
    """

    def __init__(self, trials_dir: str, epochs: int, metric: str, poll_s: float = 2.0):
        super().__init__(poll_s)
        self.trials_dir, self.epochs, self.metric = trials_dir, epochs, metric
        self._said: set[tuple[str, int]] = set()

    def _rows(self) -> list[tuple[str, dict]]:
        try:
            return [(trial, row) for trial in sorted(list_dirs(self.trials_dir))
                    for row in read_history(join(self.trials_dir, trial, HISTORY_FILE))]
        except Exception:  # a half-written object, a storage hiccup: try again next round
            return []

    def _seen(self) -> None:
        self._said = {(trial, int(row["epoch"])) for trial, row in self._rows()}  # a restored search's

    def _say_new(self) -> None:
        for trial, row in self._rows():
            key = (trial, int(row["epoch"]))
            if key in self._said or row.get("mid_epoch"):
                continue
            self._said.add(key)
            parts = [f"trial {trial} epoch {key[1] + 1}/{self.epochs}"]
            if self.metric in row:
                parts.append(f"{self.metric} {row[self.metric]:.4f}")
            if "val_accuracy" in row and self.metric != "val_accuracy":
                parts.append(f"val acc {row['val_accuracy']:.2%}")
            parts.append(f"{duration(time.monotonic() - self._start)} elapsed")
            say("  ".join(parts), logger=self.logger)
