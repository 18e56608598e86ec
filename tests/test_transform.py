"""The Ray Data transform: pure batch functions on tiny arrays, then the real pipeline on a local Ray."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dataset.formats.parquet import to_table
from dataset.sources.interface import RawData
from dataset.tensors.augment import random_affine
from dataset.tensors.batches import epoch_seed, normalize, prepare_batch, row_draws
from dataset.tensors.spec import fits_in_memory
from dataset.tensors.transform import build_datasets, build_split
from pipeline_config import ParquetConfig, TransformConfig
from tasks.to_parquet import to_parquet
from tasks.transform import transform
from tests.support.digits import synthetic_digits, write_raw


def test_normalize_matches_the_seeds_transform():
    images = np.array([[0, 255, 128] + [0] * 781], dtype=np.uint8)
    out = normalize(images, 0.5, 0.5)
    assert out.dtype == np.float32 and out.shape == (1, 1, 28, 28)
    # ToTensor() then Normalize((0.5,), (0.5,)): 0 -> -1, 255 -> 1, 128 -> 128/255*2-1
    np.testing.assert_allclose(out[0, 0, 0, :3], [-1.0, 1.0, 128 / 255 * 2 - 1], atol=1e-6)


def test_random_shift_moves_content_exactly_and_fills_with_zero():
    image = np.zeros((1, 28, 28), dtype=np.uint8)
    image[0, 10:18, 10:18] = 200
    rng = np.random.default_rng(0)
    shifted = random_affine(np.repeat(image, 50, 0), shift_px=2, rotate_deg=0, scale=0, draws=rng.random((50, 4)))
    assert shifted.shape == (50, 28, 28) and shifted.dtype == np.float32
    np.testing.assert_allclose(shifted.reshape(50, -1).sum(1), image.sum() / 255, rtol=1e-5)  # nothing lost
    offsets = {tuple(np.argwhere(s > 0)[0] - (10, 10)) for s in shifted}
    assert offsets <= {(dy, dx) for dy in range(-2, 3) for dx in range(-2, 3)}
    assert len(offsets) > 5  # really random, not a constant shift
    identity = random_affine(image, 0, 0, 0, rng.random((1, 4)))
    np.testing.assert_allclose(identity, image / 255, rtol=1e-6)


@pytest.mark.parametrize("choice", ["affine", "shifts", "crops", "flips"])
@pytest.mark.parametrize("shape", [(12, 28, 28), (6, 3, 20, 17)], ids=["gray", "rgb"])
def test_a_ray_data_tasks_augmentation_in_numpy_agrees_with_torchs(choice, shape):
    """`augment` (numpy: what a Ray Data task runs, no torch) against `augment_tensor` (torch: the split held by the
    training worker) on the same images and draws, with each choice's parameters and both fills: equal to float32
    rounding (under 2e-5), far below one grey level (1/255)."""
    import torch

    from dataset.tensors.augment import augment, augment_tensor, augmentation

    rng = np.random.default_rng(7)
    images = rng.integers(0, 256, shape, dtype=np.uint8)
    draws = rng.random((shape[0], 4))
    for source in ("idx", "folder"):  # black edges, repeated edges
        params = augmentation(TransformConfig(augment=choice, rotate_deg=20, scale=0.15), source)
        ours = augment(images, draws, **params)
        pixels = torch.from_numpy(images).float().div_(255.0)
        theirs = augment_tensor(pixels.unsqueeze(1) if images.ndim == 3 else pixels, draws, **params)
        theirs = (theirs.squeeze(1) if images.ndim == 3 else theirs).numpy()
        assert ours.dtype == np.float32 and ours.shape == images.shape
        assert np.abs(ours - theirs).max() < 2e-5, (choice, source, np.abs(ours - theirs).max())
        assert not np.allclose(ours, images / 255, atol=1e-3)  # it did move something


def test_a_ray_data_tasks_batch_preparation_imports_no_torch():
    """`prepare_batch` on an Arrow table of digits, augmented and normalized as a Ray Data task prepares a training
    batch, in a fresh interpreter: torch is never imported, so a Ray Data worker stays a light process (issue 67)."""
    import subprocess
    import sys

    code = (
        "import sys, numpy as np\n"
        "from dataset.formats.parquet import to_table\n"
        "from dataset.tensors.transform import prepare_batch\n"
        "from tests.support.digits import synthetic_digits\n"
        "images, labels = synthetic_digits(8)\n"
        "table = to_table(np.arange(8), images.reshape(8, -1), labels.astype(np.int64))\n"
        "augment = {'shift_px': 2, 'rotate_deg': 15, 'scale': 0.1, 'fill': 'zeros'}\n"
        "out = prepare_batch(table, 0.13, 0.31, augment=augment, seed=1)\n"
        "print(out['image'].shape, out['image'].dtype, 'torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parent.parent, capture_output=True,
                         text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "(8, 1, 28, 28) float32 False"


def test_rotation_and_zoom_change_the_digit_but_stay_in_range():
    image = np.zeros((8, 28, 28), dtype=np.uint8)
    image[:, 4:24, 13:15] = 255  # a vertical bar
    out = random_affine(image, shift_px=0, rotate_deg=30, scale=0.2, draws=np.random.default_rng(1).random((8, 4)))
    assert out.min() >= 0 and out.max() <= 1
    assert not np.allclose(out, image / 255, atol=0.1)
    mass = out.reshape(8, -1).sum(1) / (image[0].sum() / 255)
    assert ((mass > 0.6) & (mass < 1.5)).all()  # zoomed / rotated, not lost


def test_prepare_batch_from_arrow():
    images, labels = synthetic_digits(6)
    table = to_table(np.arange(100, 106), images.reshape(6, -1), labels.astype(np.int64))
    out = prepare_batch(table, 0.5, 0.5)
    assert out["image"].shape == (6, 1, 28, 28) and out["image"].dtype == np.float32
    np.testing.assert_array_equal(out["row_id"], np.arange(100, 106))
    np.testing.assert_array_equal(out["label"], labels)
    np.testing.assert_allclose(out["image"], normalize(images, 0.5, 0.5))
    augment = {"shift_px": 2, "rotate_deg": 10, "scale": 0.1}
    shifted = prepare_batch(table, 0.5, 0.5, augment=augment, seed=3)
    again = prepare_batch(table, 0.5, 0.5, augment=augment, seed=3)
    np.testing.assert_array_equal(shifted["image"], again["image"])  # reproducible per seed and epoch
    assert not np.array_equal(shifted["image"], out["image"])
    # A row's augmentation does not depend on the batch it lands in, only on (seed, epoch, row_id).
    split = [prepare_batch(table.slice(i, 1), 0.5, 0.5, augment=augment, seed=3)["image"] for i in range(6)]
    np.testing.assert_array_equal(np.concatenate(split), shifted["image"])
    next_epoch = prepare_batch(table, 0.5, 0.5, augment=augment, seed=3, epoch=1)
    assert not np.array_equal(next_epoch["image"], shifted["image"])


def test_epoch_seeds_and_draws_are_fixed_by_seed_epoch_and_row():
    seeds = {(seed, epoch): epoch_seed(seed, epoch) for seed in range(5) for epoch in range(50)}
    assert seeds[(3, 7)] == epoch_seed(3, 7) and len(set(seeds.values())) == len(seeds)
    assert all(0 <= value < 2**32 for value in seeds.values())
    rows = np.arange(10_000, dtype=np.int64)
    np.testing.assert_array_equal(row_draws(rows[5000:], 7, 2), row_draws(rows, 7, 2)[5000:])  # per row, not per call
    draws = row_draws(rows, 7, 2)
    assert draws.shape == (10_000, 4) and draws.min() >= 0 and draws.max() < 1
    np.testing.assert_allclose(draws.mean(0), 0.5, atol=0.02)  # uniform
    assert abs(np.corrcoef(draws[:, 0], draws[:, 1])[0, 1]) < 0.05  # the four streams are independent


@pytest.fixture(scope="module")
def spec_inputs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("transform")
    from storage_io import StorageLayout

    layout = StorageLayout.create(str(tmp / "storage"), "run")
    raw = RawData(**write_raw(tmp / "raw", n_train=200, n_test=50))
    dataset = to_parquet.fn(raw, ParquetConfig(rows_per_file=64, rows_per_group=64, validation_every=5), layout)
    return dataset, layout


def test_stage_runs_the_pipeline_and_records_checks(local_ray, spec_inputs, monkeypatch):
    """The stage checks every split in its own process, without Ray Data: a Ray Dataset run here fails the test
    (Ray Data's actors and task workers would outlive the stage, beside training: docs/performance.md)."""
    import ray.data

    def no_ray_data(*args, **kwargs):
        raise AssertionError("the transform stage ran a Ray Dataset")

    for method in ("iter_batches", "iter_torch_batches", "materialize", "to_arrow_refs"):
        monkeypatch.setattr(ray.data.Dataset, method, no_ray_data)
    dataset, layout = spec_inputs
    spec = transform.fn(dataset, TransformConfig(shift_px=0, rotate_deg=0, scale=0), layout)
    assert {k: v["rows"] for k, v in spec.checks.items()} == {"train": 160, "val": 40, "test": 50}
    assert Path(spec.manifest).is_file()
    # Uniform random pixels normalized to [-1, 1]: mean ~0, std ~0.577.
    assert abs(spec.checks["test"]["pixel_mean"]) < 0.05
    assert spec.checks["test"]["pixel_std"] == pytest.approx(1 / np.sqrt(3), abs=0.03)
    assert sum(spec.checks["train"]["label_counts"]) == 160


def test_checks_are_reused_for_the_same_dataset_and_config_and_run_again_otherwise(local_ray, spec_inputs, tmp_path):
    """The stage records its checks beside the Parquet files; a later run with the same verified
    dataset and config reuses them, another config or a record that does not match runs them."""
    from dataset.tensors.spec import checks_record_path
    from storage_io import StorageLayout

    dataset, layout = spec_inputs
    cfg = TransformConfig(shift_px=1, rotate_deg=5, scale=0.05)
    first = transform.fn(dataset, cfg, layout)
    record = Path(checks_record_path(first))
    assert record.parent == Path(dataset.directory) and json.loads(record.read_text())["checks"] == first.checks
    later = StorageLayout.create(layout.root, "later-run")
    again = transform.fn(dataset, cfg, later)
    assert again.skipped and not first.skipped and again.checks == first.checks
    assert json.loads(Path(again.manifest).read_text())["checks"] == first.checks  # the later run's transform.json
    other = transform.fn(dataset, cfg.model_copy(update={"shift_px": 2}), later)
    assert not other.skipped and Path(checks_record_path(other)) != record
    # A record that no longer matches the dataset (here: a row count) is not trusted: the checks run again.
    tampered = json.loads(record.read_text())
    tampered["checks"]["test"]["rows"] += 1
    record.write_text(json.dumps(tampered))
    rerun = transform.fn(dataset, cfg, later)
    assert not rerun.skipped and rerun.checks == first.checks
    assert json.loads(record.read_text())["checks"] == first.checks  # written again


def _run(ds) -> tuple[np.ndarray, np.ndarray]:
    batches = list(ds.iter_batches(batch_format="numpy", batch_size=32))
    return np.concatenate([b["row_id"] for b in batches]), np.concatenate([b["image"] for b in batches])


def test_training_split_order_and_augmentation_are_fixed_by_seed_and_epoch(local_ray, spec_inputs):
    dataset, layout = spec_inputs
    spec = transform.fn(dataset, TransformConfig(), layout)
    epoch0, again, epoch1, other_seed = (
        _run(build_split(spec, "train", seed, epoch)) for seed, epoch in [(0, 0), (0, 0), (0, 1), (1, 0)]
    )
    for order, _ in (epoch0, epoch1, other_seed):
        assert len(order) == 160 and sorted(order.tolist()) == sorted(epoch0[0].tolist())  # every row exactly once
    np.testing.assert_array_equal(again[0], epoch0[0])  # the same epoch built twice: same order ...
    np.testing.assert_array_equal(again[1], epoch0[1])  # ... and the same augmented pixels
    assert not np.array_equal(epoch0[0], epoch1[0]) and not np.array_equal(epoch0[0], other_seed[0])
    assert not np.array_equal(np.sort(epoch0[0]), epoch0[0])  # not file order
    # Resuming after 50 rows: the rest in the order they would have come, each augmented the same.
    rest = _run(build_split(spec, "train", 0, 0, exclude=epoch0[0][:50]))
    np.testing.assert_array_equal(rest[0], epoch0[0][50:])
    np.testing.assert_array_equal(rest[1], epoch0[1][50:])


def test_validation_split_is_not_augmented(local_ray, spec_inputs):
    dataset, layout = spec_inputs
    spec = transform.fn(dataset, TransformConfig(shift_px=3, rotate_deg=20), layout)
    val = build_datasets(spec, splits=("val",))["val"]
    batches = list(val.iter_batches(batch_format="numpy", batch_size=None))
    ids = np.concatenate([b["row_id"] for b in batches])
    images = np.concatenate([b["image"] for b in batches])
    raw_images, _ = synthetic_digits(200, seed=1)
    np.testing.assert_allclose(images, normalize(raw_images[ids], 0.5, 0.5))


def test_in_memory_and_streaming_reads_yield_the_same_rows(local_ray, spec_inputs):
    """A split within ``in_memory_mb`` of decoded pixels is read with pyarrow into blocks; a larger one streams
    in windows of row groups, with the same rows, and its own fixed order per (seed, epoch)."""
    dataset, layout = spec_inputs
    plain = {"shift_px": 0, "rotate_deg": 0, "scale": 0}
    # 0.05 MB windows: 66 rows of 784 bytes, so two 64-row groups a window (the training split has three groups)
    streamed = transform.fn(dataset, TransformConfig(in_memory_mb=0, window_mb=0.05, **plain), layout)
    in_memory = transform.fn(dataset, TransformConfig(block_rows=64, in_memory_mb=1, **plain), layout)  # 160 training rows: 3 blocks
    assert in_memory.checks == streamed.checks
    assert streamed.streamed == ("train", "val", "test") and in_memory.streamed == ()
    assert "train, val, test streamed in windows (over the 0 MB in-memory budget)" in streamed.terminal_detail()
    from ray.data.dataset import MaterializedDataset

    from dataset.tensors.transform import read_split

    blocks = read_split(in_memory, "train")
    assert isinstance(blocks, MaterializedDataset) and blocks.num_blocks() == 3
    assert not isinstance(read_split(streamed, "train"), MaterializedDataset)
    for split in ("val", "test"):  # unshuffled: the same rows in the same (file) order, the same pixels
        ids, images = _run(build_split(in_memory, split))
        np.testing.assert_array_equal(ids, _run(build_split(streamed, split))[0])
        np.testing.assert_array_equal(images, _run(build_split(streamed, split))[1])
        assert len(ids) == dataset.rows[split]
    first, again = _run(build_split(in_memory, "train", 2, 1)), _run(build_split(in_memory, "train", 2, 1))
    np.testing.assert_array_equal(first[0], again[0])  # several blocks: still one fixed order per (seed, epoch)
    window, window_again = _run(build_split(streamed, "train", 2, 1)), _run(build_split(streamed, "train", 2, 1))
    np.testing.assert_array_equal(window[0], window_again[0])
    np.testing.assert_array_equal(window[1], window_again[1])
    assert sorted(first[0].tolist()) == sorted(window[0].tolist()) and len(window[0]) == 160
    assert not np.array_equal(window[0], _run(build_split(streamed, "train", 2, 2))[0])  # another epoch, another order
    assert not np.array_equal(np.sort(window[0]), window[0])
    # Resumed after 70 rows (into the second window): the rest, in the order and with the pixels they would have had.
    rest = _run(build_split(streamed, "train", 2, 1, exclude=window[0][:70]))
    np.testing.assert_array_equal(rest[0], window[0][70:])
    np.testing.assert_array_equal(rest[1], window[1][70:])
    done = build_split(streamed, "train", 2, 1, exclude=window[0])  # resumed at the epoch's very end: nothing left
    assert sum(len(b["row_id"]) for b in done.iter_batches(batch_format="numpy", batch_size=32)) == 0
    # What the stage checks (`split_batches`): a split read here, whole when it fits in memory or window by window
    # when it streams, gives the rows, order and pixels Ray Data gives training for epoch 0, in batches of at most
    # the size asked, augmented training rows included.
    from dataset.tensors.read_ahead import split_batches

    augmented = transform.fn(dataset, TransformConfig(block_rows=64, in_memory_mb=1), layout)
    for spec in (streamed, in_memory, augmented):
        for split in ("train", "test"):
            batches = list(split_batches(spec, split, 50, seed=3))
            assert max(len(b["row_id"]) for b in batches) == 50
            here = np.concatenate([b["row_id"] for b in batches]), np.concatenate([b["image"] for b in batches])
            ray_data = _run(build_split(spec, split, seed=3))
            np.testing.assert_array_equal(here[0], ray_data[0])
            np.testing.assert_array_equal(here[1], ray_data[1])


def test_windows_bound_what_a_task_reads_and_keep_every_row_once():
    """`dataset.tensors.windows.plan`: windows of whole row groups up to the row budget; every row once; parts equal."""
    from dataset.tensors.windows import plan

    groups = [(f"part-{i}", 0) for i in range(10)]
    ids = [np.arange(i * 100, i * 100 + 100) for i in range(10)]
    shuffled = plan(groups, ids, window_rows=250, shuffle_seed=7)
    assert [len(w.groups) for w in shuffled] == [3, 3, 3, 1]  # 300 rows read at most by one task
    order = np.concatenate([np.concatenate([ids[int(g[0][5:])] for g in w.groups])[w.take] for w in shuffled])
    assert sorted(order.tolist()) == list(range(1000)) and not np.array_equal(order, np.arange(1000))
    group_of = order[:900] // 100  # within a window of three groups the rows are mixed: no long run from one group
    assert max(len(run) for run in np.split(group_of, np.flatnonzero(np.diff(group_of)) + 1)) < 20
    again = plan(groups, ids, 250, 7)
    assert all(a.groups == b.groups and np.array_equal(a.take, b.take) for a, b in zip(shuffled, again))
    parts = [plan(groups, ids, 250, 7, exclude=order[:3], part=(i, 2)) for i in range(2)]
    rows = [np.concatenate([np.concatenate([ids[int(g[0][5:])] for g in w.groups])[w.take] for w in p]) for p in parts]
    assert len(rows[0]) == len(rows[1]) == 498  # 997 rows left: equal steps, one row waits
    np.testing.assert_array_equal(np.stack(rows, 1).reshape(-1), order[3:999])
    in_order = plan(groups, ids, 250)  # validation: file order
    np.testing.assert_array_equal(np.concatenate([w.take for w in in_order[:1]]), np.arange(300))


def test_a_few_rows_are_read_from_their_row_groups_only(tmp_path):
    """`dataset.tensors.windows.read_rows` (the reports' pictures): rows by position or row_id, in the order asked, from
    the row groups that hold them; a row group no asked row is in is never read (here: unreadable)."""
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq

    from dataset.tensors.windows import read_rows

    paths = []
    for part in range(3):  # three files of two 10-row groups; row_id = 100 + position, pixel 0 = position % 256
        rows = np.arange(part * 20, part * 20 + 20)
        pixels = np.zeros((20, 4), np.uint8)
        pixels[:, 0] = rows % 256
        path = tmp_path / f"part-{part}.parquet"
        pq.write_table(to_table(rows + 100, pixels, rows % 10), path, row_group_size=10)
        paths.append(str(path))
    fs = pafs.LocalFileSystem()
    table = read_rows(fs, paths, positions=np.array([45, 3, 14, 59]))
    assert table.column("row_id").to_pylist() == [145, 103, 114, 159]
    assert [image[0] for image in table.column("image").to_pylist()] == [45, 3, 14, 59]
    assert read_rows(fs, paths, row_ids=[152, 100]).column("row_id").to_pylist() == [152, 100]
    with pytest.raises(IndexError):
        read_rows(fs, paths, positions=np.array([60]))
    with pytest.raises(KeyError) as missing:
        read_rows(fs, paths, row_ids=[99, 101, 7])
    assert missing.value.args[0] == [99, 7]
    # The images of the second file's second group (positions 30-39) damaged: rows elsewhere still read.
    data = bytearray(Path(paths[1]).read_bytes())
    meta = pq.ParquetFile(paths[1]).metadata.row_group(1).column(pq.read_schema(paths[1]).get_field_index("image"))
    start = meta.dictionary_page_offset or meta.data_page_offset
    data[start:start + 64] = b"\xff" * 64
    Path(paths[1]).write_bytes(bytes(data))
    assert read_rows(fs, paths, positions=np.array([25, 0, 59])).column("row_id").to_pylist() == [125, 100, 159]
    with pytest.raises(OSError):
        read_rows(fs, paths, positions=np.array([35]))


def test_a_split_without_parquet_files_is_named(local_ray, spec_inputs, tmp_path):
    dataset, _ = spec_inputs
    from dataset.tensors.spec import TransformSpec
    from dataset.tensors.transform import read_split

    empty = dataset.model_copy(update={"directory": str(tmp_path)})
    (tmp_path / "val").mkdir()
    spec = TransformSpec(dataset=empty, config=TransformConfig(), checks={}, manifest="")
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "val")):
        read_split(spec, "val")


