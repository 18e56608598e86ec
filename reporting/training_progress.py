"""Live training progress in the Prefect UI: a Ray Train callback that moves a progress artifact every epoch."""

from __future__ import annotations

import logging
from typing import Any

from ray.train import UserCallback

from pipeline_config.common import DEFAULT_WORKLOAD
from reporting.artifacts import artifact_keys
from reporting.logs import stage_logger


def progress_percent(epoch: int, epochs: int) -> float:
    """Progress after finishing 0-based ``epoch`` of ``epochs``, in percent (0..100)."""
    return round(min(max((epoch + 1) / max(epochs, 1) * 100.0, 0.0), 100.0), 2)


def epoch_line(metrics: dict[str, Any], epochs: int) -> str:
    """One line describing a finished epoch, e.g. ``epoch 3/20: train loss 0.41, val accuracy 0.9812``."""
    parts = [f"epoch {int(metrics['epoch']) + 1}/{epochs}"]
    if "train_loss" in metrics:
        parts.append(f"train loss {metrics['train_loss']:.4f}")
    if "val_accuracy" in metrics:
        parts.append(f"val accuracy {metrics['val_accuracy']:.4f}")
    return parts[0] + (": " + ", ".join(parts[1:]) if len(parts) > 1 else "")


class TrainingProgress(UserCallback):
    """Ray Train callback that moves the Prefect progress artifact after every reported epoch.

    Runs in the Ray Train controller process, which reaches the flow's Prefect API through
    ``PREFECT_API_URL`` in the Ray job's runtime environment. An update that fails is logged and
    dropped: progress is informational and must never stop training.
    """

    def __init__(self, artifact_id: str, epochs: int):
        self.artifact_id, self.epochs = str(artifact_id), epochs

    def after_report(self, run_context, metrics: list[dict[str, Any]], checkpoint) -> None:
        if not metrics or "epoch" not in metrics[0] or metrics[0].get("mid_epoch"):
            return
        from prefect.artifacts import update_progress_artifact  # not at import: Ray Train's controller loads this

        try:
            # _sync: the controller calls callbacks from inside its asyncio loop, where Prefect
            # would otherwise hand back an un-awaited coroutine and update nothing.
            update_progress_artifact(
                artifact_id=self.artifact_id,
                progress=progress_percent(int(metrics[0]["epoch"]), self.epochs),
                description=f"Training: {epoch_line(metrics[0], self.epochs)}",
                _sync=True,
            )
        except Exception as exc:
            logging.getLogger(__name__).warning("Progress artifact %s not updated: %s", self.artifact_id, exc)


def training_progress_callbacks(epochs: int, run_name: str, workload: str = DEFAULT_WORKLOAD) -> list[TrainingProgress]:
    """Create the training progress artifact (at 0%) and return the callback that moves it.

    Returns an empty list, with a warning, when the artifact cannot be created (no Prefect
    API, for example): training then runs without live progress. Outside a Prefect task run (the
    stage function called directly, as the benchmarks do) there is no run to attach it to, and
    creating it would start a temporary Prefect server here and another one in the Ray Train
    controller: no callback then.
    """
    from prefect.context import TaskRunContext  # not at import: Ray Train's controller loads this

    if TaskRunContext.get() is None:
        return []
    try:
        from prefect.artifacts import create_progress_artifact  # not at import: Ray Train's controller loads this

        artifact_id = create_progress_artifact(
            0.0, key=artifact_keys(workload)["progress"], description=f"Training {run_name}: starting, {epochs} epoch(s)", _sync=True
        )
    except Exception as exc:
        stage_logger(__name__).warning("No training progress artifact: %s: %s", type(exc).__name__, exc)
        return []
    return [TrainingProgress(str(artifact_id), epochs)]
