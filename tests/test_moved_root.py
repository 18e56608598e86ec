"""A storage root that is copied, moved or synced to S3 keeps working, cleanup included (issue 37).

Real folders copied with shutil.copytree and renamed with os.rename, a real local root uploaded
to moto's S3 server, the real registry and the real cleanup task. Both forms of a root are
tested: one written now (paths relative to the root) and one written before (absolute paths in
the model card, the champion pointer and the leases), which must be mapped under the current
root or refused, and never used to delete anything.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import time
from pathlib import Path

import pytest

from dataset.formats.parquet import ParquetDataset
from dataset.sources.interface import RawData
from pipeline_config import CleanupConfig
from storage_io import (
    MANIFEST,
    StorageLayout,
    StoredPathError,
    atomic_write_json,
    exists,
    from_stored,
    join,
    lease_uses,
    paths_in_use,
    read_json,
    run_lease,
    stored_places,
    to_stored,
    upload_dir,
)
from tasks.cleanup import cleanup
from tasks.manifests import Evaluation
from tests.support.registry import light_candidate, s3_objects
from tests.support.runs import build_run_tree
from training.champion import lookup, registry, registry_files
from training.checkpoint.files import MODEL_FILE, SEEDS_MODEL
from training.manifests import CheckpointInfo, TrainedModel

MODEL = "mnist-resnet18"
POLICY = CleanupConfig(delete_raw=True, delete_parquet=True, keep_checkpoints=1)


def tree_digest(root: Path) -> dict[str, str]:
    """Every file under ``root`` with its sha256: what 'untouched' means."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


def promoted_root(tmp_path: Path, older_format: bool):
    """A run tree under ``tmp_path/root`` whose raw data and dataset a promoted champion's card names.

    ``older_format``: the card, pointer and a lease written the way the pipeline wrote them before
    issue 37, with absolute paths of this root.
    """
    layout, raw, dataset, trained, evaluation = build_run_tree(tmp_path)
    atomic_write_json(join(dataset.directory, MANIFEST), {"fingerprint": "abc"})
    champion = light_candidate(layout, "older-run", 0.967, dataset.directory).model_copy(update={"raw_dir": raw.directory})
    assert registry.promote(layout, MODEL, champion).promoted
    if older_format:
        card_path = Path(registry_files.version_dir(layout.root, MODEL, 1), registry_files.CARD_FILE)
        card = json.loads(card_path.read_text())
        card["data"].update(dataset_dir=dataset.directory, raw_dir=raw.directory)
        card["checkpoint"] = champion.checkpoint
        card_path.write_text(json.dumps(card))
        pointer_path = Path(registry_files.champion_path(layout.root, MODEL))
        pointer = json.loads(pointer_path.read_text())
        pointer.update(path=registry_files.version_dir(layout.root, MODEL, 1), checkpoint=champion.checkpoint)
        pointer_path.write_text(json.dumps(pointer))
    return layout, raw, dataset, trained, evaluation


def same_run_under(root: str, raw: RawData, dataset: ParquetDataset, trained: TrainedModel, evaluation: Evaluation):
    """The stage outputs of run 'run' as a run in ``root`` computes them (its own layout's paths)."""
    layout = StorageLayout.create(root, "run")

    def moved(path: str) -> str:
        return join(layout.run_dir, Path(path).name)

    checkpoints = [c.model_copy(update={"path": moved(c.path)}) for c in trained.checkpoints]
    trained = trained.model_copy(update={"run_dir": layout.run_dir, "checkpoints": checkpoints,
                                         "best_checkpoint": moved(trained.best_checkpoint)})
    evaluation = evaluation.model_copy(update={"checkpoint": moved(evaluation.checkpoint)})
    raw = raw.model_copy(update={"directory": layout.raw_dir("sample")})
    dataset = dataset.model_copy(update={"directory": layout.dataset_dir("abc")})
    return layout, raw, dataset, trained, evaluation


