"""Stage 2: convert the run's data into Parquet splits that Ray Data reads in parallel.

The layout, the manifest and the IDX conversion are in `dataset.formats.parquet`; each source's fingerprint and
splits in its module (`dataset.sources.interface.source_of`), the staging, manifest and publishing shared by every
source in `dataset.sources.writer`. This stage names the build by a fingerprint of its
inputs and settings, takes the dataset's build lock (a concurrent run building the same dataset waits,
then reuses it), skips a build whose manifest verifies, and otherwise converts into a staging folder that
is published whole.
"""

from __future__ import annotations

from prefect import task

from dataset.formats.listing import cache_path
from dataset.formats.parquet import ParquetDataset, find_leakage, manifest_data, manifest_leakage, manifest_problem
from dataset.sources.interface import RawData, Source, source_of
from dataset.sources.writer import convert
from dataset.tensors import sizing
from dataset.tensors.memory import release_memory
from pipeline_config import DEFAULT_WORKLOAD, ParquetConfig
from reporting.logs import stage_logger
from storage_io import (
    MANIFEST,
    StorageLayout,
    exists,
    file_lock,
    is_remote,
    join,
    parent,
    read_json,
    remove,
    sha256_file,
    storage_writes,
)


class LeakageError(ValueError):
    """Test or validation rows that copy training images, with ``parquet.leakage: error``: names them."""


def dataset_fingerprint(raw: RawData, cfg: ParquetConfig, image_size: int | str | None = None, storage_root: str | None = None) -> str:
    """Content key of a conversion: input checksums plus every setting that changes the output (the source's).
    ``image_size``: ``auto`` is made concrete for the data first (`dataset.tensors.sizing`; ``storage_root``: its listing cache)."""
    source = source_of(raw)
    return source.fingerprint(raw, cfg.conversion_settings(), sizing.image_size_for(source, image_size, storage_root))


@task(name="to-parquet")
def to_parquet(
    raw: RawData, cfg: ParquetConfig, layout: StorageLayout, image_size: int | str | None = None, workload: str = DEFAULT_WORKLOAD,
    max_image_pixels: int | None = None,
) -> ParquetDataset:
    """Convert the downloaded data to train/val/test Parquet (skipped when a verified build exists).

    ``image_size``: ``transform.image_size``, the square size a user's images are resized to; ``auto``: made
    concrete for their own size (`dataset.tensors.sizing`), which the dataset then carries (``auto_from``) for the
    transform's line.
    ``workload``: names the dataset folder, ``datasets/<workload>-<fingerprint>``.
    ``max_image_pixels``: ``download.max_image_pixels``, checked again as a user's images are read
    (None: not again; a local folder's images were checked before any work).

    A stored dataset that fails its check (a file missing, truncated or modified) is rebuilt, and the
    stage's terminal line says so, naming the file."""
    logger = stage_logger(__name__)
    source = source_of(raw)
    auto = image_size == "auto" and source.resizable
    own = sizing.own_size(source, layout.root) if auto else None  # (height, width) as they are
    image_size = sizing.image_size_for(source, image_size, layout.root, own=own)
    fingerprint = dataset_fingerprint(raw, cfg, image_size)
    final = layout.dataset_dir(fingerprint, workload)
    passed_over = list(raw.notes)  # what the listing passed over, said whether the data is converted or reused
    if exists(final):  # a dataset to reuse: first, are the user's files what their recorded sha256 says?
        raw, replaced = content_checked(source, raw, layout.root)
        if replaced:
            passed_over.append(replaced)  # said in the stage's line and logged with the notes below
            fingerprint = dataset_fingerprint(raw, cfg, image_size)
            final = layout.dataset_dir(fingerprint, workload)
    # A concurrent run building it: wait, then reuse. A full or read-only root: one clear error.
    with storage_writes("to-parquet", parent(final)), file_lock(layout, f"dataset-{fingerprint}"):
        dataset = _build_or_reuse(source, raw, cfg, final, fingerprint, logger, image_size, max_image_pixels, layout.root)
    for note in passed_over:
        logger.warning("%s: %s", source.title, note)
    leakage = _leakage(dataset)
    copied = leakage_note(leakage, dataset.rows)
    if copied and cfg.leakage == "error":
        raise LeakageError(f"{dataset.directory}: {copied}; parquet.leakage is error: remove the copies from the test and "
                           "validation data, or set parquet.leakage=warn to train anyway")
    if copied:
        logger.warning("Leakage: %s", copied)
    release_memory()  # this Ray worker is reused by later stages: it should not hold the conversion's peak
    notes = [*dataset.notes, *([f"leakage: {copied}"] if copied else []), *passed_over]
    counts = {split: found["rows"] for split, found in leakage.items()}
    auto_from = (own or tuple(dataset.image_shape[1:])) if auto else None  # an s3:// folder's own size: known only now
    return dataset.model_copy(update={"notes": notes, "source": source.kind, "leakage": counts, "auto_from": auto_from})


