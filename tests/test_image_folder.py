"""A labelled image folder as the data (download.source=folder): its checks, its conversion, and a run end to end.

The workload is the tests' own (tests/support/images.py): three classes of 20x20 RGB PNGs, not
MNIST. The checks name the path or field that is wrong before any work; the conversion (Ray Data's
read_images in a real local Ray) writes the same verified Parquet dataset with the images' shape
and class names in its manifest; every later stage takes them from there. The end-to-end test runs
docs/extending.md as written: a user's own model module and config file, `flows.train`, then
`flows.predict` on the folder's test/ with the champion.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from benchmarks.speed import recipe as recipe_bench
from dataset.formats import folder, folder_scan
from dataset.formats.parquet import MNIST_CLASSES, ParquetDataset, images_from_column, manifest_data
from dataset.inputs.read import read_folder
from dataset.inputs.tables import NO_LABEL
from dataset.sources.interface import check_data
from pipeline_config import DownloadConfig, ParquetConfig
from storage_io import MANIFEST, read_json, sha256_json
from tasks.download import download
from tasks.to_parquet import dataset_fingerprint, to_parquet
from tests.support.images import CLASSES, SIZE, write_image_folder

ROOT = Path(__file__).resolve().parent.parent
CFG = ParquetConfig(rows_per_file=64, rows_per_group=64, validation_every=5)


# --------------------------------------------------------------------------- config and checks


def test_download_path_is_required_with_source_folder_and_refused_without_it():
    with pytest.raises(ValidationError, match="source=folder needs download.path"):
        DownloadConfig(source="folder")
    with pytest.raises(ValidationError, match="download.path is only read with download.source=folder"):
        DownloadConfig(source="sample", path="/data/images")
    with pytest.raises(ValidationError, match="use a local folder or s3://"):
        DownloadConfig(source="folder", path="http://example.com/images")
    assert DownloadConfig(source="folder", path="s3://bucket/images/").path == "s3://bucket/images"


def test_each_bad_layout_is_refused_naming_the_path(tmp_path):
    missing = tmp_path / "nothing-here"
    with pytest.raises(folder.FolderError, match=f"download.path {missing}: no such folder"):
        folder.check_folder(str(missing))

    root = write_image_folder(tmp_path / "no-test", {"train": 2})
    with pytest.raises(folder.FolderError, match=f"download.path {root}: has no test/ folder"):
        folder.check_folder(str(root))

    root = tmp_path / "no-classes"
    (root / "train").mkdir(parents=True)
    (root / "test").mkdir()
    with pytest.raises(folder.FolderError, match=f"{root}: train/ has no class subfolders"):
        folder.check_folder(str(root))

    root = write_image_folder(tmp_path / "unknown-class", {"train": 2, "test": 1})
    write_image_folder(tmp_path / "other", {"test": 1}, classes=("yellow_star",))
    (root / "test" / "yellow_star").mkdir()
    (tmp_path / "other" / "test" / "yellow_star" / "yellow_star-000.png").rename(root / "test" / "yellow_star" / "a.png")
    with pytest.raises(folder.FolderError, match=f"{root / 'test' / 'yellow_star'}: class 'yellow_star' is not in {root / 'train'}"):
        folder.check_folder(str(root))

    root = write_image_folder(tmp_path / "empty-class", {"train": 2, "test": 1})
    (root / "train" / "purple_void").mkdir()
    with pytest.raises(folder.FolderError, match=f"{root / 'train' / 'purple_void'}: no images"):
        folder.check_folder(str(root))

    root = write_image_folder(tmp_path / "loose", {"train": 2, "test": 1})
    (root / "train" / "blue_cross" / "blue_cross-000.png").rename(root / "train" / "stray.png")
    with pytest.raises(folder.FolderError, match=f"{root / 'train' / 'stray.png'}: an image outside a class folder"):
        folder.check_folder(str(root))

    good = folder.check_folder(str(write_image_folder(tmp_path / "good", {"train": 3, "test": 2})))
    assert good.classes == list(CLASSES) and not good.has_val
    assert len(good.files["train"]) == 9 and good.files["test"][0] == ("test/blue_cross/blue_cross-000.png", 0)


def test_the_cli_refuses_a_bad_folder_before_any_work(tmp_path):
    storage = tmp_path / "storage"
    out = subprocess.run(
        [sys.executable, "-m", "flows.mnist", "--storage-root", str(storage), "--download.source", "folder",
         "--download.path", str(tmp_path / "absent")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 2 and f"download.path {tmp_path / 'absent'}: no such folder" in out.stderr
    assert not storage.exists()  # nothing was written

    # A file that is not an image, and sizes that differ without transform.image_size: refused the same way
    root = write_image_folder(tmp_path / "damaged", {"train": 2, "test": 1})
    broken = root / "train" / "green_disc" / "green_disc-001.png"
    broken.write_bytes(b"not a picture")
    out = subprocess.run(
        [sys.executable, "-m", "flows.train", "--storage-root", str(storage), "--download.source", "folder",
         "--download.path", str(root)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 2 and f"{broken}: not a readable image" in out.stderr, out.stderr[-2000:]
    assert not storage.exists()
    write_image_folder(tmp_path / "big", {"train": 1}, size=24)
    (tmp_path / "big" / "train" / "green_disc" / "green_disc-000.png").replace(broken)
    with pytest.raises(folder.FolderError, match=f"{broken}: 24x24 pixels, but .* is 20x20; set transform.image_size"):
        check_data(DownloadConfig(source="folder", path=str(root)))
    assert check_data(DownloadConfig(source="folder", path=str(root)), image_size=16).classes == list(CLASSES)


def test_stratified_split_is_seeded_and_keeps_every_class():
    labels = [0] * 20 + [1] * 10 + [2] * 5
    held = folder.stratified_split(labels, every=5, seed=0)
    assert np.array_equal(held, folder.stratified_split(labels, every=5, seed=0))
    assert not np.array_equal(held, folder.stratified_split(labels, every=5, seed=1))
    assert np.bincount(np.asarray(labels)[held], minlength=3).tolist() == [4, 2, 1]


# --------------------------------------------------------------------------- MNIST unchanged


def test_mnist_fingerprint_and_manifest_fallback_are_unchanged():
    from dataset.sources.interface import RawData

    raw = RawData(source="sample", url="file:///x/", directory="/x", files={"a.gz": "0" * 64}, skipped=True)
    before = sha256_json({"v": 1, "inputs": raw.files, "cfg": {"rows_per_file": 1000, "rows_per_group": 1000, "validation_every": 20}})
    assert dataset_fingerprint(raw, ParquetConfig()) == before[:16]  # what every MNIST dataset folder is named by
    assert manifest_data({"rows": {}}) == ((1, 28, 28), list(MNIST_CLASSES))  # a manifest from before the fields
    assert ParquetDataset(directory="/d", fingerprint="f", rows={}).num_classes == 10


# --------------------------------------------------------------------------- the conversion


def test_conversion_writes_shape_classes_and_a_stratified_validation_split(tmp_path, layout, local_ray):
    root = write_image_folder(tmp_path / "images", {"train": 10, "test": 4})
    raw = download.fn(DownloadConfig(source="folder", path=str(root)), layout)
    assert raw.source == "folder" and raw.directory == str(root) and len(raw.files) == 42
    dataset = to_parquet.fn(raw, CFG, layout)
    assert dataset.image_shape == (3, SIZE, SIZE) and dataset.classes == list(CLASSES)
    assert dataset.rows == {"train": 24, "val": 6, "test": 12}  # 2 of each class's 10 held out (validation_every=5)
    manifest = read_json(Path(dataset.directory) / MANIFEST)
    assert manifest["image"] == {"channels": 3, "height": SIZE, "width": SIZE} and manifest["classes"] == list(CLASSES)

    val = pq.read_table(Path(dataset.directory) / "val")
    assert sorted(val.column("label").to_pylist()) == [0, 0, 1, 1, 2, 2]
    # Training rows in a seeded random order, not class by class: a streamed window of a few row groups
    # mixes the classes (dataset.tensors.windows); row ids still count up through the files.
    train = pq.read_table(Path(dataset.directory) / "train")
    labels = train.column("label").to_pylist()
    assert train.column("row_id").to_pylist() == sorted(train.column("row_id").to_pylist())
    assert sorted(labels) == [0] * 8 + [1] * 8 + [2] * 8 and labels != sorted(labels)
    runs = sum(1 for a, b in zip(labels, labels[1:]) if a != b) + 1
    assert runs > 6, labels  # class by class would be 3 runs
    assert val.schema.field("image").type.byte_width == SIZE * SIZE * 3
    test = pq.read_table(Path(dataset.directory) / "test").sort_by("row_id")
    pixels = images_from_column(test.column("image")).reshape(-1, SIZE, SIZE, 3)
    from PIL import Image

    first = np.asarray(Image.open(root / "test" / "blue_cross" / "blue_cross-000.png"))
    assert np.array_equal(pixels[0], first)  # HWC, row-major, as the file holds it
    assert test.column("row_id").to_pylist() == list(range(30, 42))

    again = to_parquet.fn(raw, CFG, layout)
    assert again.skipped and again.image_shape == dataset.image_shape and again.classes == dataset.classes
    other = to_parquet.fn(raw, CFG.model_copy(update={"split_seed": 1}), layout)
    assert other.directory != dataset.directory  # the split seed is part of a folder dataset's fingerprint

    (root / "test" / "red_square" / "red_square-000.png").write_bytes((root / "test" / "green_disc" / "green_disc-000.png").read_bytes())
    changed = download.fn(DownloadConfig(source="folder", path=str(root)), layout)
    assert dataset_fingerprint(changed, CFG) != dataset.fingerprint  # changed data, another dataset


def test_a_folder_decoded_here_and_one_decoded_by_ray_data_write_the_same_parquet(tmp_path, local_ray):
    """On one node, or when it fits the in-memory budget, a folder is decoded in the stage's own process (no Ray Data
    actors or task workers left beside training); a larger one on a cluster by Ray Data's tasks. Both write the same
    rows, row groups and pixels, and both name a file that does not decode."""
    from dataset.formats import folder_convert

    root = write_image_folder(tmp_path / "images", {"train": 40, "test": 8})
    found = folder.check_folder(str(root))
    shape = (3, SIZE, SIZE)
    assert folder_convert.decodes_here(len(found.files["train"]), shape, nodes=2)
    assert not folder_convert.decodes_here(10**9, shape, nodes=2)  # a billion images on a cluster: Ray Data's tasks
    assert folder_convert.decodes_here(10**9, shape, nodes=1)  # on one node: here, a few batches at a time
    written = {}
    for here in (True, False):
        out = tmp_path / f"here-{here}"
        rows, got = folder_convert.convert_folder(found, out, CFG, None, here=here)
        assert got == shape and rows == {"train": 96, "val": 24, "test": 24}
        groups = [[pq.ParquetFile(f).metadata.row_group(g).num_rows for g in range(pq.ParquetFile(f).num_row_groups)]
                  for f in sorted((out / "train").glob("*.parquet"))]
        written[here] = groups, {split: pq.read_table(out / split) for split in rows}
    assert written[True][0] == written[False][0] == [[64], [32]]  # parquet.rows_per_file and rows_per_group: 64
    for split, table in written[True][1].items():
        assert table.equals(written[False][1][split]), split
    bad = root / "train" / "red_square" / "red_square-003.png"
    bad.write_bytes(b"not a png")
    for here in (True, False):
        with pytest.raises(folder.FolderError, match=str(bad)):
            folder_convert.convert_folder(folder.check_folder(str(root)), tmp_path / f"bad-{here}", CFG, None, here=here)


def test_decoding_tasks_share_the_cpus_the_calling_stage_leaves(local_ray):
    """As many decoding tasks at once as the cluster has CPUs: the to-parquet stage holds one of the 2 CPUs
    and only writes, so each task asks for half of one; a process holding none (a driver) leaves whole ones."""
    assert folder_scan.decode_task_cpus() == 1.0

    @local_ray.remote(num_cpus=1)
    def in_a_stage() -> float:
        return folder_scan.decode_task_cpus()

    assert local_ray.get(in_a_stage.remote()) == 0.5


def test_differing_sizes_need_image_size_and_grayscale_stays_one_channel(tmp_path, layout, local_ray):
    root = write_image_folder(tmp_path / "gray", {"train": 4, "test": 2}, gray=True)
    write_image_folder(tmp_path / "big", {"test": 1}, size=24, gray=True)
    odd = root / "test" / "red_square" / "red_square-001.png"
    (tmp_path / "big" / "test" / "red_square" / "red_square-000.png").rename(odd)
    raw = download.fn(DownloadConfig(source="folder", path=str(root)), layout)
    with pytest.raises(folder.FolderError, match=f"{odd}: 24x24 pixels, but .* is 20x20; set transform.image_size"):
        to_parquet.fn(raw, CFG, layout)
    dataset = to_parquet.fn(raw, CFG, layout, image_size=16)
    assert dataset.image_shape == (1, 16, 16) and dataset.rows["test"] == 6
    assert read_json(Path(dataset.directory) / MANIFEST)["image"] == {"channels": 1, "height": 16, "width": 16}


def test_cleanup_never_selects_a_users_folder(tmp_path):
    from dataset.sources.interface import RawData
    from pipeline_config import CleanupConfig
    from tasks.cleanup import plan

    raw = RawData(source="folder", url=str(tmp_path), directory=str(tmp_path), files={}, skipped=True)
    dataset = ParquetDataset(directory=str(tmp_path / "ds"), fingerprint="f", rows={})

    class Trained:
        checkpoints = []

    assert plan(CleanupConfig(delete_raw=True, delete_parquet=True), raw, dataset, Trained(), None) == [dataset.directory]


def test_predict_reads_class_folders_labelled_and_flat_folders_unlabelled(tmp_path):
    root = write_image_folder(tmp_path / "images", {"test": 2})
    table = read_folder(root / "test", (3, SIZE, SIZE), list(CLASSES))
    assert table.column("label").to_pylist() == [0, 0, 1, 1, 2, 2]
    flat = tmp_path / "flat"
    flat.mkdir()
    for path in (root / "test" / "green_disc").iterdir():
        path.rename(flat / path.name)
    assert read_folder(flat, (3, SIZE, SIZE), list(CLASSES)).column("label").to_pylist() == [NO_LABEL] * 2
    with pytest.raises(ValueError, match="blue_cross-000.png: 20x20 pixels, the model takes 16x16"):
        read_folder(root / "test", (3, 16, 16), list(CLASSES))
    assert read_folder(root / "test", (1, 16, 16), list(CLASSES), image_size=16).schema.field("image").type.byte_width == 256
    with pytest.raises(ValueError, match=f"{root / 'test' / 'red_square'}: class folder 'red_square' is not one of the model's classes"):
        read_folder(root / "test", (3, SIZE, SIZE), ["blue_cross", "green_disc"])


# --------------------------------------------------------------------------- end to end


def folder_workload(root: Path):
    """An image folder (train/ and test/ class folders) as `benchmarks.data.workloads.Workload` arrays."""
    from PIL import Image

    from benchmarks.data.workloads import Workload

    classes = tuple(sorted(p.name for p in (root / "train").iterdir()))
    arrays = []
    for split in ("train", "test"):
        files = [(f, i) for i, c in enumerate(classes) for f in sorted((root / split / c).glob("*.png"))]
        images = np.stack([np.asarray(Image.open(f).convert("RGB")) for f, _ in files])
        arrays += [images, np.array([i for _, i in files], dtype=np.int64)]
    return Workload(root.name, classes, *arrays)


def guide_blocks() -> dict[str, str]:
    """docs/extending.md's fenced blocks: the files by the name on their first line, and the commands."""
    import re

    text = (ROOT / "docs" / "extending.md").read_text()
    blocks = {}
    for lang, body in re.findall(r"```(\w+)\n(.*?)```", text, flags=re.S):
        if lang in {"python", "yaml"}:
            blocks[body.splitlines()[0].lstrip("# ").strip()] = body
        elif lang == "bash":
            blocks.setdefault("commands", []).extend(line for line in body.splitlines() if line.startswith("python -m "))
    return blocks


