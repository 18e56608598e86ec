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
or by cleanup (`training.champion.lookup.protected_data`).

Every path the registry stores (the card's dataset, raw data and checkpoint, the pointer's
version folder) is relative to the storage root (`storage_io.paths`), so a copied or moved root
keeps naming its own data; an older root's absolute paths are mapped under the current root.

Damage is never taken as absence (`problems`): a pointer or card that is there but cannot be read
or says something impossible, a pointer naming no published version or missing beside published
ones, a champion whose model.pt fails its checksum. Reading such a registry raises
`RegistryDamaged` naming the file; promotion onto it stops before writing anything, unless repair
is asked for (`repair_registry`, ``python -m training.champion.registry --repair``), which moves the damage
aside to ``models/<model>/damaged/<time>/`` (nothing is deleted) and points the champion at the
newest intact version. Version numbers are never reused.

Reading the files and telling damage from absence is `training.champion.registry_files`; the check and
the repair are `training.champion.registry_repair`; this module decides, promotes and records.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

from storage_io import (
    StorageLayout,
    StoredPathError,
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
    stored_places,
    to_stored,
    upload_dir,
)
from training.champion.registry_files import (
    CARD_FILE,
    DAMAGED_DIR,
    RUNS_DIR,
    VERSION_NAME,
    RegistryDamaged,
    model_dir,
    problems,
    read_champion,
    repair_hint,
    version_dir,
    version_numbers,
)
from training.champion.registry_repair import (  # main: `python -m training.champion.registry`
    main,
    repair_registry,
    utc_now,
    write_pointer,
)
from training.checkpoint.files import CHECKSUMS_FILE, MODEL_FILE, SEEDS_MODEL


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
    model: dict[str, Any] = {}  # the training.model.catalog.ModelSpec that was trained (the card's architecture)
    weights: dict[str, str] | None = None  # model.weights its training started from: source, file, sha256 (None: random)
    training: dict[str, str] = {}  # where and in what precision it trained: device (cpu, cuda), precision (bf16, fp16, fp32)
    code_version: str | None = None
    # The images' shape, class names and normalization (tasks.evaluate.data_spec): what predict needs.
    data_spec: dict[str, Any] = {}


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


def decide(candidate: Candidate, champion: dict | None, champion_accuracy: float | None, min_improvement: float) -> tuple[bool, str]:
    """(promote?, why) for a candidate that passed its gate, given the champion's accuracy on the same test set."""
    if champion is None:
        return True, f"first model of its name: test accuracy {candidate.accuracy:.2%}"
    beats = candidate.accuracy > champion_accuracy + min_improvement
    margin = f" by more than {min_improvement:.2%}" if min_improvement else ""
    verb = "beats" if beats else "does not beat"
    return beats, f"test accuracy {candidate.accuracy:.2%} {verb} champion v{champion['version']}'s {champion_accuracy:.2%}{margin}"


def _same_place(root: str, stored: Any, path: str) -> bool:
    """Whether a path stored in the registry (relative, or an older root's absolute one) names ``path``."""
    if not isinstance(stored, str) or not stored:
        return False
    try:
        return path.rstrip("/") in stored_places(root, stored) or to_stored(root, path) == stored
    except StoredPathError:
        return False


def promote(
    layout: StorageLayout,
    model: str,
    candidate: Candidate,
    min_improvement: float = 0.0,
    files: dict[str, bytes] | None = None,
    rescore: Callable[[str], float] | None = None,
    repair: bool = False,
) -> Promotion:
    """Compare ``candidate`` with ``model``'s champion and promote it when it is better (see the module doc).

    ``files``: extra files for the version folder (the evaluation pictures). ``rescore(folder)``:
    the test accuracy of the model in ``folder`` on the candidate's test set, used when the
    champion was scored on other data; without it such a champion is kept (the rule is stated in the reason).

    A damaged registry (`problems`: an unreadable pointer or card, a pointer naming no published
    version, a champion whose model.pt fails its checksum) stops promotion with RegistryDamaged,
    before anything is written; ``repair``: first move the damage aside (`repair`), then decide.
    """
    base = {"model": model, "min_improvement": min_improvement}
    if not candidate.passed_gate:
        return Promotion(**base, promoted=False, reason=f"gate failed (test accuracy {candidate.accuracy:.2%}): never promoted")
    with file_lock(layout, f"models-{model}", timeout_s=600):
        damage = problems(layout.root, model)
        if damage and not repair:
            raise RegistryDamaged(damage, "Promotion stopped. " + repair_hint(layout.root, model))
        if damage:
            repair_registry(layout.root, model)
        champion = read_champion(layout.root, model)
        if champion and champion["run_name"] == candidate.run_name and _same_place(layout.root, champion.get("checkpoint"), candidate.checkpoint):
            return Promotion(  # evaluated again (a resumed run): it is the champion already
                **base, promoted=True, version=champion["version"], version_dir=champion["path"],
                reason=f"already the champion as v{champion['version']}",
            )
        verdict = _against_champion(layout.root, model, candidate, champion, min_improvement, rescore)
        if not verdict.promoted:
            return verdict
        before, champion_accuracy, rescored = verdict.champion_before, verdict.champion_accuracy, verdict.champion_rescored
        version = _next_version(layout.root, model)
        folder = _publish_version(layout.root, model, version, candidate, files or {}, before, champion_accuracy, rescored)
        write_pointer(layout.root, model, version, {  # last: the pointer names a complete version
            "run_name": candidate.run_name,
            "checkpoint": to_stored(layout.root, candidate.checkpoint),
            "test_accuracy": candidate.accuracy,
            "data_hash": candidate.data_hash,
            "promoted_at": utc_now(),
        })
        return verdict.model_copy(update={"version": version, "version_dir": folder})


