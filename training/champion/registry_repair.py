"""The model registry's check and repair: ``python -m training.champion.registry [--repair]``.

`repair_registry` moves damaged versions and a damaged champion pointer aside
(``models/<model>/damaged/<time>/``, nothing deleted) and points the champion at the newest intact
version; `main` is the command line that checks a registry and repairs it on request. Promotion and
the run rows are `training.champion.registry`'s; reading the files and telling damage from absence is
`training.champion.registry_files`'s.
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from pipeline_config import DEFAULT_WORKLOAD, ModelConfig, PipelineConfig, PromoteConfig, registry_model_name
from storage_io import (
    StorageLayout,
    atomic_write_bytes,
    atomic_write_json,
    exists,
    file_lock,
    is_dir,
    is_remote,
    join,
    list_files,
    read_bytes,
    redact_error,
    remove,
)
from training.champion.registry_files import (
    CHAMPION_FILE,
    DAMAGED_DIR,
    MODELS_DIR,
    RegistryDamaged,
    champion_path,
    model_dir,
    problems,
    read_card,
    read_champion,
    repair_hint,
    verify_weights,
    version_dir,
    versions,
)


def utc_now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def write_pointer(root: str, model: str, version: int, fields: dict[str, Any]) -> None:
    path = f"{MODELS_DIR}/{model}/v{version}"  # relative to the root, like every path the registry stores
    atomic_write_json(champion_path(root, model), {"version": version, "path": path, **fields})


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
            write_pointer(root, model, version, {
                "run_name": card["run_name"],
                "checkpoint": card.get("checkpoint"),
                "test_accuracy": card["metrics"]["test_accuracy"],
                "data_hash": card["data"]["manifest_hash"],
                "promoted_at": card.get("promoted_at"),
                "repaired_at": utc_now(),
            })
            done.append(f"champion is v{version} again (the newest intact version, run {card['run_name']})")
    return done


def main(argv: list[str] | None = None) -> int:
    """``python -m training.champion.registry``: check a model's registry, or repair it (exit 0 intact or repaired, 1 damaged, 2 bad input)."""
    parser = argparse.ArgumentParser(
        prog="python -m training.champion.registry",
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
        print(f"invalid input:\n{redact_error(exc)}", file=sys.stderr)
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
