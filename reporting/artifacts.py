"""Run reports as Prefect artifacts: their stable keys, their tables' rows, and publishing.

One Prefect artifact per report under a stable key (``artifact_keys(workload)``), so every key
versions across runs in the UI's Artifacts page; a report that fails logs a warning instead of
failing the run. The pictures come from `reporting.pictures`; the live training progress is
`reporting.training_progress`'s.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from pipeline_config.common import DEFAULT_WORKLOAD
from reporting.environment import environment_rows
from reporting.logs import stage_logger
from reporting.pictures import (
    accuracy_over_runs_png,
    confusion_matrix_png,
    image_markdown,
    predictions_markdown,
    sample_digits_markdown,
    training_curves_png,
    trial_curves_png,
)

# Artifact keys: lowercase letters, digits and dashes (Prefect's rule); stable across runs, each
# starting with the workload's name (pipeline_config's `workload`, e.g. mnist-test-metrics).
_KEY_SUFFIXES = {
    "samples": "sample-digits",
    "progress": "training-progress",
    "curves": "training-curves",
    "confusion": "confusion-matrix",
    "predictions": "test-predictions",
    "metrics": "test-metrics",
    "checkpoint": "checkpoint",
    "environment": "run-environment",
}


# What the tune flow's search adds (its train_best stages publish the keys above too).
_TUNE_KEY_SUFFIXES = {"trials": "tune-trials", "trial_curves": "tune-curves"}


def artifact_keys(workload: str = DEFAULT_WORKLOAD) -> dict[str, str]:
    """The pipeline's artifact keys for ``workload`` (``mnist-test-metrics``, ...)."""
    return {name: f"{workload}-{suffix}" for name, suffix in _KEY_SUFFIXES.items()}


def tune_keys(workload: str = DEFAULT_WORKLOAD) -> dict[str, str]:
    """The search's artifact keys for ``workload`` (``mnist-tune-trials``, ...)."""
    return {name: f"{workload}-{suffix}" for name, suffix in _TUNE_KEY_SUFFIXES.items()}


KEYS = artifact_keys()  # the default workload's (MNIST's) keys
TUNE_KEYS = tune_keys()


def comparison_keys(model: str) -> dict[str, str]:
    """Artifact keys of a model's run comparison (table and picture), stable across its runs."""
    return {"table": f"{model}-run-comparison", "picture": f"{model}-accuracy-over-runs"}


_T = TypeVar("_T")


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


