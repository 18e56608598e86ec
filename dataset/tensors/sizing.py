"""``transform.image_size: auto`` made concrete for a run's data: the size its images are converted to.

`pipeline_config.transform.auto_image_size` is the rule (images whose shorter side is under
``AUTO_MIN_SIDE`` pixels are enlarged to ``AUTO_IMAGE_SIZE``, larger ones kept); this module reads what
the rule needs, the images' own size, from the run's source (`dataset.sources.interface.Source`): a local
folder's from its images' headers (the listing cache the checks before any work filled), MNIST's
IDX digits are never resized, and an ``s3://`` folder's size is known only once converted (auto keeps
it). The configuration keeps ``auto`` (runs record it, the model card too: predict then reads images at
the model's size); what reads or checks the data asks here for the size it means.
"""

from __future__ import annotations

from dataset.sources.interface import DataToCome, Source, source_for
from pipeline_config import PipelineConfig, TransformConfig
from pipeline_config.transform import auto_image_size


def checked_size(transform: TransformConfig) -> int | None:
    """The size the checks before any work read the images at: ``auto``'s choice needs their own size first (None)."""
    return None if transform.image_size == "auto" else transform.image_size


def own_size(source: Source, storage_root: str | None, checked: DataToCome | None = None) -> tuple[int, int] | None:
    """(height, width) of the source's images as they are, or None when not known before the conversion (an
    ``s3://`` folder) or never resized (MNIST's IDX digits). ``checked``: what the source's check before any work
    found at their own size (`dataset.sources.interface.check_data`), so nothing is listed again."""
    if not source.resizable:
        return None
    shape = (checked or source.check(None, storage_root, decode=False)).shape
    if shape[1] is None or shape[2] is None:
        return None
    return int(shape[1]), int(shape[2])


def image_size_for(
    source: Source, image_size: int | str | None, storage_root: str | None, checked: DataToCome | None = None,
    own: tuple[int, int] | None = None,
) -> int | None:
    """``image_size`` (``transform.image_size``) for this source's images: ``auto`` made concrete (`auto_image_size`).
    ``own``: their `own_size`, when the caller read it already."""
    if image_size != "auto":
        return image_size
    size = own if own is not None else own_size(source, storage_root, checked)
    return auto_image_size(*size) if size is not None else None


def resolved(config: PipelineConfig, checked: DataToCome | None = None) -> PipelineConfig:
    """``config`` with ``transform.image_size`` concrete for its data (`image_size_for`), for the checks that read the
    data at that size before any work (the model's trial, the champion's shape)."""
    if config.transform.image_size != "auto":
        return config
    size = image_size_for(source_for(config.download), "auto", config.storage_root, checked)
    return config.model_copy(update={"transform": config.transform.model_copy(update={"image_size": size})})
