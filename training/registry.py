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

Every path the registry stores (the card's dataset, raw data and checkpoint, the pointer's
version folder) is relative to the storage root (`storage_io.paths`), so a copied or moved root
keeps naming its own data; an older root's absolute paths are mapped under the current root.

Damage is never taken as absence (`problems`): a pointer or card that is there but cannot be read
or says something impossible, a pointer naming no published version or missing beside published
ones, a champion whose model.pt fails its checksum. Reading such a registry raises
`RegistryDamaged` naming the file; promotion onto it stops before writing anything, unless repair
is asked for (`repair_registry`, ``python -m training.registry --repair``), which moves the damage
aside to ``models/<model>/damaged/<time>/`` (nothing is deleted) and points the champion at the
newest intact version. Version numbers are never reused.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, ValidationError

from storage_io import (
    MANIFEST,
    StorageLayout,
    StoredPathError,
    atomic_write_bytes,
    atomic_write_json,
    building,
    exists,
    file_lock,
    is_dir,
    is_file,
    is_remote,
    join,
    list_dirs,
    list_files,
    local_copy,
    publish_dir,
    read_bytes,
    read_json,
    remove,
    sha256_file,
    stored_places,
    to_stored,
    total_bytes,
    upload_dir,
)
from training.model import CHECKSUMS_FILE, MODEL_FILE, SEEDS_MODEL, IntegrityError, verify_checkpoint_file
from training.models import ModelSpec

MODELS_DIR = "models"
CHAMPION_FILE = "champion"
CARD_FILE = "model_card.json"
RUNS_DIR = "runs"
DAMAGED_DIR = "damaged"  # repair moves damaged registry files here (models/<model>/damaged/<time>/), never deletes them
MAX_REGISTRY_FILE = 16 << 20  # a pointer or card larger than this is damage, not something to parse
_VERSION = re.compile(r"v([1-9][0-9]{0,8})")


class RegistryDamaged(ValueError):
    """A registry file that is there but cannot be read, or says something impossible: named, never taken as absent.

    ``problems``: one line per damaged file. Promotion stops on it unless repair is asked for
    (`promote(repair=True)`, `python -m training.registry --repair`).
    """

    def __init__(self, problems: list[str], hint: str = ""):
        self.problems, self.hint = list(problems), hint
        lines = "\n".join(f"  - {problem}" for problem in self.problems)
        super().__init__(f"the model registry is damaged:\n{lines}" + (f"\n{hint}" if hint else ""))

    def __reduce__(self):  # Ray ships a task's exception to the driver pickled: keep both arguments
        return (type(self), (self.problems, self.hint))


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


def model_dir(root: str, model: str) -> str:
    return join(root, MODELS_DIR, model)


def version_dir(root: str, model: str, version: int) -> str:
    return join(model_dir(root, model), f"v{version}")


def champion_path(root: str, model: str) -> str:
    return join(model_dir(root, model), CHAMPION_FILE)


def data_hash(dataset_dir: str) -> str:
    """The sha256 of a dataset's ``_manifest.json``: equal hashes, same Parquet files, same test set."""
    return sha256_file(join(dataset_dir, MANIFEST))


def version_numbers(root: str, model: str) -> list[int]:
    """Every v<N> folder of ``model``, published or not (an upload cut short has no card), ascending."""
    return sorted(int(m.group(1)) for name in list_dirs(model_dir(root, model)) if (m := _VERSION.fullmatch(name)))


def versions(root: str, model: str) -> list[int]:
    """Published version numbers of ``model`` (folders v<N> holding a model card), ascending."""
    return [v for v in version_numbers(root, model) if exists(join(version_dir(root, model, v), CARD_FILE))]