@pytest.mark.slow
@pytest.mark.spine
def test_the_extending_guide_runs_as_written(tmp_path, shared_server, shared_ray, monkeypatch):
    """docs/extending.md, run as written on the tests' own RGB workload: the user's model module and
    config file as the page shows them, `python -m flows.train --config-file shapes.yaml` from their
    folder (no file of the project edited), then `flows.predict` on the folder's test/ with the champion.
    Checks what the page says you get: every name after the workload (run, Prefect flow run, dataset,
    artifact keys, champion), the shape and classes in the manifest and the model card, a 3x3
    evaluation, a champion, predict reproducing the evaluation's accuracy. And the recipe at a short
    budget (the guide's 160 optimizer steps): the run scores, without test-time augmentation, within
    two test images of a plain constant-rate AdamW loop given the same images, model, batch, epochs
    and seed in this test (`benchmarks.speed.recipe.plain`; 2 of 45 images is 4.4 points).
    (The session's Prefect server and Ray cluster, ``shared_ray``, as a deployment's runs have them: this run
    is not about starting either. The guide's commands stay as written; the cluster is named in the
    environment, ``PIPELINE_RAY__ADDRESS``. The user's model module is imported by this run's own Ray workers,
    from its folder on their ``sys.path``; no other run gets those workers.)"""
    import re

    from pipeline_config import registry_model_name
    from reporting.artifacts import artifact_keys, comparison_keys
    from tests.support.prefect_server import api_env
    from tests.support.ray_cluster import join_env

    blocks = guide_blocks()
    (tmp_path / "my_models.py").write_text(blocks["my_models.py"])
    (tmp_path / "shapes.yaml").write_text(blocks["shapes.yaml"])
    train_command, predict_command = blocks["commands"]
    assert train_command == "python -m flows.train --config-file shapes.yaml"
    images = write_image_folder(tmp_path / "my-images", {"train": 40, "test": 15})
    storage = tmp_path / "storage"  # the default storage_root, relative to the folder the user runs from

    def run(command: str, env: dict[str, str]) -> subprocess.CompletedProcess:
        argv = [sys.executable, *command.split()[1:]]  # "python": the project's interpreter
        return subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)

    env = {k: v for k, v in api_env(shared_server.api).items() if not k.startswith(("PIPELINE_", "PYTHONPATH"))}
    env |= join_env(shared_ray)
    out = run(train_command, env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]

    (run_dir,) = (storage / "runs").iterdir()
    assert re.fullmatch(r"shapes-\d{8}-\d{6}-[0-9a-f]{6}", run_dir.name), run_dir.name  # no run_name: the workload's default
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["data_source"] == "folder" and summary["workload"] == "shapes"
    assert summary["module"] == "flows.train" and f"Training pipeline: run {run_dir.name}" in out.stdout + out.stderr
    flow_run = shared_server.flow_run(summary["flow_run_id"])  # the Prefect flow run: named as the run, flow "train"
    assert flow_run["name"] == run_dir.name and shared_server.get(f"/flows/{flow_run['flow_id']}")["name"] == "train"
    assert summary["data"]["rows"] == {"train": 114, "val": 6, "test": 45}  # 2 of each class's 40 held out
    assert len(summary["evaluation"]["confusion"]) == 3 and summary["evaluation"]["rows"] == 45
    assert summary["evaluation"]["classes"] == list(CLASSES) and summary["data"]["download_skipped"] is False
    print(f"extending guide run: test accuracy {summary['test_accuracy']:.2%}, stages {summary['stages']}")
    assert summary["test_accuracy"] >= 0.8  # the guide's gate
    assert "optimizer steps" not in out.stdout + out.stderr  # 8 steps an epoch x 20: no few-steps warning
    monkeypatch.syspath_prepend(str(tmp_path))  # the guide's model module, for the plain loop
    plain = recipe_bench.plain(folder_workload(images), "my_models:tiny_net", epochs=20, seed=0, batch=16)
    ours = summary["evaluation"]["accuracy_without_tta"]
    print(f"recipe at 160 steps: pipeline {ours:.2%} without TTA, plain AdamW loop {plain:.2%}")
    assert ours >= plain - 2 / 45

    (dataset_dir,) = (storage / "datasets").iterdir()
    assert dataset_dir.name.startswith("shapes-")
    manifest = read_json(dataset_dir / MANIFEST)
    assert manifest["image"] == {"channels": 3, "height": SIZE, "width": SIZE} and manifest["classes"] == list(CLASSES)
    assert sorted(path.name for path in (storage / "models").iterdir()) == ["shapes-tiny-net"]
    card = json.loads((storage / "models" / "shapes-tiny-net" / "v1" / "model_card.json").read_text())
    assert card["data"]["image"] == manifest["image"] and card["data"]["classes"] == list(CLASSES)
    assert card["architecture"] == {"name": "my_models:tiny_net", "in_channels": 3, "num_classes": 3}
    assert summary["promotion"]["promoted"] is True and summary["promotion"]["model"] == "shapes-tiny-net"
    assert registry_model_name("shapes", "my_models:tiny_net") == "shapes-tiny-net"
    assert "--model shapes-tiny-net" in out.stdout + out.stderr  # the printed predict command names it
    keys = {artifact["key"] for artifact in shared_server.artifacts(summary["flow_run_id"])}  # nothing named mnist
    assert keys == set(artifact_keys("shapes").values()) | set(comparison_keys("shapes-tiny-net").values())
    assert all(key.startswith("shapes-") for key in keys)
    assert len(list((images / "train").rglob("*.png"))) == 120  # the user's folder is only read

    scored = run(predict_command, env)
    assert scored.returncode == 0, scored.stderr[-3000:]
    assert f"Accuracy: {summary['test_accuracy']:.2%} on 45 labelled images" in scored.stdout
    (predictions,) = (storage / "predictions").glob("shapes-tiny-net-v1-*.parquet")
    result = pq.read_table(predictions)
    assert len(result) == 45 and set(result.column("pred_class").to_pylist()) <= set(CLASSES)
