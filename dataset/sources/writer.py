"""The conversion's shared end, for every source: a staging folder, the source's splits written into it, the manifest
last, the folder published whole, and the stage's line.

A source only writes its splits (`dataset.sources.interface.Source.write`); where they are staged (a local folder, also
for an ``s3://`` storage root), the manifest that makes the dataset trusted (`dataset.formats.parquet.build_manifest`:
every file's sha256, the rows, the shape and classes, the leakage found) and the publishing that makes it appear whole
or not at all (`storage_io.publish_dir`) are written once, here.
"""

from __future__ import annotations

from dataset.formats.parquet import ParquetDataset, build_manifest
from dataset.sources.interface import RawData, Source
from pipeline_config import ParquetConfig
from storage_io import MANIFEST, atomic_write_json, building, publish_dir


def convert(
    source: Source, raw: RawData, cfg: ParquetConfig, final: str, fingerprint: str, logger, image_size: int | None = None,
    max_pixels: int | None = None, storage_root: str | None = None,
) -> ParquetDataset:
    """``raw`` converted by ``source`` into ``final``, published whole with its manifest last; the dataset."""
    with building(final) as staging:
        written = source.write(raw, cfg, staging, image_size, max_pixels, storage_root)
        extra = {key: value for key, value in (("image_shape", written.shape), ("classes", written.classes)) if value is not None}
        atomic_write_json(staging / MANIFEST, build_manifest(staging, fingerprint, raw.files, written.rows, **extra))
        publish_dir(staging, final)
    origin = f" from {raw.directory}" if source.user_data else ""  # the user's folder, read where it is
    logger.info("Wrote Parquet dataset %s%s: %s%s", final, origin, written.rows, written.detail)
    return ParquetDataset(directory=final, fingerprint=fingerprint, rows=written.rows, source=source.kind, **extra)