def _read_registry_json(path: str) -> Any | None:
    """The JSON in ``path``; None when there is no such file; RegistryDamaged naming it when it cannot be read."""
    try:
        if not is_file(path):
            if exists(path):
                raise RegistryDamaged([f"{path}: damaged: a folder or other non-file where a file belongs"])
            return None
        size = total_bytes(path)
        if size > MAX_REGISTRY_FILE:
            raise RegistryDamaged([f"{path}: damaged: {size:,} bytes, more than a registry file ever holds"])
        data = read_bytes(path)
    except FileNotFoundError:
        return None
    try:
        return json.loads(data.decode("utf-8"), parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise RegistryDamaged([f"{path}: damaged: not valid JSON ({str(exc)[:200]})"]) from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number")


def _accuracy(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and 0 <= value <= 1


def card_problem(card: Any, version: int) -> str | None:
    """What is wrong with a model card's content, or None when it says what a card must."""
    if not isinstance(card, dict):
        return f"holds {type(card).__name__}, not a model card (a JSON object)"
    if card.get("version") != version or isinstance(card.get("version"), bool):
        return f"says version {card.get('version')!r}, but it is the card of v{version}"
    if not isinstance(card.get("run_name"), str) or not card["run_name"]:
        return "names no run_name"
    metrics, data = card.get("metrics"), card.get("data")
    if not isinstance(metrics, dict) or not _accuracy(metrics.get("test_accuracy")):
        return "metrics.test_accuracy is missing or not a number between 0 and 1"
    if not isinstance(data, dict) or not isinstance(data.get("manifest_hash"), str):
        return "data.manifest_hash is missing"
    for key in ("dataset_dir", "raw_dir"):
        if data.get(key) is not None:
            try:
                stored_places("/", data[key])
            except StoredPathError as exc:
                return f"data.{key}: {exc}"
    if "architecture" in card:
        try:
            ModelSpec.model_validate(card["architecture"])
        except ValidationError as exc:
            return f"architecture is not a model description ({exc.errors()[0]['msg']})"
    return None


def read_card(root: str, model: str, version: int) -> dict | None:
    """The model card of ``version`` as stored (paths relative to the root); None when it has none
    (not published); RegistryDamaged naming the file when it cannot be read or is no valid card."""
    path = join(version_dir(root, model, version), CARD_FILE)
    card = _read_registry_json(path)
    if card is None:
        return None
    problem = card_problem(card, version)
    if problem:
        raise RegistryDamaged([f"{path}: damaged: {problem}"])
    return card


def card_model(card: dict) -> ModelSpec:
    """The model a version's model.pt holds: its card's ``architecture`` (the seeds' ResNet-18 for a card written before it)."""
    recorded = card.get("architecture")
    return ModelSpec.model_validate(recorded) if isinstance(recorded, dict) else SEEDS_MODEL


def card_data(card: dict) -> dict[str, Any]:
    """The data a version was trained on, as predict needs it: ``shape`` (C, H, W), ``classes``,
    ``mean``, ``std`` and ``image_size``. A card written before it recorded them is MNIST's."""
    from dataset.parquet import manifest_data

    data = card.get("data") if isinstance(card.get("data"), dict) else {}
    transform = (card.get("config") or {}).get("transform") if isinstance(card.get("config"), dict) else None
    transform = transform if isinstance(transform, dict) else {}
    shape, classes = manifest_data(data)
    return {
        "shape": shape,
        "classes": classes,
        "mean": data.get("mean", transform.get("mean", 0.5)),
        "std": data.get("std", transform.get("std", 0.5)),
        "image_size": data.get("image_size", transform.get("image_size")),
    }


def version_model(folder: str) -> ModelSpec:
    """`card_model` of the version in ``folder``."""
    card = read_json(join(folder, CARD_FILE))
    return card_model(card if isinstance(card, dict) else {})


def verify_weights(folder: str) -> None:
    """Check the version's model.pt against its ``_checksums.json`` (downloaded first from S3); RegistryDamaged naming it."""
    try:
        with local_copy(folder, names=(MODEL_FILE, CHECKSUMS_FILE)) as local:
            if not (local / MODEL_FILE).is_file():
                raise RegistryDamaged([f"{join(folder, MODEL_FILE)}: damaged: missing"])
            verify_checkpoint_file(local / MODEL_FILE, origin=folder)
    except IntegrityError as exc:
        raise RegistryDamaged([f"{join(folder, MODEL_FILE)}: damaged: {exc}"]) from None


def read_champion(root: str, model: str) -> dict | None:
    """The champion pointer (version, run, accuracy, data hash), or None when there is none.

    ``path`` is the version's folder under this root (the pointer stores it relative to the
    root). A pointer that is there but unreadable, or says something impossible, raises
    RegistryDamaged naming it: it is never taken as "no champion".
    """
    path = champion_path(root, model)
    pointer = _read_registry_json(path)
    if pointer is None:
        return None
    problem = None
    if not isinstance(pointer, dict):
        problem = f"holds {type(pointer).__name__}, not a champion pointer (a JSON object)"
    elif not isinstance(pointer.get("version"), int) or isinstance(pointer["version"], bool) or pointer["version"] < 1:
        problem = f"version {pointer.get('version')!r} is not a version number"
    elif not _accuracy(pointer.get("test_accuracy")):
        problem = "test_accuracy is missing or not a number between 0 and 1"
    elif not isinstance(pointer.get("data_hash"), str) or not isinstance(pointer.get("run_name"), str):
        problem = "data_hash or run_name is missing"
    if problem:
        raise RegistryDamaged([f"{path}: damaged: {problem}"])
    return pointer | {"path": version_dir(root, model, pointer["version"])}


def problems(root: str, model: str, weights: bool = True) -> list[str]:
    """Every damaged file of ``model``'s registry, one line each (empty: intact).

    Damage: a pointer or card that cannot be read or is no valid one; a pointer naming a version
    that is not published or whose card disagrees with it; published versions without a pointer
    (a pointer lost after a promotion); with ``weights``, the champion's model.pt not matching its checksum.
    """
    found: list[str] = []
    try:
        pointer = read_champion(root, model)
    except RegistryDamaged as exc:
        found += exc.problems
        pointer = None
    cards: dict[int, dict] = {}
    for version in versions(root, model):
        try:
            cards[version] = read_card(root, model, version)
        except RegistryDamaged as exc:
            found += exc.problems
    path = champion_path(root, model)
    if pointer is not None:
        version = pointer["version"]
        card = cards.get(version)
        if card is None and not any(f"/v{version}/" in line for line in found):
            found.append(f"{path}: damaged: names v{version}, which is not a published version")
        elif card is not None and card["run_name"] != pointer["run_name"]:
            found.append(f"{path}: damaged: names v{version} of run {pointer['run_name']!r}, "
                         f"but v{version}'s card is run {card['run_name']!r}")
        elif card is not None and weights:
            try:
                verify_weights(version_dir(root, model, version))
            except RegistryDamaged as exc:
                found += exc.problems
    elif cards and not exists(path):
        found.append(f"{path}: missing although {', '.join(f'v{v}' for v in sorted(cards))} are published")
    return found


def repair_hint(root: str, model: str) -> str:
    return (
        f"Nothing was changed. Look at the files named, then move the damage aside and point the champion at the newest "
        f"intact version with: python -m training.registry --storage-root {root} --model {model} --repair"
    )


def resolve(root: str, model: str, version: int | None = None) -> tuple[int, str, dict]:
    """(version, folder, model card) of ``version``, or of the champion when None.

    ValueError naming what is missing; RegistryDamaged (a ValueError) naming a damaged pointer,
    card or model.pt: the weights are checked against their checksum here, before any scoring.
    """
    from_pointer = version is None
    if version is None:
        pointer = read_champion(root, model)
        if pointer is None:
            published = versions(root, model)
            if published:
                raise RegistryDamaged(
                    [f"{champion_path(root, model)}: missing although {', '.join(f'v{v}' for v in published)} are published"],
                    repair_hint(root, model) + " (or score one with --version N)",
                )
            raise ValueError(f"{champion_path(root, model)}: no champion yet; run the pipeline until a model passes its gate")
        version = pointer["version"]
    card = read_card(root, model, version)
    if card is None:
        known = ", ".join(f"v{v}" for v in versions(root, model)) or "none"
        if from_pointer:
            raise RegistryDamaged(
                [f"{champion_path(root, model)}: damaged: names v{version}, which is not a published version (published: {known})"],
                repair_hint(root, model),
            )
        raise ValueError(f"{version_dir(root, model, version)} is not a published version of {model} (published: {known})")
    if from_pointer and card["run_name"] != pointer["run_name"]:
        raise RegistryDamaged(
            [f"{champion_path(root, model)}: damaged: names v{version} of run {pointer['run_name']!r}, "
             f"but v{version}'s card is run {card['run_name']!r}"],
            repair_hint(root, model),
        )
    folder = version_dir(root, model, version)
    verify_weights(folder)
    return version, folder, card


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
        champion_accuracy, rescored = None, False
        if champion is not None:
            champion_accuracy = champion["test_accuracy"]
            if champion["data_hash"] != candidate.data_hash:
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
        version = _next_version(layout.root, model)
        folder = _publish_version(layout.root, model, version, candidate, files or {}, before, champion_accuracy, rescored)
        _write_pointer(layout.root, model, version, {  # last: the pointer names a complete version
            "run_name": candidate.run_name,
            "checkpoint": to_stored(layout.root, candidate.checkpoint),
            "test_accuracy": candidate.accuracy,
            "data_hash": candidate.data_hash,
            "promoted_at": _now(),
        })
        return Promotion(
            **base, promoted=True, reason=reason, version=version, version_dir=folder, champion_before=before,
            champion_accuracy=champion_accuracy, champion_rescored=rescored,
        )


def _next_version(root: str, model: str) -> int:
    """One above every number used so far: published, cut short, or moved aside as damaged (never reused)."""
    used = version_numbers(root, model)
    for stamp in list_dirs(join(model_dir(root, model), DAMAGED_DIR)):
        used += [int(m.group(1)) for name in list_dirs(join(model_dir(root, model), DAMAGED_DIR, stamp))
                 if (m := _VERSION.fullmatch(name))]
    return max(used, default=0) + 1


def _write_pointer(root: str, model: str, version: int, fields: dict[str, Any]) -> None:
    path = f"{MODELS_DIR}/{model}/v{version}"  # relative to the root, like every path the registry stores
    atomic_write_json(champion_path(root, model), {"version": version, "path": path, **fields})


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
            "promoted_at": _now(),
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
            "files": sorted([MODEL_FILE, CHECKSUMS_FILE, *files]),
        }
        (staging / CARD_FILE).write_text(json.dumps(card, indent=2, sort_keys=True) + "\n")
        if is_remote(final):  # no rename on S3: the card goes last, and a version counts once it has one
            upload_dir(staging, final, last=CARD_FILE)
        else:
            publish_dir(staging, final)
    return final


# --------------------------------------------------------------------------- repair


def _move_aside(source: str, target: str) -> None:
    """Move a file or folder to ``target`` inside the same root: one rename locally, copy then remove on S3."""
    if not is_remote(source):
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.replace(source, target)
        return
    if is_dir(source):
        for name in list_files(source):
            atomic_write_bytes(join(target, *name.split("/")), read_bytes(join(source, name)))
    else:
        atomic_write_bytes(target, read_bytes(source))
    remove(source)


def repair_registry(root: str, model: str) -> list[str]:
    """Move every damaged version and a damaged pointer aside (``models/<model>/damaged/<time>/``,
    nothing deleted), then point the champion at the newest intact version; return what was done.

    A version is damaged when its card cannot be read or its model.pt fails its checksum. Each
    new version was the champion when it was published, so the newest intact one is the champion
    the registry had before the damage. With no intact version, the pointer is moved aside too.
    """
    aside = join(model_dir(root, model), DAMAGED_DIR, datetime.now(UTC).strftime("%Y%m%dT%H%M%S%fZ"))
    done: list[str] = []
    intact: dict[int, dict] = {}
    for version in versions(root, model):
        folder = version_dir(root, model, version)
        try:
            card = read_card(root, model, version)
            verify_weights(folder)
            intact[version] = card
        except RegistryDamaged as exc:
            _move_aside(folder, join(aside, f"v{version}"))
            done.append(f"moved v{version} to {join(aside, f'v{version}')} ({'; '.join(exc.problems)})")
    pointer_file = champion_path(root, model)
    try:
        pointer = read_champion(root, model)
        why = None if pointer is None else (
            None if pointer["version"] in intact and intact[pointer["version"]]["run_name"] == pointer["run_name"]
            else f"it named v{pointer['version']}, which is not an intact version")
    except RegistryDamaged as exc:
        pointer, why = None, "; ".join(exc.problems)
    if why is not None or (pointer is None and intact):
        if exists(pointer_file):
            _move_aside(pointer_file, join(aside, CHAMPION_FILE))
            done.append(f"moved the champion pointer to {join(aside, CHAMPION_FILE)} ({why})")
        if intact:
            version = max(intact)
            card = intact[version]
            _write_pointer(root, model, version, {
                "run_name": card["run_name"],
                "checkpoint": card.get("checkpoint"),
                "test_accuracy": card["metrics"]["test_accuracy"],
                "data_hash": card["data"]["manifest_hash"],
                "promoted_at": card.get("promoted_at"),
                "repaired_at": _now(),
            })
            done.append(f"champion is v{version} again (the newest intact version, run {card['run_name']})")
    return done


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
    the dataset and raw data every published version's model card names.

    A card stores them relative to the root; an older card's absolute path protects itself and
    the same place under this root (a copied or moved root, `storage_io.paths`). A card that
    cannot be read might name any data: then all of ``raw/`` and ``datasets/`` are kept.
    """
    keep: dict[str, str] = {}
    models = join(root, MODELS_DIR)
    for model in list_dirs(models):
        keep[model_dir(root, model)] = f"the model registry of {model}"
        for version in versions(root, model):
            try:
                card = read_card(root, model, version) or {}
            except RegistryDamaged as exc:
                why = f"{'; '.join(exc.problems)}: the data it names is unknown, so all of it is kept"
                for folder in ("raw", "datasets"):
                    keep.setdefault(join(root, folder), why)
                continue
            for key in ("dataset_dir", "raw_dir"):
                stored = (card.get("data") or {}).get(key)
                if stored:
                    for place in stored_places(root, stored):
                        keep.setdefault(place, f"named by the model card of {model} v{version}")
    return keep


# --------------------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    """``python -m training.registry``: check a model's registry, or repair it (exit 0 intact or repaired, 1 damaged, 2 bad input)."""
    from pipeline_config import DEFAULT_WORKLOAD, ModelConfig, PipelineConfig, PromoteConfig, registry_model_name

    parser = argparse.ArgumentParser(
        prog="python -m training.registry",
        description="Check a model registry on a storage root for damage (unreadable pointer or cards, model.pt "
        "not matching its checksum); --repair moves the damage aside and points the champion at the newest intact version.",
    )
    parser.add_argument("--storage-root", default="storage", help="The storage root (folder or s3://bucket/prefix).")
    default = registry_model_name(DEFAULT_WORKLOAD, ModelConfig().name)
    parser.add_argument(
        "--model", default=default, help=f"The model's registry name: promote.model_name of the runs, or <workload>-<model> (default {default})."
    )
    parser.add_argument("--repair", action="store_true", help="Move damaged files aside (nothing is deleted) and rewrite the pointer.")
    args = parser.parse_args(argv)
    try:
        PromoteConfig(model_name=args.model)
        layout = StorageLayout.create(PipelineConfig(storage_root=args.storage_root).storage_root, "registry")
        layout.check_reachable()
    except (ValidationError, ValueError) as exc:
        print(f"invalid input:\n{exc}", file=sys.stderr)
        return 2
    with file_lock(layout, f"models-{args.model}", timeout_s=600):
        damage = problems(layout.root, args.model)
        if not damage:
            pointer = read_champion(layout.root, args.model)
            champion = f"champion v{pointer['version']}" if pointer else "no champion yet"
            print(f"{model_dir(layout.root, args.model)}: intact ({champion}; published: "
                  f"{', '.join(f'v{v}' for v in versions(layout.root, args.model)) or 'none'})")
            return 0
        if not args.repair:
            print(str(RegistryDamaged(damage, repair_hint(layout.root, args.model))), file=sys.stderr)
            return 1
        for line in repair_registry(layout.root, args.model):
            print(line)
        left = problems(layout.root, args.model)
        if left:
            print(str(RegistryDamaged(left, "still damaged after the repair")), file=sys.stderr)
            return 1
        return 0


if __name__ == "__main__":
    sys.exit(main())