def _against_champion(
    root: str, model: str, candidate: Candidate, champion: dict | None, min_improvement: float,
    rescore: Callable[[str], float] | None,
) -> Promotion:
    """`promote`'s decision, before anything is written: ``version`` is the champion's (None without one)."""
    champion_accuracy, rescored = None, False
    if champion is not None:
        champion_accuracy = champion["test_accuracy"]
        if champion["data_hash"] != candidate.data_hash:
            if rescore is None:
                return Promotion(
                    model=model, min_improvement=min_improvement, promoted=False, champion_before=champion["version"],
                    reason=f"the data changed since champion v{champion['version']} and it could not be scored again: kept",
                )
            champion_accuracy, rescored = float(rescore(version_dir(root, model, champion["version"]))), True
    promoted, reason = decide(candidate, champion, champion_accuracy, min_improvement)
    if rescored:
        reason += "; the champion was scored again on this run's test set (the data changed)"
    before = champion["version"] if champion else None
    return Promotion(
        model=model, min_improvement=min_improvement, promoted=promoted, reason=reason,
        version=before, champion_before=before, champion_accuracy=champion_accuracy, champion_rescored=rescored,
    )


def _next_version(root: str, model: str) -> int:
    """One above every number used so far: published, cut short, or moved aside as damaged (never reused)."""
    used = version_numbers(root, model)
    for stamp in list_dirs(join(model_dir(root, model), DAMAGED_DIR)):
        used += [int(m.group(1)) for name in list_dirs(join(model_dir(root, model), DAMAGED_DIR, stamp))
                 if (m := VERSION_NAME.fullmatch(name))]
    return max(used, default=0) + 1


def _publish_version(
    root: str, model: str, version: int, candidate: Candidate, files: dict[str, bytes],
    before: int | None, champion_accuracy: float | None, rescored: bool,
) -> str:
    """Write v<version>/ whole: model.pt and its checksum, the pictures, then the model card."""
    final = version_dir(root, model, version)
    if exists(final):  # _next_version is above every folder: something wrote here meanwhile
        raise RegistryDamaged([f"{final}: appeared while promoting; not overwritten"])
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
            "promoted_at": utc_now(),
            # Paths relative to the storage root (storage_io.paths): the root can be copied or moved.
            "checkpoint": to_stored(root, candidate.checkpoint),
            "code_version": candidate.code_version,
            "data": {
                "manifest_hash": candidate.data_hash,
                "dataset_dir": to_stored(root, candidate.dataset_dir),
                "raw_dir": to_stored(root, candidate.raw_dir),
                **candidate.data_spec,  # image (channels, height, width), classes, mean, std, image_size
            },
            "metrics": {"test_accuracy": candidate.accuracy, **candidate.metrics},
            "previous_champion": {"version": before, "test_accuracy_on_this_data": champion_accuracy, "rescored": rescored},
            "config": candidate.config,
            "architecture": candidate.model or SEEDS_MODEL.model_dump(),  # what load_model builds for model.pt
            "weights": candidate.weights,  # what training started from (training.model.weights); null: random weights
            "training": candidate.training or None,  # device and precision of the training step; null: not recorded
            "files": sorted([MODEL_FILE, CHECKSUMS_FILE, *files]),
        }
        (staging / CARD_FILE).write_text(json.dumps(card, indent=2, sort_keys=True) + "\n")
        if is_remote(final):  # no rename on S3: the card goes last, and a version counts once it has one
            upload_dir(staging, final, last=CARD_FILE)
        else:
            publish_dir(staging, final)
    return final


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


if __name__ == "__main__":
    sys.exit(main())
