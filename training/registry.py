"""The model registry on the storage root: promoted models as numbered versions, and the champion.

    <root>/models/<model>/v<N>/            model.pt + _checksums.json, model_card.json, pictures
    <root>/models/<model>/champion         {"version": N, ...}: the model to serve, written last
    <root>/models/<model>/runs/<run>.json  one row per evaluated run, for the run-comparison table

A model that passed the evaluation gate is compared with the champion on the same test set:
when both were scored on the same dataset (same manifest hash) the champion's recorded accuracy
is used, otherwise the champion is scored again on the candidate's test set (``rescore``). It is
promoted only when its accuracy beats the champion's by more than ``min_improvement``; a model
that failed the gate is never compared. The decision and both writes happen under the storage
root's lock for that model (`storage_io.file_lock`), so two runs finishing at once take turns and
the second is compared with the first's result. A version folder is published whole (one rename
locally; on S3 with model_card.json uploaded last) before the champion pointer names it, so a
reader that follows the pointer always finds a complete version. Versions are never deleted here
or by cleanup (`protected_data`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel

from storage_io import (
    MANIFEST,
    StorageLayout,
    atomic_write_json,
    building,
    exists,
    file_lock,
    is_remote,
    join,
    list_dirs,
    list_files,
    publish_dir,
    read_bytes,
    read_json,
    sha256_file,
    upload_dir,
)
from training.model import CHECKSUMS_FILE, MODEL_FILE, SEEDS_MODEL
from training.models import ModelSpec

MODELS_DIR = "models"
CHAMPION_FILE = "champion"
CARD_FILE = "model_card.json"
RUNS_DIR = "runs"


class Candidate(BaseModel):
    """What the evaluation stage knows of the model it just scored."""

    run_name: str
    flow_run_id: str | None = None
    checkpoint: str  # the checkpoint folder evaluation used (its model.pt is what gets promoted)
    accuracy: float
    passed_gate: bool
    data_hash: str  # sha256 of the dataset's _manifest.json (`data_hash`)
    dataset_dir: str
    raw_dir: str | None = None
    metrics: dict[str, Any] = {}
    config: dict[str, Any] = {}
    model: dict[str, Any] = {}  # the training.models.ModelSpec that was trained (the card's architecture)
    code_version: str | None = None


class Promotion(BaseModel):
    """The promotion decision for one run, and why."""

    model: str
    promoted: bool
    reason: str
    version: int | None = None  # the version this run became (promoted) or the champion it lost to
    version_dir: str | None = None
    champion_before: int | None = None
    champion_accuracy: float | None = None  # the champion's accuracy on this run's test set
    champion_rescored: bool = False  # the data changed, so the champion was scored on this run's test set
    min_improvement: float = 0.0


def model_dir(root: str, model: str) -> str:
    return join(root, MODELS_DIR, model)


def version_dir(root: str, model: str, version: int) -> str:
    return join(model_dir(root, model), f"v{version}")


def champion_path(root: str, model: str) -> str:
    return join(model_dir(root, model), CHAMPION_FILE)


def data_hash(dataset_dir: str) -> str:
    """The sha256 of a dataset's ``_manifest.json``: equal hashes, same Parquet files, same test set."""
    return sha256_file(join(dataset_dir, MANIFEST))


def versions(root: str, model: str) -> list[int]:
    """Published version numbers of ``model`` (folders v<N> holding a model card), ascending."""
    names = [name for name in list_dirs(model_dir(root, model)) if name.startswith("v") and name[1:].isdigit()]
    return sorted(int(name[1:]) for name in names if exists(join(model_dir(root, model), name, CARD_FILE)))


def read_card(root: str, model: str, version: int) -> dict | None:
    card = read_json(join(version_dir(root, model, version), CARD_FILE))
    return card if isinstance(card, dict) else None


def card_model(card: dict) -> ModelSpec:
    """The model a version's model.pt holds: its card's ``architecture`` (the seeds' ResNet-18 for a card written before it)."""
    recorded = card.get("architecture")
    return ModelSpec.model_validate(recorded) if isinstance(recorded, dict) else SEEDS_MODEL


