"""Is there anything new to train on? A run's data, model and recipe against its champion's.

A run with ``promote.skip_unchanged`` (the ``nightly`` preset) ends before training, as "nothing new
to train on", when all three equal those of the champion of its registry name:

- the data: the Parquet dataset the run would train on, named by its fingerprint (the raw inputs'
  checksums and every conversion setting, `tasks.to_parquet.dataset_fingerprint`), is the one the
  champion was trained on, and it is still on storage and verifies against its manifest;
- the model: the ``model`` section (``model.name``, ``model.weights``);
- the recipe: the ``transform`` and ``train`` sections, less the fields that change how a run is
  carried out but not what it learns (`OPERATIONAL`: workers, retries, timeouts, checkpoints kept).

Anything else (a first run, a damaged registry, a champion whose card does not record its
configuration) is "changed": the run trains.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from storage_io import from_stored
from training import registry_files

# Fields of the train section that do not change what a run learns: how many workers and where,
# how failures are retried, how often and how many checkpoints are kept.
OPERATIONAL = {
    "train": {
        "mode", "num_workers", "min_workers", "placement", "use_gpu", "data_cpus", "max_failures",
        "max_preemption_failures", "preemption_check_steps", "stage_retries", "stage_retry_delay_s",
        "hang_timeout_s", "checkpoint_every_steps", "num_to_keep",
    },
}
RECIPE_SECTIONS = ("model", "transform", "train")


@dataclass(frozen=True)
class Verdict:
    """Whether the run has anything new to train on, and why, in one phrase."""

    unchanged: bool
    reason: str
    dataset_dir: str
    champion: dict[str, Any] | None = None  # the champion pointer (version, run_name, test_accuracy, ...)
    same_data: bool | None = None  # the champion's dataset is this run's; None: no champion to compare with

    def payload(self) -> dict[str, Any]:
        """What the data-checked event says: the dataset, whether it changed since the champion's, and the verdict."""
        champion = self.champion or {}
        return {
            "dataset": self.dataset_dir.rstrip("/").rsplit("/", 1)[-1],  # <workload>-<fingerprint>
            "changed_since_champion": None if self.same_data is None else not self.same_data,
            "champion_version": champion.get("version"),
            "nothing_new": self.unchanged,
            "reason": self.reason,
        }


def recipe(config: dict[str, Any]) -> dict[str, Any]:
    """The sections of a run's configuration (as JSON) that decide what it learns, operational fields left out."""
    out = {}
    for section in RECIPE_SECTIONS:
        values = config.get(section) if isinstance(config.get(section), dict) else {}
        out[section] = {key: value for key, value in values.items() if key not in OPERATIONAL.get(section, set())}
    return out


def differences(ours: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    """``section.field`` of every recipe value that differs between two configurations."""
    a, b = recipe(ours), recipe(theirs)
    return [f"{s}.{k}" for s in RECIPE_SECTIONS for k in sorted(set(a[s]) | set(b[s])) if a[s].get(k) != b[s].get(k)]


def compare(root: str, registry_name: str, dataset_dir: str, dataset_verified: bool, config: dict[str, Any]) -> Verdict:
    """The run's data (``dataset_dir``: where its dataset is or would be), model and recipe against the champion's."""
    def changed(reason: str, champion: dict | None = None, same_data: bool | None = None) -> Verdict:
        return Verdict(False, reason, dataset_dir, champion, same_data)

    try:
        champion = registry_files.read_champion(root, registry_name)
        card = registry_files.read_card(root, registry_name, champion["version"]) if champion else None
    except registry_files.RegistryDamaged as exc:
        return changed(f"the registry of {registry_name} is damaged ({exc})")
    if champion is None or card is None:
        return changed(f"{registry_name} has no champion yet")
    name = f"{registry_name} v{champion['version']}"
    if _trained_on(root, card) != dataset_dir.rstrip("/"):
        return changed(f"the data differs from {name}'s", champion, False)
    if not dataset_verified:
        return changed(f"{name}'s dataset {dataset_dir} is gone or does not verify", champion, True)
    differ = differences(config, card.get("config") if isinstance(card.get("config"), dict) else {})
    if differ:
        return changed(f"{', '.join(differ)} differ from {name}'s", champion, True)
    reason = f"data, model and recipe are those of {name} (run {champion['run_name']})"
    return Verdict(True, reason, dataset_dir, champion, True)


def _trained_on(root: str, card: dict[str, Any]) -> str | None:
    """The dataset folder the card says its version was trained on (None: not recorded, or nowhere under this root)."""
    stored = (card.get("data") if isinstance(card.get("data"), dict) else {}).get("dataset_dir")
    try:
        place = from_stored(root, stored) if isinstance(stored, str) and stored else None
    except ValueError:  # a malformed stored path: nothing to compare with
        return None
    return place.rstrip("/") if place else None
