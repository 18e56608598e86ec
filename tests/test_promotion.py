"""Champion promotion and the model registry (`training.champion.registry`), without training.

Real checkpoints (a ResNet-18's weights written by torch), real storage roots (a local folder,
and moto's S3 server on 127.0.0.1), real processes racing for the root's lock, and the real
cleanup task. The end-to-end runs through the flow are in tests/test_promotion_flow.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from dataset.formats.parquet import to_table
from dataset.inputs.read import read_folder
from pipeline_config import CleanupConfig, PipelineConfig, PromoteConfig
from reporting.pictures import accuracy_over_runs_png
from reporting.report_text import comparison_rows
from storage_io import MANIFEST, StorageLayout, atomic_write_json, exists, join, read_json
from tests.support.cli import ROOT
from tests.support.digits import idx_bytes, synthetic_digits
from tests.support.registry import candidate, light_candidate, make_dataset
from tests.support.runs import torchvision_resnet18_seed_style
from training.champion import registry, registry_files
from training.checkpoint.files import MODEL_FILE
from training.checkpoint.model_files import build_resnet18, load_model

MODEL = "mnist-resnet18"


def test_promoted_only_when_better_than_the_champion(tmp_path):
    layout = StorageLayout.create(str(tmp_path / "root"), "unused")
    data = make_dataset(layout, "mnist-a")
    first = registry.promote(layout, MODEL, candidate(layout, "r1", 0.90, data), files={"confusion_matrix.png": b"png"})
    assert (first.promoted, first.version, first.champion_before) == (True, 1, None)
    assert "first model" in first.reason

    worse = registry.promote(layout, MODEL, candidate(layout, "r2", 0.85, data))
    assert not worse.promoted and worse.version == 1 and worse.champion_accuracy == 0.90
    assert "does not beat champion v1's 90.00%" in worse.reason
    tie = registry.promote(layout, MODEL, candidate(layout, "r3", 0.90, data))
    assert not tie.promoted
    short = registry.promote(layout, MODEL, candidate(layout, "r4", 0.93, data), min_improvement=0.05)
    assert not short.promoted and "by more than 5.00%" in short.reason
    better = registry.promote(layout, MODEL, candidate(layout, "r5", 0.96, data, seed=5), min_improvement=0.05)
    assert (better.promoted, better.version, better.champion_before) == (True, 2, 1)

    assert registry_files.versions(layout.root, MODEL) == [1, 2]
    pointer = registry_files.read_champion(layout.root, MODEL)
    assert pointer["version"] == 2 and pointer["run_name"] == "r5" and pointer["test_accuracy"] == 0.96
    card = registry_files.read_card(layout.root, MODEL, 2)
    assert card["run_name"] == "r5" and card["flow_run_id"] == "id-r5" and card["code_version"] == "abc123"
    assert card["data"]["manifest_hash"] == registry_files.data_hash(data)
    # Paths relative to the storage root (issue 37: a root can be copied or moved)
    assert card["data"]["dataset_dir"] == "datasets/mnist-a" and card["data"]["raw_dir"] == "raw/sample"
    assert card["checkpoint"] == "runs/r5/checkpoint_000000"
    assert json.loads(Path(registry_files.champion_path(layout.root, MODEL)).read_text())["path"] == f"models/{MODEL}/v2"
    assert card["config"] == {"train": {"epochs": 1}} and card["metrics"]["test_accuracy"] == 0.96
    assert card["previous_champion"] == {"version": 1, "test_accuracy_on_this_data": 0.90, "rescored": False}
    assert registry_files.read_card(layout.root, MODEL, 1)["files"] == ["_checksums.json", "confusion_matrix.png", "model.pt"]

    # model.pt loads the seeds' way (plain torch.load into torchvision's one-channel ResNet-18) and ours (checksum verified)
    folder = Path(registry_files.version_dir(layout.root, MODEL, 2))
    seed_style = torchvision_resnet18_seed_style()
    seed_style.load_state_dict(torch.load(folder / MODEL_FILE, weights_only=True))
    torch.manual_seed(5)
    expected = build_resnet18().state_dict()
    card = registry_files.read_card(layout.root, MODEL, 2)
    assert card["architecture"] == {"name": "resnet18", "in_channels": 1, "num_classes": 10}  # what load_model builds
    loaded = load_model(str(folder), registry_files.version_model(str(folder)))
    assert all(torch.equal(value, expected[name]) for name, value in loaded.state_dict().items())


def test_a_gate_failure_is_never_promoted_and_writes_nothing(tmp_path):
    layout = StorageLayout.create(str(tmp_path / "root"), "unused")
    data = make_dataset(layout, "mnist-a")
    result = registry.promote(layout, MODEL, candidate(layout, "r1", 0.99, data, passed=False))
    assert not result.promoted and result.version is None and "gate failed" in result.reason
    assert not exists(registry_files.model_dir(layout.root, MODEL))


def test_changed_data_scores_the_champion_again_on_the_new_test_set(tmp_path):
    layout = StorageLayout.create(str(tmp_path / "root"), "unused")
    old, new = make_dataset(layout, "mnist-old"), make_dataset(layout, "mnist-new")
    registry.promote(layout, MODEL, candidate(layout, "r1", 0.99, old))
    asked: list[str] = []

    def rescore(accuracy):
        def score(folder: str) -> float:
            asked.append(folder)
            return accuracy
        return score

    # 0.95 < the champion's recorded 0.99, but on the new test set the champion scores 0.90
    won = registry.promote(layout, MODEL, candidate(layout, "r2", 0.95, new), rescore=rescore(0.90))
    assert won.promoted and won.version == 2 and won.champion_rescored and won.champion_accuracy == 0.90
    assert "scored again" in won.reason and asked == [registry_files.version_dir(layout.root, MODEL, 1)]
    lost = registry.promote(layout, MODEL, candidate(layout, "r3", 0.96, old), rescore=rescore(0.97))
    assert not lost.promoted and lost.champion_accuracy == 0.97 and asked[-1] == registry_files.version_dir(layout.root, MODEL, 2)
    kept = registry.promote(layout, MODEL, candidate(layout, "r4", 0.99, old))  # no way to rescore: the champion stays
    assert not kept.promoted and "could not be scored again" in kept.reason


def test_evaluating_the_champion_again_keeps_it(tmp_path):
    """A resumed run evaluates again: it is already the champion, nothing new is published."""
    layout = StorageLayout.create(str(tmp_path / "root"), "unused")
    data = make_dataset(layout, "mnist-a")
    first = candidate(layout, "r1", 0.9, data)
    registry.promote(layout, MODEL, first)
    again = registry.promote(layout, MODEL, first)
    assert again.promoted and again.version == 1 and "already the champion" in again.reason
    assert registry_files.versions(layout.root, MODEL) == [1]


RACER = """
import sys
from storage_io import StorageLayout
from training.champion import registry, registry_files
from tests.support.registry import light_candidate
layout = StorageLayout.create(sys.argv[1], "unused")
result = registry.promote(layout, "mnist-resnet18", light_candidate(layout, sys.argv[2], float(sys.argv[3]), sys.argv[4]))
print(result.model_dump_json())
"""


def check_one_consistent_champion(layout: StorageLayout, accuracies: dict[str, float], results: list[dict]) -> None:
    """Whatever the order, the champion is the best run, versions are 1..n, and the pointer names a whole version."""
    promoted = sorted(r["version"] for r in results if r["promoted"])
    assert promoted == list(range(1, len(promoted) + 1)) == registry_files.versions(layout.root, MODEL)
    pointer = registry_files.read_champion(layout.root, MODEL)
    best = max(accuracies, key=accuracies.get)
    assert pointer["run_name"] == best and pointer["version"] == promoted[-1]
    card = registry_files.read_card(layout.root, MODEL, pointer["version"])
    assert card["run_name"] == best and exists(join(pointer["path"], MODEL_FILE))


def test_runs_finishing_at_once_leave_one_consistent_champion(tmp_path):
    """Four processes promote at the same moment on one local root (the root's fcntl lock; light
    candidates: the race is about the lock, and the registry copies and checksums model.pt, never loads it)."""
    layout = StorageLayout.create(str(tmp_path / "root"), "unused")
    data = make_dataset(layout, "mnist-a")
    accuracies = {"r1": 0.91, "r2": 0.94, "r3": 0.92, "r4": 0.93}
    racers = [
        subprocess.Popen([sys.executable, "-c", RACER, layout.root, run, str(acc), data], cwd=ROOT, stdout=subprocess.PIPE, text=True)
        for run, acc in accuracies.items()
    ]
    results = [json.loads(proc.communicate(timeout=300)[0]) for proc in racers]
    assert all(proc.returncode == 0 for proc in racers)
    check_one_consistent_champion(layout, accuracies, results)


def test_concurrent_promotions_on_s3_leave_one_consistent_champion(s3_root):
    """The same race on a bucket: the S3 lock (a conditional PUT) serializes the decisions. (The race
    is about the lock, not the weights: light candidates keep 45 MB models off the loopback server.)"""
    layout = StorageLayout.create(s3_root, "unused")
    data = make_dataset(layout, "mnist-a")
    accuracies = {"r1": 0.91, "r2": 0.94, "r3": 0.92}
    candidates = {run: light_candidate(layout, run, acc, data) for run, acc in accuracies.items()}
    results: list[dict] = []
    threads = [
        threading.Thread(target=lambda c=c: results.append(registry.promote(layout, MODEL, c).model_dump()))
        for c in candidates.values()
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert len(results) == 3
    check_one_consistent_champion(layout, accuracies, results)


def test_cleanup_keeps_the_registry_and_the_data_a_model_card_names(run_tree):
    from tasks.cleanup import cleanup

    layout, raw, dataset, trained, evaluation = run_tree
    atomic_write_json(join(dataset.directory, MANIFEST), {"fingerprint": "abc"})
    champion = candidate(layout, "older-run", 0.9, dataset.directory).model_copy(update={"raw_dir": raw.directory})
    assert registry.promote(layout, MODEL, champion).promoted
    policy = CleanupConfig(delete_raw=True, delete_parquet=True, keep_checkpoints=1)
    dry = cleanup.fn(policy.model_copy(update={"dry_run": True}), raw, dataset, trained, evaluation, layout)
    assert set(dry.kept) == {raw.directory, dataset.directory}
    assert "named by the model card of mnist-resnet18 v1" in dry.kept[dataset.directory]
    real = cleanup.fn(policy, raw, dataset, trained, evaluation, layout)
    assert real.kept == dry.kept and real.paths == dry.paths and len(real.paths) == 2  # the two other checkpoints
    assert exists(raw.directory) and exists(dataset.directory)
    assert exists(join(registry_files.version_dir(layout.root, MODEL, 1), MODEL_FILE))
    assert read_json(real.report_path)["kept"] == real.kept


def test_run_comparison_rows_and_picture(tmp_path):
    layout = StorageLayout.create(str(tmp_path / "root"), "unused")
    data = make_dataset(layout, "mnist-a")
    registry.promote(layout, MODEL, candidate(layout, "r2", 0.95, data))
    rows = [
        {"run": "r1", "finished_at": "2026-11-24T01:00:00+00:00", "test_accuracy": 0.40, "passed_gate": False, "promoted": False},
        {"run": "r2", "finished_at": "2026-11-25T01:00:00+00:00", "test_accuracy": 0.95, "passed_gate": True, "promoted": True,
         "version": 1, "data_hash": "f" * 64, "val_loss": 0.61234, "epochs": 3, "train_images_per_s": 401.26, "wall_s": 88.04},
        {"run": "r3", "finished_at": "2026-11-26T01:00:00+00:00", "test_accuracy": 0.93, "passed_gate": True, "promoted": False},
    ]
    for row in rows:
        registry.record_run(layout.root, MODEL, row)
    recent = registry.recent_runs(layout.root, MODEL, limit=2)
    assert [r["run"] for r in recent] == ["r2", "r3"] and [r["champion"] for r in recent] == [True, False]
    table = comparison_rows(registry.recent_runs(layout.root, MODEL))
    assert [r["run"] for r in table] == ["r3", "r2", "r1"]  # newest first
    assert [r["promoted"] for r in table] == ["no", "v1 (champion)", "no: gate failed"]
    assert list(table[1]) == ["date", "run", "test_accuracy", "promoted", "val_loss", "epochs", "train_images_per_s", "wall_s", "data"]
    assert table[1] == {
        "date": "2026-11-25 01:00:00", "run": "r2", "data": "f" * 12, "test_accuracy": 0.95, "val_loss": 0.6123, "epochs": 3,
        "train_images_per_s": 401.3, "wall_s": 88.0, "promoted": "v1 (champion)",
    }
    png = accuracy_over_runs_png(registry.recent_runs(layout.root, MODEL))
    assert png.startswith(b"\x89PNG") and len(png) > 5000
    with pytest.raises(ValueError, match="no run has a test accuracy"):
        accuracy_over_runs_png([{"run": "x"}])


def test_model_name_is_checked_before_any_work():
    with pytest.raises(ValueError, match="promote.model_name"):
        PipelineConfig(promote={"model_name": "My Model"})
    assert PromoteConfig().min_improvement == 0.0


def test_the_registry_name_follows_the_workload_and_the_model():
    """Unset promote.model_name: <workload>-<model>; the defaults keep MNIST's champion name exactly."""
    assert PromoteConfig().model_name is None and PipelineConfig().registry_name == MODEL
    assert PipelineConfig(model={"name": "training.model.catalog:small_cnn"}).registry_name == "mnist-small-cnn"
    other = PipelineConfig(workload="rgb-shapes", model={"name": "mobilenet_v3_small"})
    assert other.registry_name == "rgb-shapes-mobilenet-v3-small"
    named = PipelineConfig(workload="rgb-shapes", promote={"model_name": "my-champion"})
    assert named.registry_name == "my-champion"  # set: used as given, whatever the workload
    assert len(PipelineConfig(workload="w" * 40, model={"name": "pkg.mod:" + "x" * 60}).registry_name) <= 63


