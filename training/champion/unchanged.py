"""Is there anything new to train on? A run's data, model and recipe against its champion's.

A run with ``promote.skip_unchanged`` (the ``nightly`` preset) ends before training, as "nothing new
to train on", when all three equal those of the champion of its registry name:

- the data: the Parquet dataset the run would train on, named by its fingerprint (the raw inputs'
  checksums and every conversion setting, `tasks.to_parquet.dataset_fingerprint`), is the one the
  champion was trained on, and it is still on storage and verifies against its manifest;
- the model: the ``model`` section: ``model.name``, and ``model.weights`` by what it holds, not by how
  it is written: the sha256 of the file it names now against the one the champion's card records
  (a registry name: its champion's model.pt now, so a new champion of that name is something new);
- the recipe: the ``transform`` and ``train`` sections, less the fields that change how a run is
  carried out but not what it learns (`OPERATIONAL`: workers, retries, timeouts, checkpoints kept).

Or when all three equal those of the last run of that registry name that trained and was evaluated,
promoted or not (`remember`, written by the promote stage: ``models/<name>/last_trained.json``): new
data whose model lost to the champion, or failed the gate, is not trained again every night while
nothing changed since.

Anything else (a first run, a damaged registry, a champion whose card does not record its
configuration) is "changed": the run trains. What is not seen here: an image folder's file replaced with
the same size and modification time (the listing cache, `dataset.formats.listing`, trusts both; a run that trains,
``--no-promote.skip-unchanged`` among them, reads the files again before it reuses a dataset:
`tasks.to_parquet.content_checked`), and the code of a ``module:function`` model whose name did not change.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from storage_io import atomic_write_json, from_stored, join, read_json, sha256_file, to_stored
from training.champion import registry_files

# Fields of the train section that do not change what a run learns: how many workers and where,
# how failures are retried, how often and how many checkpoints are kept.
OPERATIONAL = {
    "train": {
        "mode", "num_workers", "min_workers", "placement", "use_gpu", "data_cpus", "max_failures",
        "max_preemption_failures", "preemption_check_steps", "preemption_check_s", "stage_retries", "stage_retry_delay_s",
        "cuda_graph", "resident_data",
        "hang_timeout_s", "checkpoint_every_steps", "num_to_keep",
    },
}
# Fields compared by what they hold, not by how they are written (`weights_sha256`); ``transform.image_size`` by
# the data: the size the images were converted to is part of the dataset's fingerprint (``auto`` and the size it
# chose are the same recipe), and MNIST's IDX digits are never resized.
BY_CONTENT = {"model": {"weights"}, "transform": {"image_size"}}
RECIPE_SECTIONS = ("model", "transform", "train")
LAST_TRAINED_FILE = "last_trained.json"  # in models/<registry name>/: the last run that trained and was evaluated


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
    """The sections of a run's configuration (as JSON) that decide what it learns, operational fields and
    those compared by content (``model.weights``) left out."""
    out = {}
    for section in RECIPE_SECTIONS:
        values = config.get(section) if isinstance(config.get(section), dict) else {}
        skip = OPERATIONAL.get(section, set()) | BY_CONTENT.get(section, set())
        out[section] = {key: value for key, value in values.items() if key not in skip}
    return out


def differences(ours: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    """``section.field`` of every recipe value that differs between two configurations (``model.weights``:
    by content, `compare`)."""
    a, b = recipe(ours), recipe(theirs)
    return [f"{s}.{k}" for s in RECIPE_SECTIONS for k in sorted(set(a[s]) | set(b[s])) if a[s].get(k) != b[s].get(k)]


def weights_sha256(root: str, config: dict[str, Any]) -> str | None:
    """The sha256 of the file ``model.weights`` names now (a registry name: its champion's model.pt), None
    without one; ``"unreadable"`` when it cannot be found or read (which no recorded sha256 equals)."""
    source = (config.get("model") if isinstance(config.get("model"), dict) else {}).get("weights")
    if not source:
        return None
    from training.model.weights import locate  # torch: only for a run that starts from weights

    try:
        return sha256_file(locate(source, root))
    except (OSError, ValueError):  # WeightsError (no such file, no champion, damaged), an unreachable bucket
        return "unreadable"


def _recorded_weights(record: dict[str, Any]) -> str | None:
    weights = record.get("weights")
    return weights.get("sha256") if isinstance(weights, dict) else None


def _against(root: str, record: dict[str, Any], name: str, dataset_dir: str, verified: bool, config: dict[str, Any],
             weights: str | None) -> tuple[bool, str | None]:
    """(same data, why not the same) of a run against ``record`` (a model card, or `remember`'s record):
    why None when data, model and recipe are the record's."""
    if _trained_on(root, record) != dataset_dir.rstrip("/"):
        return False, f"the data differs from {name}'s"
    if not verified:
        return True, f"{name}'s dataset {dataset_dir} is gone or does not verify"
    differ = differences(config, record.get("config") if isinstance(record.get("config"), dict) else {})
    if weights != _recorded_weights(record):
        differ = sorted([*differ, "model.weights"], key=lambda field: (RECIPE_SECTIONS.index(field.split(".")[0]), field))
    if differ:
        return True, f"{', '.join(differ)} differ from {name}'s"
    return True, None


def compare(root: str, registry_name: str, dataset_dir: str, dataset_verified: bool, config: dict[str, Any]) -> Verdict:
    """The run's data (``dataset_dir``: where its dataset is or would be), model and recipe against the champion's,
    then against the last trained run's (`remember`)."""
    def changed(reason: str, champion: dict | None = None, same_data: bool | None = None) -> Verdict:
        return Verdict(False, reason, dataset_dir, champion, same_data)

    try:
        champion = registry_files.read_champion(root, registry_name)
        card = registry_files.read_card(root, registry_name, champion["version"]) if champion else None
    except registry_files.RegistryDamaged as exc:
        return changed(f"the registry of {registry_name} is damaged ({exc})")
    weights = weights_sha256(root, config)
    if champion is None or card is None:
        verdict = changed(f"{registry_name} has no champion yet")
    else:
        name = f"{registry_name} v{champion['version']}"
        same_data, why = _against(root, card, name, dataset_dir, dataset_verified, config, weights)
        if why is None:
            reason = f"data, model and recipe are those of {name} (run {champion['run_name']})"
            return Verdict(True, reason, dataset_dir, champion, True)
        verdict = changed(why, champion, same_data)
    last = read_json(join(registry_files.model_dir(root, registry_name), LAST_TRAINED_FILE))
    if not isinstance(last, dict) or not isinstance(last.get("run_name"), str) or (champion or {}).get("run_name") == last["run_name"]:
        return verdict
    _, why = _against(root, last, f"run {last['run_name']}", dataset_dir, dataset_verified, config, weights)
    if why is not None:
        return verdict
    outcome = f"promoted as v{last.get('version')}" if last.get("promoted") else f"not promoted: {last.get('reason')}"
    reason = (f"data, model and recipe are those of run {last['run_name']}, trained last ({outcome}); "
              "nothing changed since")
    return Verdict(True, reason, dataset_dir, verdict.champion, verdict.same_data)


def remember(root: str, registry_name: str, candidate, promotion) -> str:
    """Record what the run that was just evaluated trained on, promoted or not (a `training.champion.registry.Candidate`
    and its `Promotion`): the next run with the same data, model and recipe has nothing new to train on."""
    record = {
        "run_name": candidate.run_name,
        "evaluated_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "data": {"dataset_dir": to_stored(root, candidate.dataset_dir)},
        "config": candidate.config,
        "weights": candidate.weights,
        "promoted": promotion.promoted,
        "version": promotion.version,
        "reason": promotion.reason,
    }
    return atomic_write_json(join(registry_files.model_dir(root, registry_name), LAST_TRAINED_FILE), record)


def _trained_on(root: str, card: dict[str, Any]) -> str | None:
    """The dataset folder the card says its version was trained on (None: not recorded, or nowhere under this root)."""
    stored = (card.get("data") if isinstance(card.get("data"), dict) else {}).get("dataset_dir")
    try:
        place = from_stored(root, stored) if isinstance(stored, str) and stored else None
    except ValueError:  # a malformed stored path: nothing to compare with
        return None
    return place.rstrip("/") if place else None
