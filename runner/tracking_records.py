"""What an MLflow run is made of, read without MLflow: the tracking URI a run may use, its config as flat params, the
epoch rows, trials and files the pipeline run has on storage, the evaluation's files, the Prefect UI link it carries."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pipeline_config import PipelineConfig
from pipeline_config.tracking import TRACKING_URI_ENV, check_tracking_uri
from reporting import pictures
from storage_io import join, list_dirs, list_files, redact_text
from training.checkpoint.records import read_history

logger = logging.getLogger(__name__)


def tracking_uri(config: PipelineConfig) -> str | None:
    """Where runs are tracked: ``tracking.uri``, else ``MLFLOW_TRACKING_URI``; None: tracking is off.

    The variable is held to ``tracking.uri``'s rules (`check_tracking_uri`): ValueError naming it, for
    the preflight (`runner.harness`) to refuse the run before any work, when the tracker cannot use it.
    """
    if config.tracking.uri:
        return config.tracking.uri
    value = os.environ.get(TRACKING_URI_ENV, "").strip()
    return check_tracking_uri(value, TRACKING_URI_ENV) if value else None


def flat_params(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """The whole config as MLflow params: ``train.epochs`` -> ``12`` (lists and unset values as JSON; URLs redacted)."""
    params: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            params |= flat_params(value, f"{name}.")
        else:
            params[name] = json.dumps(value) if not isinstance(value, str) else redact_text(value)
    return params


def epoch_rows(history_path: str) -> dict[int, dict[str, Any]]:
    """Rank 0's finished-epoch rows by global epoch (a mid-epoch row, or an earlier attempt's row of an
    epoch trained again, gives way to the last finished one)."""
    try:
        rows = read_history(history_path)
    except Exception:  # noqa: BLE001 - no history yet, a half-written object
        return {}
    return {int(row["epoch"]): row for row in rows if "epoch" in row and not row.get("mid_epoch")}


def trial_ids(trials_dir: str) -> list[str]:
    try:
        return sorted(list_dirs(trials_dir))
    except Exception:  # noqa: BLE001
        return []


def stored_files(folder: str) -> Iterator[str]:
    for name in list_files(folder):
        yield join(folder, name)


def prefect_ui_url() -> str | None:
    """The Prefect UI this run reports to: PREFECT_UI_URL, else the API's address without /api."""
    from prefect.settings import PREFECT_API_URL, PREFECT_UI_URL  # only when MLflow tracks the run

    ui, api = PREFECT_UI_URL.value(), PREFECT_API_URL.value()
    return ui or (api.removesuffix("/").removesuffix("/api") if api else None)


def link_in_prefect(url: str, workload: str) -> None:
    """The Prefect run page's link to the MLflow run (a link artifact, outside a flow run: nothing)."""
    try:
        from prefect.artifacts import create_link_artifact  # only when MLflow tracks the run

        create_link_artifact(url, link_text="the MLflow run", key=f"{workload}-mlflow-run", description="This run in MLflow")
    except Exception as exc:  # noqa: BLE001 - a report must not fail the run
        logger.warning("could not publish the MLflow link to Prefect: %s", redact_text(str(exc)))


def evaluation_files(out: Path, evaluation: dict[str, Any], history: list[dict[str, Any]]) -> None:
    """The evaluation's files as the MLflow run keeps them, written in ``out``: the confusion matrix and the training
    curves (PNG, when there are any) and ``metrics.json``."""
    if evaluation.get("confusion"):
        (out / "confusion_matrix.png").write_bytes(pictures.confusion_matrix_png(evaluation["confusion"], evaluation.get("classes") or None))
    if history:
        (out / "training_curves.png").write_bytes(pictures.training_curves_png(history))
    (out / "metrics.json").write_text(json.dumps(evaluation, indent=2))
