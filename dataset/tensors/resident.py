"""A split held on the training device: its pixels read once per training attempt, each epoch's batches made there.

On a GPU the host sets the pace of the Ray Data path (`dataset.tensors.transform.build_split`): Python and Ray Data
tasks reshape, augment and normalize every row on the CPU, and the batches are then copied to the device.
A split that fits in memory (`dataset.tensors.transform.split_table`) is small next to a GPU's memory, so here its
uint8 pixels, labels and row_ids are copied to the device once (`ResidentSplit.load`), and each epoch
(`ResidentSplit.rows`) gathers, augments (`dataset.tensors.augment.augment_tensor`) and normalizes its rows there
with torch, a chunk of rows at a time.

What comes out is what `build_split` yields for the same (spec, split, seed, epoch, exclude, part): the same
rows in the same order (one shared `dataset.tensors.transform.epoch_positions`, on the host with numpy), each row's
augmentation drawn from the same (seed, epoch, row_id) (`dataset.tensors.batches.row_draws`) with the same choice
(`dataset.tensors.augment.augmentation`), and the same float32 normalization (`dataset.tensors.batches.normalize`). Rows that
are not augmented are equal; augmented ones agree to float32 rounding, because Ray Data's tasks blend the
pixels with numpy and this module with torch (`dataset.tensors.augment`; under 5e-5 after normalization on the CPU).
On a GPU torch's ``affine_grid``/``grid_sample`` also round differently from the CPU's where rows are rotated
or zoomed (at most 1.6e-5 after normalization against the CPU's torch, H200; whole-pixel shifts, flips and
unaugmented rows came out equal), while normalization does not: division by a device tensor, not
by a Python number, which CUDA computes as a multiplication by its reciprocal. Measured on one H200: an
epoch of 60,000 28x28 digits with ``affine`` in 16 ms, against about 1.7 s for the host's numpy path on
one thread (the Ray Data task's share of a CPU).
"""

from __future__ import annotations

import numpy as np
import torch

from dataset.formats.parquet import images_from_column
from dataset.tensors.augment import augment_tensor
from dataset.tensors.batches import row_draws
from dataset.tensors.spec import TransformSpec, fits_in_memory, split_mb
from dataset.tensors.transform import epoch_positions, prepare_kwargs, split_table

# Rows prepared at a time: 8,192 MNIST digits make 26 MB of float32 images, 64x64 RGB pictures 400 MB. A chunk
# is gathered, augmented and normalized in one go and handed out whole (the training loop cuts it into steps).
CHUNK_ROWS = 8192


def resident_bytes(spec: TransformSpec, split: str) -> int:
    """Device memory holding ``split`` costs: its uint8 pixels plus one epoch of float32 images (the bound a
    caller plans for; a chunk at a time is what is held while an epoch is prepared)."""
    pixels = spec.dataset.rows.get(split, 0) * int(np.prod(spec.dataset.image_shape))
    return pixels + 4 * pixels


def fits_on_device(spec: TransformSpec, split: str, device: torch.device | str, share: float = 0.25) -> bool:
    """Whether ``split`` can be held on ``device``: it fits in memory (`fits_in_memory`, else it streams and
    is never read whole) and, on CUDA, `resident_bytes` are at most ``share`` of the device's free memory
    (the rest is the model's, its optimizer's and its activations'). On the CPU the memory budget alone."""
    if not fits_in_memory(spec, split):
        return False
    device = torch.device(device)
    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(device)
    return resident_bytes(spec, split) <= share * free


