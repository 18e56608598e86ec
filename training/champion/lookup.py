"""Finding a registry's versions for a run: the version a name means (a number or the champion), verified; whether a run's data can be compared with a champion's; what cleanup must keep."""

from __future__ import annotations

from storage_io import join, list_dirs, stored_places
from training.champion.registry_files import (
    MODELS_DIR,
    RegistryDamaged,
    card_data,
    champion_path,
    model_dir,
    read_card,
    read_champion,
    repair_hint,
    verify_weights,
    version_dir,
    versions,
)


def check_comparable(root: str, model: str, shape: tuple[int | None, ...], classes: list[str], fix: str) -> None:
    """Before any work: ValueError ending with ``fix`` when ``model``'s champion was trained on other images
    (channels, height, width; a None in ``shape`` is not known yet and not compared) or other classes, which
    promotion could never compare with this run's model. No champion, or a damaged registry (promotion names
    the damage): nothing to say here."""
    try:
        pointer = read_champion(root, model)
        card = read_card(root, model, pointer["version"]) if pointer else None
    except RegistryDamaged:
        return
    if card is None:
        return
    theirs = card_data(card)
    if all(a is None or a == b for a, b in zip(shape, theirs["shape"])) and list(classes) == list(theirs["classes"]):
        return
    raise ValueError(
        f"the registry's {model} champion v{pointer['version']} ({version_dir(root, model, pointer['version'])}) was "
        f"trained on {_described(theirs['shape'], theirs['classes'])}; this run's data is {_described(shape, classes)}: "
        f"promotion could never compare them. {fix}"
    )


def _described(shape: tuple[int | None, ...], classes: list[str]) -> str:
    """``3x20x20 images of 3 classes (a, b, c)``: channels x height x width, '?' where not known yet."""
    names = ", ".join(classes[:6]) + (f", ... ({len(classes) - 6} more)" if len(classes) > 6 else "")
    return f"{'x'.join('?' if part is None else str(part) for part in shape)} images of {len(classes)} classes ({names})"


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
