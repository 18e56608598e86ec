"""Stage 2: convert the IDX files into Parquet splits that Ray Data reads in parallel.

The layout, the conversion and the manifest are in `dataset.parquet`. This stage names the
build by a fingerprint of its inputs and settings, takes the dataset's build lock (a concurrent
run building the same dataset waits, then reuses it), skips a build whose manifest verifies, and
otherwise converts into a staging folder that is published whole.
"""

from __future__ import annotations

from prefect import task

from dataset.parquet import FORMAT_VERSION, ParquetDataset, build_manifest, convert, manifest_problem
from dataset.sources import RawData
from pipeline_config import ParquetConfig
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


def dataset_fingerprint(raw: RawData, cfg: ParquetConfig) -> str:
    """Content key of a conversion: input checksums plus every setting that changes the output."""
    return sha256_json({"v": FORMAT_VERSION, "inputs": raw.files, "cfg": cfg.model_dump()})[:16]


@task(name="to-parquet")
def to_parquet(raw: RawData, cfg: ParquetConfig, layout: StorageLayout) -> ParquetDataset:
    """Convert the IDX files to train/val/test Parquet (skipped when a verified build exists)."""
    logger = stage_logger(__name__)
    fingerprint = dataset_fingerprint(raw, cfg)
    final = layout.dataset_dir(fingerprint)
    # A concurrent run building it: wait, then reuse. A full or read-only root: one clear error.
    with storage_writes("to-parquet", parent(final)), file_lock(layout, f"dataset-{fingerprint}"):
        return _build_or_reuse(raw, cfg, final, fingerprint, logger)


def _build_or_reuse(raw: RawData, cfg: ParquetConfig, final: str, fingerprint: str, logger) -> ParquetDataset:
    found = exists(final)
    problem = manifest_problem(final, fingerprint) if found else None
    if found and problem is None:
        manifest = read_json(join(final, MANIFEST))
        logger.info("Parquet dataset %s verified against its manifest; conversion skipped", final)
        return ParquetDataset(directory=final, fingerprint=fingerprint, rows=manifest["rows"], skipped=True)
    if problem:
        logger.warning("Rebuilding the Parquet dataset, the existing one is not trusted: %s", problem)
    # A local staging folder, removed again if the build fails half-way (raw files copied from S3 first).
    with building(final) as staging, local_copy(raw.directory) as raw_dir:
        rows = convert(raw_dir, staging, cfg)
        atomic_write_json(staging / MANIFEST, build_manifest(staging, fingerprint, raw.files, rows))
        publish_dir(staging, final)
    logger.info("Wrote Parquet dataset %s: %s", final, rows)
    return ParquetDataset(directory=final, fingerprint=fingerprint, rows=rows)
