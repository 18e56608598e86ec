"""Batch scoring with a champion: a folder of images scored, the predictions kept on storage by version.

The deployment ``score/on-promotion`` (`deployments.reacting`) runs this flow on each
``pipeline.model.promoted`` event of its model, so downstream jobs read the latest predictions
without asking which model made them:

    <root>/predictions/<model>/v<version>/<input folder name>.parquet   row_id, label, pred, pred_class
    <root>/predictions/<model>/latest.json                              the newest version's file, with its accuracy

Scoring is `flows.predict`'s (the model card's normalization and test-time augmentation, the
evaluation stage's actor pool); this flow adds where the file goes, the pointer and the event
``pipeline.predictions.written``. Its parameters choose the model card, so a run started through a
deployment builds the card's architecture only from the modules ``PIPELINE_MODEL_MODULES`` allows, as
a training run's ``model.name`` (`training.champion.card_scoring.card_scoring`); the refusal comes before any model is built.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from prefect import flow

from dataset.inputs.tables import NO_LABEL
from flows.predict import predictions_parquet, score_table
from pipeline_config import PipelineConfig, RayConfig
from reporting import events
from runner.pipeline_run import started_by_deployment
from storage_io import StorageLayout, atomic_write_bytes, atomic_write_json, basename, join, to_stored
from training.champion import lookup
from training.champion.card_scoring import card_scoring

PREDICTIONS_DIR = "predictions"
LATEST_FILE = "latest.json"


def predictions_path(root: str, model: str, version: int, input_path: str) -> str:
    """``<root>/predictions/<model>/v<version>/<input folder name>.parquet``."""
    name = basename(str(input_path).rstrip("/")) or "input"
    return join(root, PREDICTIONS_DIR, model, f"v{version}", f"{name}.parquet")


@flow(name="score", log_prints=True)
def score_with_champion(
    model: str, images: str, storage_root: str = "storage", version: int | None = None, ray_address: str | None = None,
) -> dict[str, Any]:
    """Score the images in ``images`` (a folder, as ``flows.predict --input`` takes it) with ``model``'s champion (or ``version``); write the predictions under the
    storage root, versioned, and point ``latest.json`` at them."""
    root = StorageLayout.create(PipelineConfig(storage_root=storage_root).storage_root, "score").root
    version, folder, card = lookup.resolve(root, model, version)
    # The card's architecture is code: a deployment's run (model and storage_root are its parameters) imports
    # it only from PIPELINE_MODEL_MODULES, checked on the name before any model is built.
    scoring = card_scoring(card, folder, 1, 250, deployed=started_by_deployment())
    data = scoring.data
    table = scoring.read_inputs(images)  # as the model's run's data source reads them
    print(f"Scoring {len(table):,} images from {images} with {model} v{version} (run {card.get('run_name')})")
    out = score_table(table, folder, scoring, RayConfig(address=ray_address))
    path = predictions_path(root, model, version, images)
    atomic_write_bytes(path, predictions_parquet(out, data["classes"], model, version))
    labelled = out["label"] != NO_LABEL
    accuracy = float((out["label"][labelled] == out["pred"][labelled]).mean()) if labelled.any() else None
    record = {
        "model": model, "version": version, "path": to_stored(root, path), "images": str(images), "rows": len(table),
        "accuracy": accuracy, "run_name": card.get("run_name"), "written_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    atomic_write_json(join(root, PREDICTIONS_DIR, model, LATEST_FILE), record)
    resource = events.model_resource(model, str((card.get("config") or {}).get("workload", "")), card.get("architecture", {}).get("name", ""))
    events.emit(events.PREDICTIONS_WRITTEN, resource, record)
    print(f"Predictions of {model} v{version}: {path}" + (f" (accuracy {accuracy:.2%} on the labelled images)" if accuracy is not None else ""))
    return record