def test_parts_split_an_epoch_between_workers_without_a_coordinator(local_ray, spec_inputs):
    """part=(i, n): every n-th row of the epoch's order, in memory or streamed; equal counts on the training split."""
    dataset, layout = spec_inputs
    spec = transform.fn(dataset, TransformConfig(block_rows=64), layout)
    whole = _run(build_split(spec, "train", 4, 2))[0]
    done = whole[:37]  # resumed after 37 rows: the parts split the 123 rows that are left
    parts = [_run(build_split(spec, "train", 4, 2, exclude=done, part=(i, 3)))[0] for i in range(3)]
    assert [len(p) for p in parts] == [41, 41, 41]
    np.testing.assert_array_equal(np.stack(parts, 1).reshape(-1), whole[37:])  # interleaved, in the epoch's order
    uneven = [len(_run(build_split(spec, "train", 4, 2, exclude=whole[:36], part=(i, 3)))[0]) for i in range(3)]
    assert uneven == [41, 41, 41]  # 124 rows left: equal steps for every rank, one row waits for the next epoch
    for streamed in (False, True):  # validation: disjoint parts that together hold every row
        cfg = TransformConfig(in_memory_mb=0 if streamed else 512, window_mb=0.05)
        val_spec = spec.model_copy(update={"config": cfg, "in_memory_mb": None})
        val = [_run(build_split(val_spec, "val", part=(i, 2)))[0] for i in range(2)]
        assert sorted(np.concatenate(val).tolist()) == sorted(_run(build_split(val_spec, "val"))[0].tolist())
        assert len(val[0]) and len(val[1]) and len(np.concatenate(val)) == dataset.rows["val"]
    # Streamed training rows (windows of two row groups): the same cut, each rank reading its own part.
    streamed_spec = spec.model_copy(update={"config": TransformConfig(in_memory_mb=0, window_mb=0.05), "in_memory_mb": None})
    whole = _run(build_split(streamed_spec, "train", 4, 2))[0]
    parts = [_run(build_split(streamed_spec, "train", 4, 2, exclude=whole[:37], part=(i, 3)))[0] for i in range(3)]
    assert [len(p) for p in parts] == [41, 41, 41]
    np.testing.assert_array_equal(np.stack(parts, 1).reshape(-1), whole[37:])