def content_checked(source: Source, raw: RawData, storage_root: str) -> tuple[RawData, str]:
    """``raw`` with the sha256 of every file of a user's local folder read from its content, and what changed.

    The download stage took an unchanged file's sha256 from the listing cache, which trusts a file whose size and
    modification time are those it recorded (`dataset.formats.listing`); a file replaced keeping both named the old
    dataset, and a forced retrain (``--no-promote.skip-unchanged``) trained on it again. Before a stored
    dataset is reused, the files are read once more; a changed one gives its new sha256 (another fingerprint:
    the data is converted again) and drops the folder's listing cache, which vouched for it. An ``s3://``
    object cannot be replaced keeping its time, and MNIST's IDX files are verified by the download stage."""
    if not source.user_data or is_remote(raw.directory):
        return raw, ""
    changed = {rel: digest for rel, recorded in raw.files.items() if (digest := sha256_file(join(raw.directory, rel))) != recorded}
    if not changed:
        return raw, ""
    try:
        remove(cache_path(storage_root, raw.directory))  # it vouched for files that changed: every file is read again next time
    except OSError:  # a read-only root: the cache only saves work, and the next forced run reads the files again
        pass
    named = ", ".join(sorted(changed)[:3]) + (", ..." if len(changed) > 3 else "")
    note = (f"{len(changed)} file(s) changed keeping their size and modification time ({named}): their content read again, "
            "converted anew; the folder's listing cache dropped")
    return raw.model_copy(update={"files": {**raw.files, **changed}}), note


def _leakage(dataset: ParquetDataset) -> dict[str, dict]:
    """The dataset's validation and test rows that copy a training image: as its manifest records them, or found
    now for a dataset converted before manifests recorded them (`dataset.formats.parquet.find_leakage`)."""
    recorded = manifest_leakage(read_json(join(dataset.directory, MANIFEST)) or {})
    return recorded if recorded is not None else find_leakage(dataset.directory)


def leakage_note(leakage: dict[str, dict], rows: dict[str, int]) -> str:
    """``200 of 1,000 test rows (row_id 4000, 4001, ...) are exact copies of training images: ...``, or "" when none is."""
    parts = []
    for split, what in (("test", "test"), ("val", "validation")):
        found = leakage.get(split) or {}
        if found.get("rows"):
            ids = ", ".join(str(i) for i in found.get("row_ids", []))
            more = ", ..." if found["rows"] > len(found.get("row_ids", [])) else ""
            parts.append(f"{found['rows']:,} of {rows.get(split, 0):,} {what} rows (row_id {ids}{more})")
    if not parts:
        return ""
    return (f"{' and '.join(parts)} are exact copies of training images: their scores overstate what the model "
            "learned")


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
    built = convert(source, raw, cfg, final, fingerprint, logger, image_size, max_pixels, storage_root)
    return built.model_copy(update={"notes": notes})
