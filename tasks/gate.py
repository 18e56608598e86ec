"""The evaluation stage's gate: what a run must show on its test split to count, and where that comes from.

In order, the first that applies:

1. ``evaluate.min_accuracy`` set (a flag, a preset, a config file, the deployment's form): that number,
   named as set by the user, and nothing else.
2. Data of a kind with a gate of its own (`pipeline_config.evaluation.OWN_GATES`: MNIST's IDX digits,
   97.5%): that gate.
3. A champion of the run's registry name: the champion's accuracy on THIS run's test split (its recorded
   one when it was scored on the same dataset, else it is scored again here first), less three standard
   errors on this run's test split (`lower_bound`). A later run is held to the model it would replace,
   within what the test set's size can tell apart; promotion still needs it to beat the champion outright.
4. The data's baseline, for a workload's first run: what a nearest-centroid classifier on the raw
   training pixels scores on the test split (`tasks.baseline.centroid_probe`), less three standard errors.

A derived gate (3 and 4) also asks that the model learned something: its accuracy must beat the test
split's majority-class share by a one-sided test at `Z` standard errors (`beating`: what always answering
one class scores is the null, never a pass at equality), every class with test rows must have some of them
right (recall above 0), and the test split must be large enough to tell (`MIN_CLASS_ROWS` rows in every
class it has, two classes at least; else the run trains but passes only with ``evaluate.min_accuracy``).
`failures` lists, per class, what failed. Before training (`before_training`, after the conversion) a
test split too small to tell is named, and a probe far below chance stops the run: the labels of the
training and test splits then likely mean different classes. docs/design.md ("The gate") says why.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
from pydantic import BaseModel

from dataset.formats.parquet import ParquetDataset
from dataset.tensors.spec import TransformSpec
from pipeline_config import EvaluateConfig
from pipeline_config.evaluation import OWN_GATES
from storage_io import join, read_json
from tasks.baseline import Baseline, centroid_probe, class_counts
from tasks.manifests import ChampionScore
from training.champion import registry_files

Z = 3.0  # standard errors: the margin every derived gate leaves for the test set's noise (one-sided tests)
MIN_CLASS_ROWS = 10  # test rows each class needs for a derived gate; with Z = 3, the majority share is then beatable


class LabelsDisagree(ValueError):
    """The probe scored far below chance: the splits' labels likely name different classes."""


class Gate(BaseModel):
    """What a run is held to and, in a phrase, where it came from (what the summary names)."""

    min_accuracy: float
    origin: str
    derived: bool = False  # a champion's or the data's baseline: every class must have recall above 0
    too_small: str = ""  # why this test split cannot tell (a derived gate only); "" when it can
    champion: ChampionScore | None = None  # the champion the gate came from, on this run's test split


def gate_for(
    cfg: EvaluateConfig, dataset: ParquetDataset, root: str, registry_name: str | None,
    rescore: Callable[[str], float] | None = None,
) -> Gate:
    """The run's gate (see the module's docstring); ``registry_name``: whose champion a later run is held to
    (None: promotion is off, so no champion); ``rescore(folder)``: the accuracy on this run's test split of
    the model in a version folder (`champion_scorer`), for a champion scored on other data."""
    if cfg.min_accuracy is not None:
        return Gate(min_accuracy=cfg.min_accuracy, origin="evaluate.min_accuracy, as set")
    own = OWN_GATES.get(dataset.source)
    if own is not None:
        return Gate(min_accuracy=own, origin=f"the data's own gate ({dataset.source} data; evaluate.min_accuracy unset)")
    champion = _champion(root, registry_name)
    scored = _champion_score(champion, dataset, rescore, root, registry_name) if champion is not None else None
    baseline = class_counts(dataset) if scored is not None else centroid_probe(dataset)
    n, majority = baseline.rows, baseline.majority
    if scored is not None:
        how = "scored again on this run's test split: the data changed" if scored.rescored else "on this run's data"
        reference, origin = lower_bound(scored.accuracy, n), (
            f"its champion {registry_name} v{scored.version} ({scored.accuracy:.2%}, {how}) less {Z:g} standard errors")
    elif baseline.probe is not None:
        reference, origin = lower_bound(baseline.probe, n), (
            f"the data's baseline: a nearest-centroid probe scored {baseline.probe:.2%}, less {Z:g} standard errors")
    else:
        reference, origin = 0.0, "the data's baseline (no nearest-centroid probe: the data is too wide for it)"
    floor = beating(majority, n)
    beat = f"above the majority class's {majority:.2%} by a one-sided test at {Z:g} standard errors on {n} test images"
    if floor is None:  # too few images (`too_small` says so too): nothing passes on accuracy alone
        gate, origin = 1.0, f"no accuracy is {beat} ({origin}: {reference:.2%})"
    elif floor > reference:
        gate, origin = floor, f"{beat} ({origin}: {reference:.2%})"
    else:
        gate, origin = reference, f"{origin} ({beat}: {floor:.2%})"
    return Gate(min_accuracy=gate, origin=origin, derived=True, too_small=too_small(baseline, dataset.classes), champion=scored)