def test_one_actor_on_one_cpu_node_scores_here_with_the_pool_s_predictions(local_ray, spec_inputs, tmp_path):
    """One actor on one node without GPUs: the calling process scores (no actor process to start, import
    torch in and load the checkpoint into); the predictions are the actor pool's, row for row, TTA on and off."""
    import ray
    import torch

    from pipeline_config import EvaluateConfig
    from training import inference
    from training.checkpoint.model_files import save_checkpoint_files
    from training.model.catalog import ModelSpec

    dataset, layout = spec_inputs
    spec = transform.fn(dataset, TransformConfig(shift_px=0, rotate_deg=0, scale=0), layout)
    small = ModelSpec.for_data("training.model.catalog:small_cnn", dataset)
    model = small.build()
    save_checkpoint_files(tmp_path, model, torch.optim.AdamW(model.parameters()), {"epoch": 0})
    cluster = ray.cluster_resources()
    assert inference.scores_here(cluster, 1) and not inference.scores_here(cluster, 2)
    assert not inference.scores_here({**cluster, "GPU": 1.0}, 1)  # a GPU: its actors score on it
    before = torch.get_num_threads()
    for tta in (False, True):
        here = inference.predict(spec, str(tmp_path), EvaluateConfig(num_actors=1, batch_rows=16, tta=tta), small)
        pool = inference.predict(spec, str(tmp_path), EvaluateConfig(num_actors=2, batch_rows=16, tta=tta), small)
        assert len(here["row_id"]) == dataset.rows["test"] == 50
        for name in ("row_id", "label", "pred", "pred_plain"):
            np.testing.assert_array_equal(here[name], pool[name])
    assert torch.get_num_threads() == before  # this process's thread count is given back


