"""Stage 2: convert the IDX files (or a labelled image folder) into Parquet splits that Ray Data reads in parallel.

The layout, the IDX conversion and the manifest are in `dataset.parquet`; an image folder's
checks and conversion (read with Ray Data) in `dataset.folder`. This stage names the
build by a fingerprint of its inputs and settings, takes the dataset's build lock (a concurrent
run building the same dataset waits, then reuses it), skips a build whose manifest verifies, and
otherwise converts into a staging folder that is published whole.
"""

from __future__ import annotations

from prefect import task

from dataset import folder
from dataset.memory import release_memory
from dataset.parquet import FORMAT_VERSION, ParquetDataset, build_manifest, convert, manifest_data, manifest_problem
from dataset.sources import RawData
from pipeline_config import DEFAULT_WORKLOAD, ParquetConfig
from reporting.logs import stage_logger
from storage_io import (
    MANIFEST,
    StorageLayout,
    atomic_write_json,
    building,
    exists,
    file_lock,
    join,
    local_copy,
    parent,
    publish_dir,
    read_json,
    sha256_json,
    storage_writes,
)


# Settings only an image folder's conversion reads: left out of an IDX dataset's fingerprint, so
# MNIST's datasets keep the fingerprint (and folder) they had before these settings existed.
FOLDER_ONLY = {"split_seed"}
# How an image folder's pixels are decoded (`dataset.images`), part of its datasets' fingerprint:
# 2 since 16-bit grayscale is scaled to 8 bits (before, it was clipped at 255), so a dataset
# converted the old way is not reused.
FOLDER_DECODE = 2
# How an image folder's training rows are ordered (`dataset.folder.plan_rows`): "shuffled" since a
# streamed split is read in windows of row groups; before, in file order (class by class).
FOLDER_ORDER = "shuffled"


def dataset_fingerprint(raw: RawData, cfg: ParquetConfig, image_size: int | None = None) -> str:
    """Content key of a conversion: input checksums plus every setting that changes the output."""
    if raw.source != "folder":
        return sha256_json({"v": FORMAT_VERSION, "inputs": raw.files, "cfg": cfg.model_dump(exclude=FOLDER_ONLY)})[:16]
    key = {"v": FORMAT_VERSION, "source": "folder", "inputs": raw.files, "cfg": cfg.model_dump(), "image_size": image_size,
           "decode": FOLDER_DECODE, "order": FOLDER_ORDER}
    return sha256_json(key)[:16]


@task(name="to-parquet")
def to_parquet(
    raw: RawData, cfg: ParquetConfig, layout: StorageLayout, image_size: int | None = None, workload: str = DEFAULT_WORKLOAD,
    max_image_pixels: int | None = None,
) -> ParquetDataset:
    """Convert the IDX files or the image folder to train/val/test Parquet (skipped when a verified build exists).

    ``image_size``: ``transform.image_size``, the square size an image folder's images are resized to.
    ``workload``: names the dataset folder, ``datasets/<workload>-<fingerprint>``.
    ``max_image_pixels``: ``download.max_image_pixels``, checked again as an image folder's images are read
    (None: not again; a local folder's images were checked before any work).

    A stored dataset that fails its check (a file missing, truncated or modified) is rebuilt, and the
    stage's terminal line says so, naming the file."""
    logger = stage_logger(__name__)
    fingerprint = dataset_fingerprint(raw, cfg, image_size)
    final = layout.dataset_dir(fingerprint, workload)
    found = folder.check_folder(raw.directory) if raw.source == "folder" else None
    # A concurrent run building it: wait, then reuse. A full or read-only root: one clear error.
    with storage_writes("to-parquet", parent(final)), file_lock(layout, f"dataset-{fingerprint}"):
        dataset = _build_or_reuse(raw, cfg, final, fingerprint, logger, image_size, found, max_image_pixels, layout.root)
    skipped = found.skipped_note() if found else None
    if skipped:
        logger.warning("Image folder: %s", skipped)
    notes = [*dataset.notes, *([skipped] if skipped else [])]
    release_memory()  # this Ray worker is reused by later stages: it should not hold the conversion's peak
    return dataset.model_copy(update={"notes": notes, "source": "folder" if found is not None else "idx"})


def _build_or_reuse(
    raw: RawData, cfg: ParquetConfig, final: str, fingerprint: str, logger, image_size: int | None = None,
    found: folder.FolderLayout | None = None, max_pixels: int | None = None, storage_root: str | None = None,
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
    if found is not None:
        built = _build_from_folder(raw, cfg, final, fingerprint, logger, image_size, found, max_pixels, storage_root)
        return built.model_copy(update={"notes": notes})
    # A local staging folder, removed again if the build fails half-way (raw files copied from S3 first).
    with building(final) as staging, local_copy(raw.directory) as raw_dir:
        rows = convert(raw_dir, staging, cfg)
        atomic_write_json(staging / MANIFEST, build_manifest(staging, fingerprint, raw.files, rows))
        publish_dir(staging, final)
    logger.info("Wrote Parquet dataset %s: %s", final, rows)
    return ParquetDataset(directory=final, fingerprint=fingerprint, rows=rows, notes=notes)


def _build_from_folder(
    raw: RawData, cfg: ParquetConfig, final: str, fingerprint: str, logger, image_size: int | None,
    found: folder.FolderLayout, max_pixels: int | None, storage_root: str | None = None,
) -> ParquetDataset:
    """An image folder read with Ray Data into a staging folder, published whole with its manifest last."""
    listed = {rel for rows in found.files.values() for rel, _ in rows}
    if listed != set(raw.files):  # the folder changed between the download stage and now
        raise folder.FolderError(f"{raw.directory}: its images changed since the download stage listed them; run again")
    with building(final) as staging:
        rows, shape = folder.convert_folder(found, staging, cfg, image_size, max_pixels=max_pixels, storage_root=storage_root)
        manifest = build_manifest(staging, fingerprint, raw.files, rows, shape, found.classes)
        atomic_write_json(staging / MANIFEST, manifest)
        publish_dir(staging, final)
    split = "its val/ folder" if found.has_val else f"a stratified split of train/ (parquet.split_seed={cfg.split_seed})"
    logger.info("Wrote Parquet dataset %s from %s: %s, %dx%dx%d images, %d classes; validation from %s",
                final, raw.directory, rows, shape[1], shape[2], shape[0], len(found.classes), split)
    return ParquetDataset(directory=final, fingerprint=fingerprint, rows=rows, image_shape=shape, classes=found.classes)