def test_prediction_inputs_from_idx_and_parquet_folders(tmp_path):
    images, labels = synthetic_digits(30, seed=1)
    idx = tmp_path / "idx"
    idx.mkdir()
    (idx / "new-images-idx3-ubyte").write_bytes(idx_bytes(images.reshape(-1, 28, 28)))  # not gzipped, no labels
    table = read_folder(idx)
    assert len(table) == 30 and table.column("label").to_pylist() == [-1] * 30
    assert np.array_equal(table.column("row_id").to_numpy(), np.arange(30))
    (idx / "new-labels-idx1-ubyte").write_bytes(idx_bytes(labels.astype(np.uint8)))
    assert read_folder(idx).column("label").to_pylist() == labels.tolist()
    bundled = read_folder(ROOT / "data" / "mnist-sample")  # the shipped .gz files: train and test, with labels
    assert len(bundled) == 5000 and min(bundled.column("label").to_pylist()) == 0

    parquet = tmp_path / "parquet" / "test"
    parquet.mkdir(parents=True)
    pq.write_table(to_table(np.arange(100, 130), images.reshape(30, -1), labels), parquet / "part-0.parquet")
    table = read_folder(tmp_path / "parquet")
    assert table.column("row_id").to_pylist() == list(range(100, 130)) and table.column("label").to_pylist() == labels.tolist()
    pq.write_table(pa.table({"pixels": [b"x"]}), parquet / "part-1.parquet")
    with pytest.raises(ValueError, match="part-1.parquet: needs an 'image' column"):
        read_folder(tmp_path / "parquet")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty: no digits or images found"):
        read_folder(tmp_path / "empty")
    with pytest.raises(ValueError, match="missing: not a folder"):
        read_folder(tmp_path / "missing")