def _best_effort(fn: Callable[..., _T]) -> Callable[..., _T | None]:
    """Run a publisher; on any error log a warning and return None (a report never fails a run)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> _T | None:
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            stage_logger(__name__).warning("Report %s not published: %s: %s", fn.__name__, type(exc).__name__, exc)
            return None

    return wrapper


@_best_effort
def publish_environment_report(env: dict[str, Any], workload: str = DEFAULT_WORKLOAD) -> list:
    """Publish what the run runs on (``reporting.environment.describe()``) as a table; returns the artifact ids."""
    from prefect.artifacts import create_table_artifact  # Prefect only when publishing

    description = f"Python {env.get('python')}, torch {env.get('packages', {}).get('torch')}, commit {env.get('git_commit')}"
    return [create_table_artifact(environment_rows(env), key=artifact_keys(workload)["environment"], description=description)]


@_best_effort
def publish_dataset_report(dataset, workload: str = DEFAULT_WORKLOAD) -> list:
    """Publish the sample-digits picture for a ``ParquetDataset``; returns the artifact ids."""
    from prefect.artifacts import create_markdown_artifact  # Prefect only when publishing

    markdown = sample_digits_markdown(dataset.split_dir("train"), dataset.rows["train"], tuple(dataset.image_shape), dataset.classes)
    return [create_markdown_artifact(markdown, key=artifact_keys(workload)["samples"], description="Nine training digits with labels")]


@_best_effort
def publish_training_report(trained, workload: str = DEFAULT_WORKLOAD) -> list:
    """Publish the training curves of a ``TrainedModel``; returns the artifact ids."""
    from prefect.artifacts import create_markdown_artifact  # Prefect only when publishing

    markdown = training_markdown(trained)
    return [create_markdown_artifact(markdown, key=artifact_keys(workload)["curves"], description="Loss and accuracy per epoch")]


def training_markdown(trained) -> str:
    """The training report of a ``TrainedModel``: its curves, best validation accuracy, and what the run was warned of."""
    best = f"Best validation accuracy {trained.best_val_accuracy:.4f}."
    warned = "".join(f"\n\n**Warning:** {warning}" for warning in getattr(trained, "warnings", []))
    return image_markdown("Training curves", training_curves_png(trained.history), best + warned)


@_best_effort
def publish_tuning_report(
    trials: Sequence[dict[str, Any]], metric: str, best_id: str, config_path: str, workload: str = DEFAULT_WORKLOAD
) -> list:
    """Publish the trial table and the per-epoch curves of a search; returns the artifact ids."""
    from prefect.artifacts import create_markdown_artifact, create_table_artifact  # Prefect only when publishing

    keys = tune_keys(workload)
    stopped = sum(trial.get("status") == "stopped early" for trial in trials)
    description = f"{len(trials)} trial(s), {stopped} stopped early; best {best_id}, its config: {config_path}"
    table = create_table_artifact(trial_rows(trials, metric, best_id), key=keys["trials"], description=description)
    caption = f"Dashed lines ending in x: trials ASHA stopped early. Best trial {best_id}; its config: {config_path}"
    picture = image_markdown(f"Trials: {metric} per epoch", trial_curves_png(trials, metric, best_id), caption)
    curves = create_markdown_artifact(picture, key=keys["trial_curves"], description=f"{metric} per epoch for every trial")
    return [table, curves]


@_best_effort
def publish_evaluation_report(evaluation, dataset, trained, workload: str = DEFAULT_WORKLOAD) -> list:
    """Publish confusion matrix, test predictions, metrics table and checkpoint; returns the artifact ids.

    Called by the evaluation stage before its gate decides, so every report says whether the
    gate passed (in its title, the metrics table's ``gate`` column and the descriptions).
    """
    from prefect.artifacts import create_markdown_artifact, create_table_artifact  # Prefect only when publishing

    keys = artifact_keys(workload)
    gate = gate_verdict(evaluation.accuracy, evaluation.min_accuracy, getattr(evaluation, "gate_failures", ()))
    leaked = leakage_warning(dataset)
    confusion = image_markdown(
        f"Confusion matrix ({gate})",
        confusion_matrix_png(evaluation.confusion, dataset.classes),
        f"Test accuracy **{evaluation.accuracy:.4f}** on {evaluation.rows} images; {gate}"
        + (f" (the gate: {evaluation.gate})." if getattr(evaluation, "gate", "") else ".")
        + (f"\n\n**Warning:** {leaked}" if leaked else ""),
    )
    checkpoints = [c.model_dump() for c in trained.checkpoints]
    return [
        create_markdown_artifact(confusion, key=keys["confusion"], description=f"True vs predicted digit counts; {gate}"),
        create_markdown_artifact(
            predictions_markdown(evaluation.predictions_path, dataset.split_dir("test"), gate, tuple(dataset.image_shape), dataset.classes),
            key=keys["predictions"],
            description=f"Test digits with true and predicted labels; {gate}",
        ),
        create_table_artifact(
            metrics_rows(evaluation.confusion, evaluation.precision, evaluation.recall, gate, dataset.classes),
            key=keys["metrics"],
            description=f"Per-class test metrics; accuracy {evaluation.accuracy:.4f}; {gate}" + (f"; {leaked}" if leaked else ""),
        ),
        create_markdown_artifact(
            checkpoint_markdown(evaluation.checkpoint, checkpoints, trained.run_dir, evaluation.accuracy, gate),
            key=keys["checkpoint"],
            description=f"Path of the checkpoint evaluation used; {gate}",
        ),
    ]


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


@_best_effort
def publish_run_comparison(model: str, runs: Sequence[dict[str, Any]], promotion: dict[str, Any] | None) -> list:
    """Publish a model's recent runs as a table and the accuracy-over-runs picture (stable keys per model)."""
    from prefect.artifacts import create_markdown_artifact, create_table_artifact  # Prefect only when publishing

    keys = comparison_keys(model)
    verdict = f"this run: {'promoted' if promotion and promotion.get('promoted') else 'not promoted'}"
    if promotion:
        verdict += f" ({promotion.get('reason')})"
    description = f"Recent runs of {model}, newest first; {verdict}"
    table = create_table_artifact(comparison_rows(runs), key=keys["table"], description=description)
    caption = f"Stars: promoted runs; ringed: the current champion; red crosses: gate failed. {verdict.capitalize()}."
    picture = image_markdown(f"{model}: test accuracy over runs", accuracy_over_runs_png(runs), caption)
    chart = create_markdown_artifact(picture, key=keys["picture"], description=f"Test accuracy of recent runs of {model}")
    return [table, chart]
