"""The model registry's files on the storage root: where they are, reading them, and what counts as damage.

The layout, the checks and `RegistryDamaged` are described in `training.champion.registry`, which writes
these files; everything here only reads.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from pydantic import ValidationError

from storage_io import (
    MANIFEST,
    StoredPathError,
    exists,
    is_file,
    join,
    list_dirs,
    local_copy,
    read_bytes,
    read_json,
    sha256_file,
    stored_places,
    total_bytes,
)
from training.checkpoint.files import CHECKSUMS_FILE, MODEL_FILE, SEEDS_MODEL, IntegrityError, verify_checkpoint_file
from training.model.catalog import ModelSpec

MODELS_DIR = "models"


CHAMPION_FILE = "champion"


CARD_FILE = "model_card.json"


RUNS_DIR = "runs"


DAMAGED_DIR = "damaged"  # repair moves damaged registry files here (models/<model>/damaged/<time>/), never deletes them


MAX_REGISTRY_FILE = 16 << 20  # a pointer or card larger than this is damage, not something to parse


VERSION_NAME = re.compile(r"v([1-9][0-9]{0,8})")


class RegistryDamaged(ValueError):
    """A registry file that is there but cannot be read, or says something impossible: named, never taken as absent.

    ``problems``: one line per damaged file. Promotion stops on it unless repair is asked for
    (`promote(repair=True)`, `python -m training.champion.registry --repair`).
    """

    def __init__(self, problems: list[str], hint: str = ""):
        self.problems, self.hint = list(problems), hint
        lines = "\n".join(f"  - {problem}" for problem in self.problems)
        super().__init__(f"the model registry is damaged:\n{lines}" + (f"\n{hint}" if hint else ""))

    def __reduce__(self):  # Ray ships a task's exception to the driver pickled: keep both arguments
        return (type(self), (self.problems, self.hint))


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
    return sorted(int(m.group(1)) for name in list_dirs(model_dir(root, model)) if (m := VERSION_NAME.fullmatch(name)))


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
    from dataset.formats.parquet import manifest_data  # pyarrow: only when a card's data is asked for

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


def champions(root: str) -> dict[str, int]:
    """Every model under ``<root>/models/`` with a readable champion pointer: name -> the champion's version."""
    found = {}
    for name in list_dirs(join(root, MODELS_DIR)):
        try:
            pointer = read_champion(root, name)
        except RegistryDamaged:
            continue
        if pointer:
            found[name] = pointer["version"]
    return found


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
        f"intact version with: python -m training.champion.registry --storage-root {root} --model {model} --repair"
    )