def failures(gate: Gate, confusion: np.ndarray, classes: Sequence[str]) -> list[str]:
    """What failed ``gate``, a phrase each, given the test split's confusion matrix: [] when it passed."""
    confusion = np.asarray(confusion)
    total = int(confusion.sum())
    accuracy = float(np.trace(confusion) / max(total, 1))
    found = []
    if accuracy < gate.min_accuracy:
        found.append(f"test accuracy {accuracy:.4f} is below the gate {gate.min_accuracy:.4f}")
    if gate.derived:
        for i, name in enumerate(classes):
            rows = int(confusion[i].sum())
            if rows and not confusion[i, i]:
                found.append(f"class {name!r}: recall 0 (none of its {rows} test images predicted as {name!r})")
    if gate.too_small:
        found.append(gate.too_small)
    return found


def before_training(cfg: EvaluateConfig, dataset: ParquetDataset) -> list[str]:
    """After the conversion, before any training: LabelsDisagree when the probe scores far below chance
    (`labels_disagree`); the warnings to say (a test split too small for the gate the run will get)."""
    baseline = centroid_probe(dataset)
    problem = labels_disagree(baseline)
    if problem:
        raise LabelsDisagree(problem)
    if cfg.min_accuracy is not None or dataset.source in OWN_GATES:
        return []
    small = too_small(baseline, dataset.classes)
    return [f"{small}: this run trains, but its gate fails unless evaluate.min_accuracy is set"] if small else []


def labels_disagree(baseline: Baseline) -> str:
    """Why the splits' labels look like different classes, or "": the probe scored below chance by more than
    `Z` standard errors on the test split (its Wilson upper bound is under 1/the classes it answers, under the
    majority share, and under what its answers would score if they had nothing to do with the labels:
    `Baseline.unrelated`, so a probe that merely learned nothing never stops a run)."""
    if baseline.probe is None or baseline.probe_classes < 2 or not baseline.rows:
        return ""
    chance = min(1 / baseline.probe_classes, baseline.majority, baseline.unrelated)
    highest = upper_bound(baseline.probe, baseline.rows)
    if highest >= chance:
        return ""
    return (
        f"the test split looks labelled differently from the training split: a nearest-centroid probe on the "
        f"training pixels scored {baseline.probe:.2%} on the {baseline.rows} test images, far below chance "
        f"({chance:.2%}; at most {highest:.2%} within {Z:g} standard errors). The labels likely mean different "
        "classes in the training and test files (names in another order, or names in one and numbers in the other); "
        "check both splits' label columns. Stopped before training"
    )


def too_small(baseline: Baseline, classes: Sequence[str]) -> str:
    """Why the test split is too small for a derived gate to tell, or "": a class it has with fewer than
    `MIN_CLASS_ROWS` rows, or fewer than two classes."""
    present = [(name, count) for name, count in zip(classes, baseline.test_counts, strict=False) if count]
    few = [f"{name!r} {count}" for name, count in present if count < MIN_CLASS_ROWS]
    if len(present) < 2:
        return f"the test split is too small to tell: it has {len(present)} class(es) with rows"
    if few:
        shown = ", ".join(few[:5]) + (f" and {len(few) - 5} more" if len(few) > 5 else "")
        return f"the test split is too small to tell: fewer than {MIN_CLASS_ROWS} test images in class(es) {shown}"
    return ""


