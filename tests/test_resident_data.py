"""A split held on the device (`dataset.tensors.resident`) yields what Ray Data yields (`dataset.tensors.transform.build_split`).

Real Parquet datasets on a real local Ray: the synthetic MNIST digits (IDX: ``affine`` augmentation, black
edges) and the tests' image folder (20x20 RGB, per-channel statistics: ``shifts``, ``flips``, ``crops`` with
the border repeated). For each epoch the resident rows, concatenated, are the Ray Data rows concatenated: the
same row_ids in the same order, the same labels and bit-equal images (on the CPU; `dataset.tensors.resident` says why
a GPU's augmented pixels round differently). Chunks smaller than the split make the two paths batch the rows
differently, which changes nothing: each row's draws come from its row_id.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dataset.sources.interface import RawData
from dataset.tensors.resident import ResidentSplit, fits_on_device, resident_bytes
from dataset.tensors.transform import build_split, epoch_positions
from pipeline_config import DownloadConfig, ParquetConfig, TransformConfig
from tasks.download import download
from tasks.to_parquet import to_parquet
from tasks.transform import transform
from tests.support.digits import write_raw
from tests.support.images import write_image_folder

CPU = torch.device("cpu")
# How far numpy's augmentation (a Ray Data task's) and torch's (the resident split's) may be apart after normalization:
# float32 rounding of the same bilinear blend (3.5e-6 on the 0..1 scale measured, divided by a std of about 0.3);
# one grey level is 3.9e-3 before normalization.
AUGMENTED_ATOL = 5e-5
PARQUET = ParquetConfig(rows_per_file=64, rows_per_group=64, validation_every=5)


@pytest.fixture(scope="module")
def datasets(tmp_path_factory, local_ray):
    """(MNIST-style IDX dataset, image-folder dataset, layout): converted to Parquet once for the module."""
    from storage_io import StorageLayout

    tmp = tmp_path_factory.mktemp("resident")
    layout = StorageLayout.create(str(tmp / "storage"), "run")
    digits = to_parquet.fn(RawData(**write_raw(tmp / "raw", n_train=200, n_test=20)), PARQUET, layout)
    root = write_image_folder(tmp / "images", {"train": 20, "test": 2})
    pictures = to_parquet.fn(download.fn(DownloadConfig(source="folder", path=str(root)), layout), PARQUET, layout)
    return digits, pictures, layout


def _concat(batches) -> dict[str, torch.Tensor]:
    batches = list(batches)
    return {name: torch.cat([b[name] for b in batches]) for name in ("image", "label", "row_id")}


def _assert_same(resident: dict[str, torch.Tensor], ray_data: dict[str, torch.Tensor], augmented: bool) -> None:
    assert resident["image"].dtype == ray_data["image"].dtype == torch.float32
    assert resident["image"].shape == ray_data["image"].shape
    assert torch.equal(resident["row_id"], ray_data["row_id"])  # the same rows, in the same order
    assert torch.equal(resident["label"], ray_data["label"])
    apart = (resident["image"] - ray_data["image"]).abs().max()
    if augmented:
        assert torch.allclose(resident["image"], ray_data["image"], rtol=0, atol=AUGMENTED_ATOL), apart
    else:
        assert torch.equal(resident["image"], ray_data["image"]), apart


def _compare(spec, split: str, held: ResidentSplit, seed: int = 0, epoch: int = 0, exclude=None, part=None,
             chunk_rows: int = 50) -> int:
    """Resident rows (chunks of ``chunk_rows``, in whole batches of 16) against Ray Data's; the rows compared."""
    ray_data = _concat(build_split(spec, split, seed, epoch, exclude, part).iter_torch_batches(batch_size=32, device="cpu"))
    rows = held.rows(seed, epoch, exclude, part)
    chunks = list(rows.iter_torch_batches(batch_size=16, device=CPU, pin_memory=False, chunk_rows=chunk_rows))
    assert all(len(c["label"]) == 16 * max(1, chunk_rows // 16) for c in chunks[:-1])  # whole batches of 16, but the last
    resident = _concat(chunks)
    _assert_same(resident, ray_data, augmented=split == "train" and spec.config.augment != "none")
    assert len(rows) == rows.count() == len(resident["label"])
    return len(resident["label"])


def test_training_epochs_of_digits_match_ray_data(datasets):
    digits, _, layout = datasets
    spec = transform.fn(digits, TransformConfig(), layout)  # augment auto: affine, black edges
    held = ResidentSplit.load(spec, "train", CPU)
    assert held.pixels.dtype == torch.uint8 and tuple(held.pixels.shape) == (160, 1, 28, 28) and len(held) == 160
    for seed, epoch in [(0, 0), (0, 1), (1, 0), (1, 1)]:
        assert _compare(spec, "train", held, seed, epoch) == 160
    first = _concat(held.rows(0, 0).iter_torch_batches())
    assert not torch.equal(first["row_id"], torch.sort(first["row_id"]).values)  # shuffled
    other_epoch = _concat(held.rows(0, 1).iter_torch_batches())["row_id"]
    assert not torch.equal(first["row_id"], other_epoch)  # another epoch, another order
    # Resumed after 50 rows, one of three workers' part: what Ray Data gives that worker, and equal counts per part.
    done = first["row_id"][:50].numpy()
    counts = {_compare(spec, "train", held, 0, 0, exclude=done, part=(i, 3)) for i in range(3)}
    assert counts == {36}  # 110 rows left: 36 each, 2 left out
    everything = first["row_id"].numpy()  # resumed at the epoch's very end: nothing left, on either path
    assert list(held.rows(0, 0, exclude=everything).iter_torch_batches(batch_size=16)) == []
    nothing = build_split(spec, "train", 0, 0, exclude=everything).iter_torch_batches(batch_size=32)
    assert sum(len(b["label"]) for b in nothing) == 0


def test_validation_split_is_normalized_only(datasets):
    digits, _, layout = datasets
    spec = transform.fn(digits, TransformConfig(shift_px=3, rotate_deg=20), layout)
    held = ResidentSplit.load(spec, "val", CPU)
    assert _compare(spec, "val", held) == 40
    assert _compare(spec, "val", held, part=(1, 3)) == 13  # not the training split: not cut to equal counts
    assert _compare(spec, "val", held, exclude=np.array([1, 2, 3, 10_000]), part=(0, 2)) > 0


@pytest.mark.parametrize("choice", ["shifts", "flips", "crops"])
def test_an_image_folder_s_augmentations_match_ray_data(datasets, choice):
    _, pictures, layout = datasets
    spec = transform.fn(pictures, TransformConfig(augment=choice, shift_px=2), layout)  # per-channel mean/std, border fill
    held = ResidentSplit.load(spec, "train", CPU)
    assert tuple(held.pixels.shape) == (48, 3, 20, 20)
    for seed, epoch in [(0, 0), (0, 1)]:
        assert _compare(spec, "train", held, seed, epoch, chunk_rows=20) == 48
    assert _compare(spec, "train", held, 1, 1, exclude=np.array([0, 5, 7]), part=(1, 3), chunk_rows=20) == 15


def test_epoch_positions_are_the_in_memory_order(datasets):
    """The shared index function: a permutation per (seed, epoch) on training, file order otherwise."""
    ids = np.arange(100, 130)
    assert np.array_equal(epoch_positions(ids, False, 0, 0), np.arange(30))
    shuffled = epoch_positions(ids, True, 3, 1)
    assert sorted(shuffled.tolist()) == list(range(30)) and not np.array_equal(shuffled, np.arange(30))
    rest = epoch_positions(ids, True, 3, 1, exclude=ids[shuffled[:4]])
    assert np.array_equal(rest, shuffled[4:])
    assert np.array_equal(epoch_positions(ids, True, 3, 1, exclude=ids[shuffled[:4]], part=(2, 4)), shuffled[4:][2:24:4])
    assert np.array_equal(epoch_positions(ids, False, 0, 0, part=(2, 4)), np.arange(2, 30, 4))


def test_what_fits_on_the_device(datasets):
    digits, _, layout = datasets
    spec = transform.fn(digits, TransformConfig(), layout)
    assert fits_on_device(spec, "train", CPU) and fits_on_device(spec, "train", "cpu", share=0.0)  # CPU: the memory budget alone
    assert resident_bytes(spec, "train") == 160 * 784 * 5  # uint8 pixels and an epoch of float32 images
    streamed = transform.fn(digits, TransformConfig(in_memory_mb=0, window_mb=0.05), layout)
    assert not fits_on_device(streamed, "train", CPU)
    with pytest.raises(ValueError, match="split 'train'.*streams in windows"):
        ResidentSplit.load(streamed, "train", CPU)


def test_a_training_worker_holds_the_splits_when_they_fit_unless_asked_not_to(datasets):
    """``train.resident_data``: auto holds both splits wherever they fit (a CPU worker's memory too), off never;
    a split that streams is never held."""
    from training.worker.sharding import holds_on_device

    digits, _, layout = datasets
    spec = transform.fn(digits, TransformConfig(), layout)
    assert holds_on_device("auto", spec, CPU) and not holds_on_device("off", spec, CPU)
    streamed = transform.fn(digits, TransformConfig(in_memory_mb=0, window_mb=0.05), layout)
    assert not holds_on_device("auto", streamed, CPU)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_rows_match_and_pixels_agree_closely(datasets):
    digits, _, layout = datasets
    spec = transform.fn(digits, TransformConfig(), layout)
    cuda = torch.device("cuda")
    assert fits_on_device(spec, "train", cuda)
    held = ResidentSplit.load(spec, "train", cuda)
    for split, holder in (("train", held), ("val", ResidentSplit.load(spec, "val", cuda))):
        ray_data = _concat(build_split(spec, split, 0, 1).iter_torch_batches(batch_size=32, device="cpu"))
        chunks = list(holder.rows(0, 1).iter_torch_batches(batch_size=16, device=cuda))
        assert all(c["image"].device.type == "cuda" for c in chunks)
        resident = {name: tensor.cpu() for name, tensor in _concat(chunks).items()}
        assert torch.equal(resident["row_id"], ray_data["row_id"]) and torch.equal(resident["label"], ray_data["label"])
        if split == "val":  # normalization alone: the same float32 arithmetic on the device
            assert torch.equal(resident["image"], ray_data["image"])
        else:  # affine_grid and grid_sample round differently on a GPU: measured at most 1.6e-5 (H200, rotation and zoom)
            assert (resident["image"] - ray_data["image"]).abs().max() <= 1e-4
