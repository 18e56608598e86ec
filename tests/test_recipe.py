"""The recipe's parts that fit the data: the plan sized in steps, the augmentation choices, normalization.

How well the recipe trains is measured by `benchmarks.speed.recipe` (docs/performance.md) and, through
the whole flow at a short budget, by `test_image_folder.py::test_the_extending_guide_runs_as_written`.
"""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest

from dataset.formats.parquet import ParquetDataset, to_table
from dataset.tensors.augment import augment, augmentation, resolve_augment
from dataset.tensors.batches import normalize
from dataset.tensors.normalization import channel_stats, resolve
from pipeline_config import TrainConfig, TransformConfig
from training.worker.recipe import LR_FLOOR, WARMUP_MAX_STEPS, plan_for


def test_a_short_run_gets_a_short_warm_up_and_a_weight_average_that_forgets_its_start():
    short = plan_for(TrainConfig(), 150)
    assert short.warmup_steps == 30  # a fifth of the run
    assert short.ema_decay == pytest.approx(1 - 1 / 15)  # the average spans about a tenth of the run, not 100 steps
    assert short.lr(0) == pytest.approx(3e-3 * LR_FLOOR) and short.lr(30) == pytest.approx(3e-3)
    assert short.lr(150) == pytest.approx(3e-3 * LR_FLOOR)  # cosine down to a tenth of the peak
    long = plan_for(TrainConfig(), 20_000)
    assert long.warmup_steps == WARMUP_MAX_STEPS and long.ema_decay == 0.99  # capped: train.ema_decay
    assert plan_for(TrainConfig(ema_decay=0), 150).ema_decay == 0  # off stays off


def test_auto_augmentation_keeps_mnist_and_gives_a_folder_shifts_with_repeated_edges():
    cfg = TransformConfig()
    assert resolve_augment("auto", "idx") == "affine" and resolve_augment("auto", "folder") == "shifts"
    assert augmentation(cfg, "idx") == {"shift_px": 2, "rotate_deg": 10.0, "scale": 0.1, "fill": "zeros"}
    assert augmentation(cfg, "folder") == {"shift_px": 2, "fill": "border"}
    assert augmentation(TransformConfig(augment="none"), "folder") is None
    # A grey picture moved by up to two pixels keeps its grey edge: no black border a test image never has.
    grey = np.full((8, 3, 16, 16), 128, np.uint8)
    moved = augment(grey, np.random.default_rng(0).random((8, 4)), **augmentation(cfg, "folder"))
    assert np.allclose(moved, 128 / 255)
    black_edges = augment(grey, np.full((8, 4), 0.99), shift_px=2, fill="zeros")
    assert (black_edges == 0).any()


def test_flips_mirror_half_the_rows_and_crops_only_zoom_in():
    image = np.zeros((2, 1, 8, 8), np.uint8)
    image[:, 0, :, 0] = 255  # a bright left column
    draws = np.array([[0.2, 0.5, 0.5, 0.5], [0.8, 0.5, 0.5, 0.5]])  # shift 0; the first row flips
    out = augment(image, draws, flip=True, fill="border")
    assert (out[0, 0, :, -1] == 1).all() and (out[0, 0, :, 0] == 0).all()  # mirrored
    assert (out[1, 0, :, 0] == 1).all()  # kept
    dot = np.zeros((1, 1, 16, 16), np.uint8)
    dot[0, 0, 6:10, 6:10] = 255
    zoomed = augment(dot, np.array([[0.5, 0.0, 0.5, 0.5]]), zoom_in=0.5)  # the smallest draw: no zoom
    assert np.isclose(zoomed.sum(), 16.0, atol=0.5)
    assert augment(dot, np.array([[0.5, 0.999, 0.5, 0.5]]), zoom_in=0.5).sum() > 16 * 1.5**2 * 0.8  # bigger, not smaller


def test_a_folder_is_normalized_by_its_own_training_statistics_and_mnist_keeps_the_seeds(tmp_path):
    rng = np.random.default_rng(0)
    images = np.stack([rng.integers(50, 100, (4, 4)), rng.integers(0, 256, (4, 4)), np.full((4, 4), 200)], -1)
    images = np.repeat(images[None], 6, 0).astype(np.uint8)  # 6 images, 4x4, 3 channels (height x width x channels)
    (tmp_path / "train").mkdir()
    pq.write_table(to_table(np.arange(6), images, np.zeros(6, np.int64)), tmp_path / "train" / "part-0.parquet", row_group_size=2)
    folder = ParquetDataset(directory=str(tmp_path), fingerprint="x", rows={"train": 6}, image_shape=(3, 4, 4),
                            classes=["a", "b"], source="folder")
    mean, std = channel_stats(folder)
    expected = images.reshape(-1, 3) / 255.0
    assert mean == pytest.approx(expected.mean(0), abs=1e-5) and std[:2] == pytest.approx(expected.std(0)[:2], abs=1e-5)
    assert std[2] == 1e-3  # a constant channel is not divided by zero
    resolved = resolve(TransformConfig(), folder)
    assert resolved.mean == mean and resolved.std == std and resolved.augment == "shifts"
    assert resolve(TransformConfig(std=0.25), folder).std == [0.25] * 3  # what the config sets wins
    idx = folder.model_copy(update={"source": "idx", "image_shape": (1, 4, 4)})
    assert resolve(TransformConfig(), idx).model_dump(include={"mean", "std", "augment"}) == {
        "mean": [0.5], "std": [0.5], "augment": "affine"}
    out = normalize(images.transpose(0, 3, 1, 2), mean, std, (3, 4, 4))
    assert np.allclose(out.mean(axis=(0, 2, 3))[:2], 0, atol=1e-4)  # each measured channel centred


def test_per_channel_mean_and_std_are_checked():
    assert TransformConfig(mean=[0.1, 0.2, 0.3]).per_channel(3)[0] == [0.1, 0.2, 0.3]
    with pytest.raises(ValueError, match="transform.mean has 2 values; the images have 3 channels"):
        TransformConfig(mean=[0.1, 0.2]).per_channel(3)
    with pytest.raises(ValueError, match="transform.std"):
        TransformConfig(std=[0.5, 0.0])


def test_the_cli_refuses_a_mean_with_the_wrong_number_of_channels_before_any_work(tmp_path, capsys):
    """MNIST's digits have one channel: three means cannot fit them, said before Ray starts or anything is written."""
    import ray

    from flows import mnist

    storage = tmp_path / "storage"
    code = mnist.main(["--storage-root", str(storage), "--model.name", "training.model.catalog:small_cnn",
                       "--transform.mean", "[0.1, 0.2, 0.3]"])
    stderr = capsys.readouterr().err
    assert code == 2, stderr
    assert "transform.mean has 3 values; the images have 1 channels" in stderr
    assert not ray.is_initialized() and not storage.exists()
