"""What the run's reports say, without Prefect: their table rows (metrics, trials, the run comparison), the gate's verdict, and the markdown of the checkpoint, the training and a leakage warning."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from reporting.pictures import (
    image_markdown,
    training_curves_png,
)


def trial_rows(trials: Sequence[dict[str, Any]], metric: str, best_id: str | None = None) -> list[dict[str, Any]]:
    """The trial table, one row per trial in the given order: id, sampled config, best metric, epochs run, how it ended."""
    rows = []
    for trial in trials:
        config = trial.get("config") or {}
        value = trial.get("best_metric")
        rows.append(
            {
                "trial": trial["trial_id"] + (" (best)" if trial["trial_id"] == best_id else ""),
                "learning_rate": f"{config.get('learning_rate', float('nan')):.3g}",
                "weight_decay": f"{config.get('weight_decay', float('nan')):.3g}",
                "global_batch_size": config.get("global_batch_size"),
                "augmentation": f"{config.get('augmentation', float('nan')):.2f}",
                "label_smoothing": f"{config.get('label_smoothing', float('nan')):.3f}",
                f"best {metric}": "-" if value is None else f"{value:.4f}",
                "epochs run": trial.get("epochs_run"),
                "stopped early": "yes" if trial.get("status") == "stopped early" else "no",
                "status": trial.get("status"),
            }
        )
    return rows


def comparison_rows(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Recent runs of one model, newest first, as rows of the run-comparison table.

    Args:
        runs: Run rows as the evaluation stage records them (``training.champion.registry.record_run``),
            each possibly marked ``champion`` (the current one).

    Returns:
        Rows with date, run, data hash, test accuracy, validation loss, epochs, train images/s,
        wall time and whether the run was promoted (its version, and ``champion`` for the current one).
    """

    def rounded(value: Any, digits: int) -> Any:
        return round(value, digits) if isinstance(value, (int, float)) else None

    table = []
    for run in reversed(runs):
        promoted = "no: gate failed" if not run.get("passed_gate") else "no"
        if run.get("version") and run.get("promoted"):
            promoted = f"v{run['version']}" + (" (champion)" if run.get("champion") else "")
        table.append({  # what decides first (the UI cuts a wide table at the right)
            "date": str(run.get("finished_at", ""))[:19].replace("T", " "),
            "run": run.get("run"),
            "test_accuracy": rounded(run.get("test_accuracy"), 4),
            "promoted": promoted,
            "val_loss": rounded(run.get("val_loss"), 4),
            "epochs": run.get("epochs"),
            "train_images_per_s": rounded(run.get("train_images_per_s"), 1),
            "wall_s": rounded(run.get("wall_s"), 1),
            "data": str(run.get("data_hash") or "")[:12],
        })
    return table


def gate_verdict(accuracy: float, min_accuracy: float, failures: Sequence[str] = ()) -> str:
    """``gate passed: 98.90% >= 98.50%`` or ``gate FAILED: 98.40% < 98.50%``; ``failures``: what else failed
    the gate (`tasks.gate.failures`: a class never right, a test split too small to tell)."""
    if accuracy >= min_accuracy:
        return f"gate FAILED: {'; '.join(failures)}" if failures else f"gate passed: {accuracy:.2%} >= {min_accuracy:.2%}"
    return f"gate FAILED: {accuracy:.2%} < {min_accuracy:.2%}"


def metrics_rows(
    confusion: Sequence[Sequence[int]], precision: Sequence[float], recall: Sequence[float], gate: str | None = None,
    classes: Sequence[str] | None = None,
) -> list[dict]:
    """An ``all`` row, then one row per class (support, correct, precision, recall), named by ``classes`` (unset: numbers).

    Args:
        confusion: ``confusion[true][pred]`` counts.
        precision: Per-class precision.
        recall: Per-class recall.
        gate: The gate's verdict (``gate_verdict``), shown in the ``all`` row's ``gate`` column.

    Returns:
        Rows for a Prefect table artifact; the ``all`` row has macro-averaged precision and
        recall, the overall ``accuracy`` and the ``gate`` verdict (empty on the per-class rows).
    """
    matrix = np.asarray(confusion, dtype=np.int64)
    support, correct = matrix.sum(1), np.diag(matrix)
    per_class = [
        {
            "class": str(classes[digit]) if classes is not None and len(classes) == len(matrix) else str(digit),
            "support": int(support[digit]),
            "correct": int(correct[digit]),
            "precision": round(float(precision[digit]), 4),
            "recall": round(float(recall[digit]), 4),
            "accuracy": None,
            "gate": None,
        }
        for digit in range(len(matrix))
    ]
    total = int(matrix.sum())
    overall = {
        "class": "all",
        "support": total,
        "correct": int(correct.sum()),
        "precision": round(float(np.mean(precision)), 4),
        "recall": round(float(np.mean(recall)), 4),
        "accuracy": round(float(correct.sum() / max(total, 1)), 4),
        "gate": gate,
    }
    return [overall, *per_class]  # overall first: the UI pages tables ten rows at a time


def checkpoint_markdown(
    checkpoint: str, checkpoints: Sequence[dict], run_dir: str, accuracy: float | None, gate: str | None = None
) -> str:
    """Where the evaluated checkpoint lives, what it scored, and how to load it.

    Args:
        checkpoint: Path of the checkpoint evaluation used.
        checkpoints: Kept checkpoints as dicts with ``path``, ``epoch`` and ``val_accuracy``.
        run_dir: The run folder.
        accuracy: Test accuracy of ``checkpoint`` (None when unknown).
        gate: The gate's verdict (``gate_verdict``), added to the title.

    Returns:
        The markdown document.
    """
    lines = [
        "## Checkpoint used for evaluation" + (f" ({gate})" if gate else ""),
        "",
        f"`{checkpoint}`",
        "",
    ]
    if accuracy is not None:
        lines += [f"Test accuracy: **{accuracy:.4f}**", ""]
    lines += ["| kept checkpoint | epoch | val accuracy |", "| --- | --- | --- |"]
    for info in sorted(checkpoints, key=lambda c: c["epoch"]):
        marker = " (evaluated)" if info["path"] == checkpoint else ""
        lines.append(f"| `{Path(info['path']).name}`{marker} | {int(info['epoch']) + 1} | {info['val_accuracy']:.4f} |")
    lines += [
        "",
        f"Run folder: `{run_dir}`. Load it with `training.checkpoint.model_files.load_model(\"{checkpoint}\")`.",
    ]
    return "\n".join(lines) + "\n"


def training_markdown(trained) -> str:
    """The training report of a ``TrainedModel``: its curves, best validation accuracy, and what the run was warned of."""
    best = f"Best validation accuracy {trained.best_val_accuracy:.4f}."
    warned = "".join(f"\n\n**Warning:** {warning}" for warning in getattr(trained, "warnings", []))
    return image_markdown("Training curves", training_curves_png(trained.history), best + warned)


def leakage_warning(dataset) -> str:
    """What the evaluation report says when test or validation rows of ``dataset`` (a ``ParquetDataset``) are exact
    copies of training images (its ``leakage``, from the to-parquet stage), or "" when none is."""
    leakage = getattr(dataset, "leakage", None) or {}
    rows = dataset.rows
    parts = [f"{leakage[split]:,} of the {rows.get(split, 0):,} {name} images" for split, name in (("test", "test"), ("val", "validation"))
             if leakage.get(split)]
    if not parts:
        return ""
    return (f"{' and '.join(parts)} are exact copies of training images (leakage): the accuracy overstates what the "
            "model learned; remove them, or set parquet.leakage=error to refuse such data")