def test_a_streamed_test_split_scored_here_is_read_here_with_the_same_predictions(local_ray, spec_inputs, tmp_path, monkeypatch):
    """A streamed test split scored in this process is read here, window by window, not through Ray Data
    (whose read-ahead limit kept its scheduling loop spinning beside the scoring): the predictions are
    those of the same split held in memory, row for row, TTA on."""
    import torch

    from pipeline_config import EvaluateConfig
    from training import inference
    from training.checkpoint.model_files import save_checkpoint_files
    from training.model.catalog import ModelSpec

    dataset, layout = spec_inputs
    spec = transform.fn(dataset, TransformConfig(shift_px=0, rotate_deg=0, scale=0), layout)
    small = ModelSpec.for_data("training.model.catalog:small_cnn", dataset)
    model = small.build()
    save_checkpoint_files(tmp_path, model, torch.optim.AdamW(model.parameters()), {"epoch": 0})
    cfg = EvaluateConfig(num_actors=1, batch_rows=16, tta=True)
    held = inference.predict(spec, str(tmp_path), cfg, small)
    streamed = spec.model_copy(update={"config": spec.config.model_copy(update={"in_memory_mb": 0, "window_mb": 0.05}),
                                       "in_memory_mb": None})
    assert not fits_in_memory(streamed, "test")

    def no_ray_data(*args, **kwargs):
        raise AssertionError("a streamed split scored here went through Ray Data")

    monkeypatch.setattr(inference, "build_datasets", no_ray_data)
    read_here = inference.predict(streamed, str(tmp_path), cfg, small)
    assert len(read_here["row_id"]) == dataset.rows["test"]
    for name in ("row_id", "label", "pred", "pred_plain"):
        np.testing.assert_array_equal(read_here[name], held[name])