class ResidentSplit:
    """One split's uint8 pixels (N, C, H, W), labels and row_ids as tensors on a device, in file order, with
    the row_ids on the host too (each epoch's order is computed there, with numpy)."""

    def __init__(self, spec: TransformSpec, split: str, pixels: torch.Tensor, labels: torch.Tensor, row_ids: torch.Tensor,
                 host_row_ids: np.ndarray):
        self.spec, self.split = spec, split
        self.pixels, self.labels, self.row_ids = pixels, labels, row_ids
        self.host_row_ids = host_row_ids
        self.device = pixels.device

    @classmethod
    def load(cls, spec: TransformSpec, split: str, device: torch.device | str) -> ResidentSplit:
        """``split`` read once (`split_table`) and copied to ``device``. A split over the in-memory budget
        (one that streams in windows) is refused with a ValueError naming it: it is never read whole."""
        table = split_table(spec, split)
        if table is None:
            raise ValueError(
                f"split {split!r}: {split_mb(spec, split):,.1f} MB of decoded pixels, over the in-memory budget of "
                f"{spec.budget_mb():,} MB (transform.in_memory_mb): it streams in windows and cannot be held on the device"
            )
        device = torch.device(device)
        channels, height, width = spec.dataset.image_shape
        stored = images_from_column(table.column("image")).reshape(-1, height, width, channels)  # as stored: H x W x C
        # To the device as stored, then to (N, C, H, W) there: no transposed copy of the split on the host.
        pixels = torch.from_numpy(np.ascontiguousarray(stored)).to(device).permute(0, 3, 1, 2).contiguous()
        host_row_ids = table.column("row_id").to_numpy().astype(np.int64)
        labels = torch.from_numpy(table.column("label").to_numpy().astype(np.int64)).to(device)
        return cls(spec, split, pixels, labels, torch.from_numpy(host_row_ids).to(device), host_row_ids)

    def __len__(self) -> int:
        return len(self.host_row_ids)

    def rows(self, seed: int = 0, epoch: int = 0, exclude: np.ndarray | None = None,
             part: tuple[int, int] | None = None) -> ResidentRows:
        """One epoch's rows, as `build_split(spec, split, seed, epoch, exclude, part)` yields them (training:
        shuffled and augmented by (seed, epoch)); the order is computed here, the batches as they are taken."""
        augment = self.split == "train"
        positions = epoch_positions(self.host_row_ids, augment, seed, epoch, exclude, part)
        return ResidentRows(self, positions, prepare_kwargs(self.spec, augment, seed, epoch))


class ResidentRows:
    """One epoch of a `ResidentSplit`: what the training loop iterates where it would take a Ray Dataset shard."""

    def __init__(self, split: ResidentSplit, positions: np.ndarray, prepare: dict):
        self.split, self.positions = split, positions
        self.augment, self.seed, self.epoch = prepare["augment"], prepare["seed"], prepare["epoch"]
        channels = split.pixels.shape[1]
        per_channel = (channels, 1, 1)  # as `normalize`: float32 per channel, broadcast over rows, height and width
        self.mean, self.std = (
            torch.from_numpy(np.broadcast_to(np.asarray(prepare[name], np.float32).reshape(-1, 1, 1), per_channel).copy())
            .to(split.device) for name in ("mean", "std")
        )
        self.scale = torch.tensor(255.0, dtype=torch.float32, device=split.device)

    def __len__(self) -> int:
        return len(self.positions)

    def count(self) -> int:
        """Rows in the epoch (a Ray Dataset's ``count``)."""
        return len(self.positions)

    def iter_torch_batches(self, batch_size: int | None = None, device: torch.device | str | None = None,
                           pin_memory: bool = False, chunk_rows: int = CHUNK_ROWS, **ignored):
        """The epoch's rows as dicts {"image": float32 (n, C, H, W), "label": int64 (n,), "row_id": int64 (n,)} on
        the split's device (``device``, when given, moves them; ``pin_memory`` and Ray Data's other arguments
        are ignored: nothing is copied from the host).

        Chunks of ``chunk_rows`` rows, rounded down to whole ``batch_size`` batches when one is given (at least
        one), so every chunk but the epoch's last is a whole number of the caller's batches, as Ray Data's are.
        """
        rows = chunk_rows if not batch_size else batch_size * max(1, chunk_rows // batch_size)
        for start in range(0, len(self.positions), rows):
            chunk = self._prepare(self.positions[start:start + rows])
            yield chunk if device is None else {name: tensor.to(device) for name, tensor in chunk.items()}

    def _prepare(self, positions: np.ndarray) -> dict[str, torch.Tensor]:
        """The rows at ``positions``: gathered, augmented (training) and normalized on the split's device, with
        `dataset.tensors.batches.prepare_batch`'s float32 arithmetic."""
        split = self.split
        index = torch.from_numpy(positions.astype(np.int64)).to(split.device)
        # uint8 -> float32 / 255: a device tensor as divisor, so CUDA divides (a Python number is multiplied by its reciprocal).
        images = split.pixels.index_select(0, index).float().div_(self.scale)
        if self.augment:
            images = augment_tensor(images, row_draws(split.host_row_ids[positions], self.seed, self.epoch), **self.augment)
        return {
            "image": (images - self.mean) / self.std,
            "label": split.labels.index_select(0, index),
            "row_id": split.row_ids.index_select(0, index),
        }