@pytest.mark.parametrize("older_format", [False, True], ids=["relative-paths", "older-absolute-paths"])
def test_a_copied_root_keeps_its_champions_data_through_cleanup(tmp_path, older_format):
    """The reported data loss: a backup copy of a root, cleanup with delete-raw and delete-parquet in the copy."""
    original = promoted_root(tmp_path / "original", older_format)
    before = tree_digest(Path(original[0].root))
    copy_root = tmp_path / "backup" / "root"
    shutil.copytree(original[0].root, copy_root)
    layout, raw, dataset, trained, evaluation = same_run_under(str(copy_root), *original[1:])

    dry = cleanup.fn(POLICY.model_copy(update={"dry_run": True}), raw, dataset, trained, evaluation, layout)
    real = cleanup.fn(POLICY, raw, dataset, trained, evaluation, layout)
    assert set(real.kept) == set(dry.kept) == {raw.directory, dataset.directory}
    assert "named by the model card of mnist-resnet18 v1" in real.kept[dataset.directory]
    assert Path(raw.directory, "f.gz").is_file() and Path(dataset.directory, "part.parquet").is_file()
    assert sorted(real.paths) == sorted(dry.paths) == sorted(c.path for c in trained.checkpoints if c.epoch != 1)
    assert all(p.startswith(str(copy_root) + "/") for p in real.paths)  # deleted in the copy only
    assert read_json(real.report_path)["kept"] == real.kept
    assert tree_digest(Path(original[0].root)) == before  # the original is untouched


@pytest.mark.parametrize("older_format", [False, True], ids=["relative-paths", "older-absolute-paths"])
def test_a_moved_root_resolves_its_champion_and_knows_it_already_promoted_a_run(tmp_path, older_format):
    layout, *_ = promoted_root(tmp_path / "before", older_format)
    moved = tmp_path / "after" / "root"
    moved.parent.mkdir()
    os.rename(layout.root, moved)
    assert not Path(layout.root).exists()
    version, folder, card = lookup.resolve(str(moved), MODEL)
    assert (version, folder) == (1, str(moved / "models" / MODEL / "v1")) and card["run_name"] == "older-run"
    assert registry_files.read_champion(str(moved), MODEL)["path"] == folder
    assert registry_files.problems(str(moved), MODEL) == []
    new_layout = StorageLayout.create(str(moved), "unused")
    # The same run evaluated again (resumed) in the moved root: already the champion, nothing written
    again = light_candidate(new_layout, "older-run", 0.967, join(new_layout.root, "datasets", "mnist-abc"))
    result = registry.promote(new_layout, MODEL, again)
    assert result.promoted and result.version == 1 and "already the champion" in result.reason
    assert registry_files.versions(str(moved), MODEL) == [1]
    # and the data the card names is found under the new place
    stored = registry_files.read_card(str(moved), MODEL, 1)["data"]["dataset_dir"]
    assert from_stored(str(moved), stored) == str(moved / "datasets" / "mnist-abc")


def test_stored_paths_are_relative_and_an_older_roots_paths_map_or_are_refused(tmp_path):
    root = str(tmp_path / "root")
    Path(root, "datasets", "mnist-abc").mkdir(parents=True)
    assert to_stored(root, join(root, "datasets", "mnist-abc")) == "datasets/mnist-abc"
    assert to_stored("s3://b/p", "s3://b/p/raw/sample") == "raw/sample"
    assert to_stored(root, "/elsewhere/raw/x") == "/elsewhere/raw/x"  # names nothing in this root: kept as given
    assert from_stored(root, "datasets/mnist-abc") == join(root, "datasets", "mnist-abc")
    # an older root's absolute path: mapped to the same place here when it exists, else nothing
    assert from_stored(root, "/old/place/datasets/mnist-abc") == join(root, "datasets", "mnist-abc")
    assert from_stored(root, "/old/place/datasets/mnist-gone") is None
    assert from_stored(root, "s3://other-bucket/prefix/datasets/mnist-abc") == join(root, "datasets", "mnist-abc")
    assert stored_places(root, "/old/place/datasets/x") == ["/old/place/datasets/x", join(root, "datasets", "x")]
    for bad in ("../outside", "datasets/../../etc", "datasets/x\n", "", "a\x00b"):
        with pytest.raises(StoredPathError):
            from_stored(root, bad)
    assert stored_places(root, "/old/datasets/../../etc") == ["/old/datasets/../../etc"]  # never mapped through '..'


def test_cleanup_never_deletes_by_an_older_roots_absolute_path(tmp_path):
    """A card of another root naming a path that maps to nothing here protects nothing here, and
    a selected path outside this root is refused whatever a card says."""
    layout, raw, dataset, trained, evaluation = promoted_root(tmp_path / "a", older_format=True)
    elsewhere = tmp_path / "elsewhere" / "raw" / "sample"
    elsewhere.mkdir(parents=True)
    (elsewhere / "keep.gz").write_bytes(b"precious")
    outside = raw.model_copy(update={"directory": str(elsewhere)})
    with pytest.raises(ValueError, match="outside the storage root"):
        cleanup.fn(POLICY, outside, dataset, trained, evaluation, layout)
    assert (elsewhere / "keep.gz").read_bytes() == b"precious"