def test_large_images_are_scored_in_bounded_forward_passes_with_the_same_predictions(tmp_path, monkeypatch):
    """On CPU a batch is scored in forward passes of at most `FORWARD_VALUES` input values, TTA's views one at a
    time (a 128x128 RGB batch with its views at once took 3 GB); the predictions are those of one pass."""
    import torch

    from training import inference
    from training.checkpoint.model_files import save_checkpoint_files
    from training.model.catalog import ModelSpec

    spec = ModelSpec(name="training.model.catalog:small_cnn", in_channels=3, num_classes=4)
    model = spec.build()
    save_checkpoint_files(tmp_path, model, torch.optim.AdamW(model.parameters()), {"epoch": 0})
    rng = np.random.default_rng(0)
    batch = {"image": rng.normal(size=(37, 3, 16, 16)).astype(np.float32), "label": np.arange(37) % 4, "row_id": np.arange(37)}
    whole = inference.Predictor(str(tmp_path), 1, True, spec.model_dump())(batch)
    seen = []
    monkeypatch.setattr(inference, "FORWARD_VALUES", 10 * 3 * 16 * 16)  # ten images a pass
    predictor = inference.Predictor(str(tmp_path), 1, True, spec.model_dump())
    inner = predictor.model
    predictor.model = lambda x: seen.append(len(x)) or inner(x)  # counts the passes, then runs them
    chunked = predictor(batch)
    assert max(seen) == 10 and len(seen) == 4 * len(inference.TTA_SHIFTS)  # 10 + 10 + 10 + 7 rows, five views each
    for name in ("row_id", "label", "pred", "pred_plain"):
        np.testing.assert_array_equal(chunked[name], whole[name])


