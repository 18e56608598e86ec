"""Run reports as Prefect artifacts: their stable keys, their tables' rows, and publishing.

One Prefect artifact per report under a stable key (``artifact_keys(workload)``), so every key
versions across runs in the UI's Artifacts page; a report that fails logs a warning instead of
failing the run. The pictures come from `reporting.pictures`; the live training progress is
`reporting.training_progress`'s.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from pipeline_config.common import DEFAULT_WORKLOAD
from reporting.environment import environment_rows
from reporting.logs import stage_logger
from reporting.pictures import (
    accuracy_over_runs_png,
    confusion_matrix_png,
    image_markdown,
    trial_curves_png,
)
from reporting.report_text import (
    checkpoint_markdown,
    comparison_rows,
    gate_verdict,
    leakage_warning,
    metrics_rows,
    training_markdown,
    trial_rows,
)
from reporting.samples import predictions_markdown, sample_digits_markdown

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
