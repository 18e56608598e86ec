"""Stage 2: convert the run's data into Parquet splits that Ray Data reads in parallel.

The layout, the manifest and the IDX conversion are in `dataset.parquet`; each source's fingerprint and
conversion in its module (`dataset.source.source_of`). This stage names the build by a fingerprint of its
inputs and settings, takes the dataset's build lock (a concurrent run building the same dataset waits,
then reuses it), skips a build whose manifest verifies, and otherwise converts into a staging folder that
is published whole.
"""

from __future__ import annotations

from prefect import task

from dataset.memory import release_memory
from dataset.parquet import ParquetDataset, manifest_data, manifest_problem
from dataset.source import Source, source_of
from dataset.sources import RawData
from pipeline_config import DEFAULT_WORKLOAD, ParquetConfig
from reporting.logs import stage_logger
from storage_io import MANIFEST, StorageLayout, exists, file_lock, join, parent, read_json, storage_writes


def dataset_fingerprint(raw: RawData, cfg: ParquetConfig, image_size: int | None = None) -> str:
    """Content key of a conversion: input checksums plus every setting that changes the output (the source's)."""
    return source_of(raw).fingerprint(raw, cfg, image_size)


@task(name="to-parquet")
def to_parquet(
    raw: RawData, cfg: ParquetConfig, layout: StorageLayout, image_size: int | None = None, workload: str = DEFAULT_WORKLOAD,
    max_image_pixels: int | None = None,
) -> ParquetDataset:
    """Convert the downloaded data to train/val/test Parquet (skipped when a verified build exists).

    ``image_size``: ``transform.image_size``, the square size a user's images are resized to.
    ``workload``: names the dataset folder, ``datasets/<workload>-<fingerprint>``.
    ``max_image_pixels``: ``download.max_image_pixels``, checked again as a user's images are read
    (None: not again; a local folder's images were checked before any work).

    A stored dataset that fails its check (a file missing, truncated or modified) is rebuilt, and the
    stage's terminal line says so, naming the file."""
    logger = stage_logger(__name__)
    source = source_of(raw)
    fingerprint = source.fingerprint(raw, cfg, image_size)
    final = layout.dataset_dir(fingerprint, workload)
    passed_over = source.conversion_notes(raw)
    # A concurrent run building it: wait, then reuse. A full or read-only root: one clear error.
    with storage_writes("to-parquet", parent(final)), file_lock(layout, f"dataset-{fingerprint}"):
        dataset = _build_or_reuse(source, raw, cfg, final, fingerprint, logger, image_size, max_image_pixels, layout.root)
    for note in passed_over:
        logger.warning("%s: %s", source.title, note)
    release_memory()  # this Ray worker is reused by later stages: it should not hold the conversion's peak
    return dataset.model_copy(update={"notes": [*dataset.notes, *passed_over], "source": source.kind})


def _build_or_reuse(
    source: Source, raw: RawData, cfg: ParquetConfig, final: str, fingerprint: str, logger, image_size: int | None = None,
    max_pixels: int | None = None, storage_root: str | None = None,
) -> ParquetDataset:
    """The verified dataset in ``final``, or one built there; a build that replaces a damaged one notes it, naming the file."""
    stored = exists(final)
    problem = manifest_problem(final, fingerprint) if stored else None
    if stored and problem is None:
        manifest = read_json(join(final, MANIFEST))
        logger.info("Parquet dataset %s verified against its manifest; conversion skipped", final)
        shape, classes = manifest_data(manifest)
        return ParquetDataset(
            directory=final, fingerprint=fingerprint, rows=manifest["rows"], skipped=True, image_shape=shape, classes=classes
        )
    if problem:
        logger.warning("Rebuilding the Parquet dataset, the existing one is not trusted: %s", problem)
    notes = [f"rebuilt: the stored dataset failed its check ({problem})"] if problem else []
    built = source.convert(raw, cfg, final, fingerprint, logger, image_size, max_pixels, storage_root)
    return built.model_copy(update={"notes": notes})