def test_a_copied_roots_live_lease_protects_the_copys_folders(tmp_path):
    """A lease written with absolute paths (the older form) in a root that was then copied: the
    copy's own folders count as in use while that run lives."""
    layout, raw, dataset, trained, evaluation = promoted_root(tmp_path / "original", older_format=False)
    copy_root = tmp_path / "copy"
    shutil.copytree(layout.root, copy_root)
    other_lease = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), "uses": [dataset.directory]}
    atomic_write_json(copy_root / "leases" / "other.json", other_lease)  # live: this process
    copy_layout, copy_raw, copy_dataset, copy_trained, copy_eval = same_run_under(str(copy_root), raw, dataset, trained, evaluation)
    assert copy_dataset.directory in paths_in_use(copy_layout)
    # a lease written now stores the path relative to the root, and reads back under the root
    with run_lease(StorageLayout.create(str(copy_root), "writer")) as path:
        lease_uses(StorageLayout.create(str(copy_root), "writer"), copy_raw.directory)
        assert read_json(path)["uses"] == ["raw/sample"]
        assert copy_raw.directory in paths_in_use(copy_layout)


@pytest.mark.parametrize("older_format", [False, True], ids=["relative-paths", "older-absolute-paths"])
def test_a_root_synced_to_s3_keeps_its_champions_data_through_cleanup(tmp_path, s3_root, older_format):
    """A local root uploaded to a bucket (what `aws s3 sync` does), then a run's cleanup there."""
    local, raw, dataset, trained, evaluation = promoted_root(tmp_path / "disk", older_format)
    before = tree_digest(Path(local.root))
    upload_dir(Path(local.root), s3_root)
    layout = StorageLayout.create(s3_root, "run")
    checkpoints = [CheckpointInfo(path=join(layout.run_dir, Path(c.path).name), epoch=c.epoch, val_accuracy=c.val_accuracy)
                   for c in trained.checkpoints]
    s3_trained = TrainedModel(run_dir=layout.run_dir, model=SEEDS_MODEL, best_checkpoint=checkpoints[1].path,
                              best_val_accuracy=0.97, checkpoints=checkpoints, history=[], num_workers=1, cpus_per_worker=1.0)
    s3_eval = evaluation.model_copy(update={"checkpoint": checkpoints[1].path})
    s3_raw = raw.model_copy(update={"directory": layout.raw_dir("sample")})
    s3_dataset = dataset.model_copy(update={"directory": layout.dataset_dir("abc")})

    version, folder, _ = lookup.resolve(s3_root, MODEL)  # model.pt downloaded and checked against its checksum
    assert (version, folder) == (1, f"{s3_root}/models/{MODEL}/v1")
    report = cleanup.fn(POLICY, s3_raw, s3_dataset, s3_trained, s3_eval, layout)
    assert set(report.kept) == {s3_raw.directory, s3_dataset.directory}
    keys = s3_objects(s3_root)
    assert "raw/sample/f.gz" in keys and "datasets/mnist-abc/part.parquet" in keys
    assert "runs/run/checkpoint_0/model.pt" not in keys and "runs/run/checkpoint_1/model.pt" in keys
    assert tree_digest(Path(local.root)) == before
    # The local root's lock file came along with the sync: not an S3 lock, so it does not block promotion
    assert "locks/models-mnist-resnet18.lock" in keys
    started = time.monotonic()
    better = registry.promote(layout, MODEL, light_candidate(layout, "better", 0.99, s3_dataset.directory))
    assert better.promoted and better.version == 2 and time.monotonic() - started < 60


def test_a_version_promoted_on_s3_stores_paths_relative_to_the_bucket_root(s3_root):
    layout = StorageLayout.create(s3_root, "unused")
    atomic_write_json(join(layout.root, "datasets", "mnist-a", MANIFEST), {"fingerprint": "a"})
    result = registry.promote(layout, MODEL, light_candidate(layout, "r1", 0.9, join(layout.root, "datasets", "mnist-a")))
    assert result.promoted and result.version_dir == f"{s3_root}/models/{MODEL}/v1"
    card = read_json(join(result.version_dir, registry_files.CARD_FILE))
    assert card["data"]["dataset_dir"] == "datasets/mnist-a" and card["checkpoint"] == "runs/r1/checkpoint_000000"
    assert read_json(registry_files.champion_path(s3_root, MODEL))["path"] == f"models/{MODEL}/v1"
    assert exists(join(s3_root, "models", MODEL, "v1", MODEL_FILE))