def version_model(folder: str) -> ModelSpec:
    """`card_model` of the version in ``folder``."""
    card = read_json(join(folder, CARD_FILE))
    return card_model(card if isinstance(card, dict) else {})


def read_champion(root: str, model: str) -> dict | None:
    """The champion pointer (version, run, accuracy, data hash, path), or None before the first promotion."""
    pointer = read_json(champion_path(root, model))
    return pointer if isinstance(pointer, dict) and isinstance(pointer.get("version"), int) else None


def resolve(root: str, model: str, version: int | None = None) -> tuple[int, str, dict]:
    """(version, folder, model card) of ``version``, or of the champion when None; ValueError naming what is missing."""
    if version is None:
        pointer = read_champion(root, model)
        if pointer is None:
            raise ValueError(f"{champion_path(root, model)}: no champion yet; run the pipeline until a model passes its gate")
        version = pointer["version"]
    card = read_card(root, model, version)
    if card is None:
        known = ", ".join(f"v{v}" for v in versions(root, model)) or "none"
        raise ValueError(f"{version_dir(root, model, version)} is not a published version of {model} (published: {known})")
    return version, version_dir(root, model, version), card


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def decide(candidate: Candidate, champion: dict | None, champion_accuracy: float | None, min_improvement: float) -> tuple[bool, str]:
    """(promote?, why) for a candidate that passed its gate, given the champion's accuracy on the same test set."""
    if champion is None:
        return True, f"first model of its name: test accuracy {candidate.accuracy:.2%}"
    beats = candidate.accuracy > champion_accuracy + min_improvement
    margin = f" by more than {min_improvement:.2%}" if min_improvement else ""
    verb = "beats" if beats else "does not beat"
    return beats, f"test accuracy {candidate.accuracy:.2%} {verb} champion v{champion['version']}'s {champion_accuracy:.2%}{margin}"


def promote(
    layout: StorageLayout,
    model: str,
    candidate: Candidate,
    min_improvement: float = 0.0,
    files: dict[str, bytes] | None = None,
    rescore: Callable[[str], float] | None = None,
) -> Promotion:
    """Compare ``candidate`` with ``model``'s champion and promote it when it is better (see the module doc).

    ``files``: extra files for the version folder (the evaluation pictures). ``rescore(folder)``:
    the test accuracy of the model in ``folder`` on the candidate's test set, used when the
    champion was scored on other data; without it such a champion is kept (the rule is stated in the reason).
    """
    base = {"model": model, "min_improvement": min_improvement}
    if not candidate.passed_gate:
        return Promotion(**base, promoted=False, reason=f"gate failed (test accuracy {candidate.accuracy:.2%}): never promoted")
    with file_lock(layout, f"models-{model}", timeout_s=600):
        champion = read_champion(layout.root, model)
        if champion and champion.get("run_name") == candidate.run_name and champion.get("checkpoint") == candidate.checkpoint:
            return Promotion(  # evaluated again (a resumed run): it is the champion already
                **base, promoted=True, version=champion["version"], version_dir=champion.get("path"),
                reason=f"already the champion as v{champion['version']}",
            )
        champion_accuracy, rescored = None, False
        if champion is not None:
            champion_accuracy = champion.get("test_accuracy")
            if champion.get("data_hash") != candidate.data_hash:
                if rescore is None:
                    return Promotion(
                        **base, promoted=False, champion_before=champion["version"],
                        reason=f"the data changed since champion v{champion['version']} and it could not be scored again: kept",
                    )
                champion_accuracy, rescored = float(rescore(version_dir(layout.root, model, champion["version"]))), True
        promoted, reason = decide(candidate, champion, champion_accuracy, min_improvement)
        if rescored:
            reason += "; the champion was scored again on this run's test set (the data changed)"
        before = champion["version"] if champion else None
        if not promoted:
            return Promotion(
                **base, promoted=False, reason=reason, version=before, champion_before=before,
                champion_accuracy=champion_accuracy, champion_rescored=rescored,
            )
        version = max(versions(layout.root, model), default=0) + 1
        folder = _publish_version(layout.root, model, version, candidate, files or {}, before, champion_accuracy, rescored)
        atomic_write_json(champion_path(layout.root, model), {  # last: the pointer names a complete version
            "version": version,
            "path": folder,
            "run_name": candidate.run_name,
            "checkpoint": candidate.checkpoint,
            "test_accuracy": candidate.accuracy,
            "data_hash": candidate.data_hash,
            "promoted_at": _now(),
        })
        return Promotion(
            **base, promoted=True, reason=reason, version=version, version_dir=folder, champion_before=before,
            champion_accuracy=champion_accuracy, champion_rescored=rescored,
        )


