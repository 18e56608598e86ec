"""The transform section of the configuration (normalization, augmentation, the images' size, Ray Data's batches) and
the rule that makes transform.image_size: auto concrete."""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import Field, field_validator

from pipeline_config.common import Section

# transform.image_size auto: images whose shorter side is under AUTO_MIN_SIDE pixels are enlarged to AUTO_IMAGE_SIZE.
# ResNet-18's stem (a stride-2 convolution, then a stride-2 pool) divides a side by 4: 8x8 digits leave 2x2 for its
# 3x3 convolutions, 16x16 pictures 4x4, 28x28 7x7, the size the default recipe was tuned on (docs/design.md,
# "Tiny images").
AUTO_MIN_SIDE = 16
AUTO_IMAGE_SIZE = 28


def auto_image_size(height: int, width: int) -> int | None:
    """What ``transform.image_size: auto`` resizes images of ``height`` x ``width`` pixels to: `AUTO_IMAGE_SIZE` when
    their shorter side is under `AUTO_MIN_SIDE`, else None (kept as they are)."""
    return AUTO_IMAGE_SIZE if min(height, width) < AUTO_MIN_SIDE else None


class TransformConfig(Section):
    """The Ray Data transform that feeds training and evaluation."""

    mean: float | list[float] | None = Field(
        None,
        description=(
            "Normalization mean on the 0..1 scale: one number for every channel, or one per channel. Unset: an image "
            "folder's training split's own per-channel mean (the transform stage measures it); MNIST's IDX sources keep "
            "the seeds' 0.5. The value used is recorded in the model card, so predict normalizes the same way."
        ),
    )
    std: float | list[float] | None = Field(
        None,
        description="Normalization standard deviation on the 0..1 scale, like mean (unset: measured, or the seeds' 0.5).",
    )
    augment: Literal["auto", "none", "shifts", "crops", "flips", "affine"] = Field(
        "auto",
        description=(
            "Training-time augmentation. none; shifts: moved by up to shift_px pixels; crops: zoomed in by up to scale "
            "and moved; flips: shifts plus a mirror image half the time (not for data whose left and right differ); "
            "affine: shifts, rotation by up to rotate_deg and zoom by up to scale (MNIST's). auto: affine for MNIST's "
            "IDX sources, shifts for an image folder. A folder's uncovered edges repeat the edge pixels; MNIST's are black."
        ),
    )
    shift_px: int = Field(
        2, ge=0, le=8, description="Augmentation (shifts, crops, flips, affine): random shift of up to this many pixels."
    )
    rotate_deg: float = Field(
        10.0, ge=0, le=45, description="Augmentation (affine): random rotation of up to this many degrees."
    )
    scale: float = Field(
        0.1, ge=0, le=0.5,
        description="Augmentation: random zoom by a factor in [1 - scale, 1 + scale] (affine) or [1, 1 + scale] (crops).",
    )
    image_size: Annotated[int, Field(ge=4, le=4096)] | Literal["auto"] | None = Field(
        "auto",
        description=(
            "download.source=folder or parquet: resize every image to image_size x image_size pixels when the conversion "
            "reads it (needed when the images differ in size). auto: images whose shorter side is under "
            f"{AUTO_MIN_SIDE} pixels are enlarged to {AUTO_IMAGE_SIZE}x{AUTO_IMAGE_SIZE} (at 8x8, ResNet-18's stem "
            "leaves 2x2 for its convolutions), larger ones kept as they are; the transform's line names the size "
            "chosen. None: images are kept as they are. Kept, by auto or None, they must all be one size."
        ),
    )
    batch_rows: int = Field(512, ge=1, le=65536, description="Rows per map_batches call.")
    in_memory_mb: int | None = Field(
        None,
        ge=0,
        description=(
            "A split whose decoded images (rows x channels x height x width bytes) take up to this many MB is read "
            "with pyarrow and handed to Ray Data as in-memory blocks (fast for small splits; its copies cost about "
            "20x the pixels in memory); a larger one streams in windows of row groups with memory that does not grow "
            "with the data. Unset: 1/256 of the memory Ray gives the smallest node (the run's log says the figure). "
            "0 always streams."
        ),
    )
    window_mb: float = Field(
        8,
        gt=0,
        le=4096,
        description=(
            "A streamed split is read and shuffled in windows of about this many MB of decoded images (at least one "
            "Parquet row group): the training shuffle permutes the row groups, then the rows within each window."
        ),
    )
    block_rows: int = Field(8192, ge=64, le=1_000_000, description="Rows per Ray Data block when a split is read in memory.")
    cpus_per_task: float = Field(
        0.25,
        gt=0,
        le=8,
        description=(
            "Logical CPUs each Ray Data task reserves. Must fit in the CPUs training leaves free "
            "(see train.data_cpus), or the data pipeline starves while training waits for it."
        ),
    )

    @field_validator("mean", "std")
    @classmethod
    def _check_normalization(cls, value, info):
        if value is None:
            return value
        values = value if isinstance(value, list) else [value]
        if not 1 <= len(values) <= 64:
            raise ValueError(f"transform.{info.field_name}: give one number, or one per channel (at most 64)")
        if not all(math.isfinite(v) and -10 <= v <= 10 for v in values):
            raise ValueError(f"transform.{info.field_name}: {value!r} must be finite numbers on the 0..1 scale")
        if info.field_name == "std" and min(values) <= 0:
            raise ValueError(f"transform.std: {value!r} must be above 0")
        return value

    def per_channel(self, channels: int) -> tuple[list[float], list[float]]:
        """(mean, std), one number per channel: the config's (a single number repeated), or the seeds' 0.5 when unset."""

        def spread(value, name: str) -> list[float]:
            values = [0.5] if value is None else value if isinstance(value, list) else [value]
            if len(values) == 1:
                return [float(values[0])] * channels
            if len(values) != channels:
                raise ValueError(f"transform.{name} has {len(values)} values; the images have {channels} channels")
            return [float(v) for v in values]

        return spread(self.mean, "mean"), spread(self.std, "std")