def test_ray_data_s_scheduling_loop_pauses_while_its_consumer_has_output_waiting(local_ray, monkeypatch):
    """A consumer slower than its reader, behind a read-ahead limit (a training or scoring loop on a streamed
    split): after each step of Ray Data's scheduling loop that finds output waiting for the consumer, the next
    step comes `IDLE_STEP_PAUSE_S` later at the earliest. Without the pause (set to 0 for the contrast) the
    loop stepped again within a few milliseconds."""
    import time

    import pyarrow as pa
    from ray.data._internal.execution.execution_callback import ExecutionCallback

    from dataset.tensors import transform as transform_module

    def gaps_after_fed_steps() -> list[float]:
        steps: list[tuple[float, bool]] = []

        class Record(ExecutionCallback):  # runs before the pause, on the state the pause sees
            def on_execution_step(self, executor):
                steps.append((time.perf_counter(), not executor._consumer_idling()))

        ds = transform_module.blocks(pa.table({"blob": pa.array([b"\0" * 10_000] * 1000, pa.binary())}), 100)
        ds = ds.map_batches(lambda batch: batch, batch_format="pyarrow", num_cpus=0.25)
        ds.context.custom_execution_callback_classes = [Record, *ds.context.custom_execution_callback_classes]
        limits = ds.context.execution_options.resource_limits
        ds.context.execution_options.resource_limits = limits.copy(object_store_memory=3 << 20)  # 3 of its 10 MB
        rows = 0
        for batch in ds.iter_batches(batch_size=100, batch_format="pyarrow"):
            rows += batch.num_rows
            time.sleep(0.1)  # the consumer's work
        assert rows == 1000
        return [after[0] - before[0] for before, after in zip(steps, steps[1:]) if before[1]]

    pause = transform_module.IDLE_STEP_PAUSE_S
    paused = gaps_after_fed_steps()
    assert paused and min(paused) >= pause
    monkeypatch.setattr(transform_module, "IDLE_STEP_PAUSE_S", 0.0)
    unpaused = gaps_after_fed_steps()
    # What Ray Data does alone: the next step within a few milliseconds. How many more steps that makes
    # depends on the CPU (3x more on an AMD EPYC Zen 4; 1.1-2.4x on a Zen 3, whose slower tasks keep the
    # loop waiting on them), so the count is not asserted.
    assert unpaused and np.median(unpaused) < pause / 2, (len(paused), len(unpaused), np.median(unpaused))


def test_read_ahead_keeps_the_order_raises_where_reading_failed_and_stops_with_its_consumer():
    import threading

    from dataset.tensors.read_ahead import read_ahead

    batches = [{"row_id": np.arange(i, i + 2)} for i in range(0, 20, 2)]
    assert [b["row_id"].tolist() for b in read_ahead(iter(batches))] == [b["row_id"].tolist() for b in batches]

    def failing():
        yield batches[0]
        raise OSError("window 2: cannot read it")

    got = []
    with pytest.raises(OSError, match="window 2"):
        for batch in read_ahead(failing()):
            got.append(batch)
    assert len(got) == 1  # the batch before the failure came through first

    endless = ({"row_id": np.array([i])} for i in iter(int, 1))
    reader = read_ahead(endless, depth=1)
    next(reader)
    reader.close()  # the consumer stops early: the reading thread ends with it
    assert not any(t.name == "read-ahead" for t in threading.enumerate())