def beating(baseline: float, n: int, z: float = Z) -> float | None:
    """The lowest accuracy on ``n`` test images (k/n) that a one-sided test at ``z`` standard errors says is
    above ``baseline`` (its Wilson lower bound is above it: the score test), or None when none is."""
    if n <= 0:
        return None
    k = max(0, math.floor(n * (baseline + z * math.sqrt(baseline * (1 - baseline) / n))) - 1)
    while k <= n and not lower_bound(k / n, n, z) > baseline:
        k += 1
    return k / n if k <= n else None


def lower_bound(accuracy: float, n: int, z: float = Z) -> float:
    """The Wilson score interval's lower end: the lowest accuracy ``z`` standard errors allow for ``accuracy``
    scored on ``n`` images. Unlike p - z*sqrt(p(1-p)/n) it stays below 1 at p = 1 (a perfect probe on
    45 test images gives 0.83, on 10,000 gives 0.999)."""
    centre, spread = _wilson(accuracy, n, z)
    return max(0.0, centre - spread) if n > 0 else 0.0


def upper_bound(accuracy: float, n: int, z: float = Z) -> float:
    """The Wilson score interval's upper end (1 for no images)."""
    centre, spread = _wilson(accuracy, n, z)
    return min(1.0, centre + spread) if n > 0 else 1.0


def _wilson(accuracy: float, n: int, z: float) -> tuple[float, float]:
    if n <= 0:
        return 0.0, 0.0
    scale = 1 + z * z / n
    centre = (accuracy + z * z / (2 * n)) / scale
    spread = z * math.sqrt(accuracy * (1 - accuracy) / n + z * z / (4 * n * n)) / scale
    return centre, spread


def _champion(root: str, registry_name: str | None) -> dict | None:
    if not registry_name:
        return None
    try:
        return registry_files.read_champion(root, registry_name)
    except registry_files.RegistryDamaged:
        return None  # promotion names the damage; the data's baseline holds meanwhile


def _champion_score(
    champion: dict, dataset: ParquetDataset, rescore: Callable[[str], float] | None, root: str, model: str,
) -> ChampionScore | None:
    """The champion's accuracy on this run's test split: its recorded one on the same dataset, else scored
    again; None when it was scored on other data and cannot be scored here, or its registry is damaged (the
    data's baseline holds; promotion names the damage)."""
    if champion["data_hash"] == registry_files.data_hash(dataset.directory):
        return ChampionScore(version=champion["version"], accuracy=float(champion["test_accuracy"]))
    if rescore is None or registry_files.problems(root, model):
        return None
    return ChampionScore(version=champion["version"], accuracy=float(rescore(champion["path"])), rescored=True)


def champion_scorer(spec: TransformSpec, cfg: EvaluateConfig, model_name_field: str | None) -> Callable[[str], float]:
    """How a champion is scored on this run's test set (when the data changed): through the same actor pool
    as evaluation, after checking that the champion's images and classes are this run's."""

    def rescore(folder: str) -> float:
        card = read_json(join(folder, registry_files.CARD_FILE))
        theirs = registry_files.card_data(card if isinstance(card, dict) else {})
        if tuple(theirs["shape"]) != tuple(spec.dataset.image_shape) or list(theirs["classes"]) != list(spec.dataset.classes):
            raise ValueError(
                f"promote.model_name {model_name_field}: its champion ({folder}) was trained on {theirs['shape']} images of "
                f"classes {theirs['classes']}, this run on {tuple(spec.dataset.image_shape)} images of classes "
                f"{list(spec.dataset.classes)}; they cannot be compared: give this workload its own promote.model_name"
            )
        # Scoring needs torch and Ray Data: imported here, where a champion is really scored again (the
        # data changed), so a promotion that reuses the recorded accuracy keeps its worker free of torch.
        from training.inference import predict  # torch and Ray Data: only when a champion is scored again

        out = predict(spec, folder, cfg, registry_files.version_model(folder))
        return float((out["label"] == out["pred"]).mean()) if len(out["label"]) else 0.0

    return rescore