def _publish_version(
    root: str, model: str, version: int, candidate: Candidate, files: dict[str, bytes],
    before: int | None, champion_accuracy: float | None, rescored: bool,
) -> str:
    """Write v<version>/ whole: model.pt and its checksum, the pictures, then the model card."""
    final = version_dir(root, model, version)
    weights = read_bytes(join(candidate.checkpoint, MODEL_FILE))
    with building(final) as staging:
        (staging / MODEL_FILE).write_bytes(weights)
        (staging / CHECKSUMS_FILE).write_text(json.dumps({MODEL_FILE: sha256_file(staging / MODEL_FILE)}, indent=2))
        for name, data in files.items():
            (staging / name).write_bytes(data)
        card = {
            "model": model,
            "version": version,
            "run_name": candidate.run_name,
            "flow_run_id": candidate.flow_run_id,
            "promoted_at": _now(),
            "checkpoint": candidate.checkpoint,
            "code_version": candidate.code_version,
            "data": {"manifest_hash": candidate.data_hash, "dataset_dir": candidate.dataset_dir, "raw_dir": candidate.raw_dir},
            "metrics": {"test_accuracy": candidate.accuracy, **candidate.metrics},
            "previous_champion": {"version": before, "test_accuracy_on_this_data": champion_accuracy, "rescored": rescored},
            "config": candidate.config,
            "architecture": candidate.model or SEEDS_MODEL.model_dump(),  # what load_model builds for model.pt
            "files": sorted([MODEL_FILE, CHECKSUMS_FILE, *files]),
        }
        (staging / CARD_FILE).write_text(json.dumps(card, indent=2, sort_keys=True) + "\n")
        if is_remote(final):  # no rename on S3: the card goes last, and a version counts once it has one
            upload_dir(staging, final, last=CARD_FILE)
        else:
            publish_dir(staging, final)
    return final


# --------------------------------------------------------------------------- run comparison


def record_run(root: str, model: str, row: dict[str, Any]) -> str:
    """Write (or replace) this run's row of the comparison table: ``runs/<run>.json``."""
    path = join(model_dir(root, model), RUNS_DIR, f"{row['run']}.json")
    return atomic_write_json(path, row)


def recent_runs(root: str, model: str, limit: int = 20) -> list[dict[str, Any]]:
    """The latest ``limit`` run rows by finish time, oldest first, each marked ``champion`` when it is the current one."""
    folder = join(model_dir(root, model), RUNS_DIR)
    rows = [row for name in list_files(folder, ".json") if isinstance(row := read_json(join(folder, name)), dict)]
    rows = sorted(rows, key=lambda row: str(row.get("finished_at", "")))[-limit:]
    current = (read_champion(root, model) or {}).get("run_name")
    return [row | {"champion": row.get("run") == current} for row in rows]


# --------------------------------------------------------------------------- what cleanup keeps


def protected_data(root: str) -> dict[str, str]:
    """Folders no retention policy may delete, each with why: every model folder on ``root``, and
    the dataset and raw data every published version's model card names."""
    keep: dict[str, str] = {}
    models = join(root, MODELS_DIR)
    for model in list_dirs(models):
        keep[model_dir(root, model)] = f"the model registry of {model}"
        for version in versions(root, model):
            card = read_card(root, model, version) or {}
            for key in ("dataset_dir", "raw_dir"):
                path = (card.get("data") or {}).get(key)
                if path:
                    keep.setdefault(path, f"named by the model card of {model} v{version}")
    return keep
