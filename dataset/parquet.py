"""Stage 2: convert the IDX files into Parquet splits that Ray Data reads in parallel.

Schema (one row per image):

    row_id  int64                 unique across splits, stable: train rows 0..n-1 in file order,
                                  test rows n..n+m-1
    image   fixed_size_binary(784) the 28x28 uint8 pixels, row-major
    label   int64                 0..9

Why ``fixed_size_binary(784)`` and not ``list<uint8>``: it stores no per-row offsets, and a
column of it is one contiguous buffer, so a batch becomes an (N, 784) uint8 array with one
``np.frombuffer`` (no per-row Python objects); the width is part of the type, so a wrong-sized
image cannot be written.

The training file is split once more: every n-th train row (``validation_every``) goes to
``val/`` for per-epoch validation, so the test split is touched only by evaluation.

Conversion streams one row group at a time (memory stays flat at any size) into a staging
folder that is published together with ``_manifest.json`` (one rename locally; on S3 an upload
with the manifest last); a finished conversion with a verified manifest is skipped on re-run,
and a half-written one is never read.
"""

from __future__ import annotations

import gzip
import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from prefect import task
from pydantic import BaseModel

from pipeline_config import ParquetConfig
from tasks.common.logs import stage_logger
from tasks.common.storage import (
    MANIFEST,
    StorageLayout,
    atomic_write_json,
    building,
    exists,
    file_lock,
    join,
    list_files,
    local_copy,
    parent,
    publish_dir,
    read_json,
    sha256_file,
    sha256_json,
    storage_writes,
)
from tasks.download import RawData

FORMAT_VERSION = 1
IMAGE_BYTES = 28 * 28
SCHEMA = pa.schema(
    [
        pa.field("row_id", pa.int64(), nullable=False),
        pa.field("image", pa.binary(IMAGE_BYTES), nullable=False),
        pa.field("label", pa.int64(), nullable=False),
    ]
)
SPLITS = ("train", "val", "test")
SOURCE_FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}


class ParquetDataset(BaseModel):
    """A published Parquet dataset: where each split lives and how many rows it has."""

    directory: str
    fingerprint: str
    rows: dict[str, int]
    skipped: bool = False

    def split_dir(self, split: str) -> str:
        return join(self.directory, split)


def read_idx_header(handle, path: Path, expected_dims: int) -> tuple[int, ...]:
    """Read and check an IDX header (uint8 data, ``expected_dims`` dimensions); return the shape."""
    head = handle.read(4)
    if len(head) != 4 or head[:2] != b"\x00\x00" or head[2] != 0x08 or head[3] != expected_dims:
        raise ValueError(f"{path} is not an IDX uint8 file with {expected_dims} dimension(s)")
    shape = struct.unpack(f">{expected_dims}I", handle.read(4 * expected_dims))
    if expected_dims == 3 and shape[1:] != (28, 28):
        raise ValueError(f"{path} holds {shape[1]}x{shape[2]} images, expected 28x28")
    return shape


def iter_idx_rows(images: Path, labels: Path, rows_per_chunk: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Yield (images (n, 784) uint8, labels (n,) int64) chunks from a pair of IDX .gz files."""
    with gzip.open(images, "rb") as img, gzip.open(labels, "rb") as lab:
        n_images = read_idx_header(img, images, 3)[0]
        n_labels = read_idx_header(lab, labels, 1)[0]
        if n_images != n_labels:
            raise ValueError(f"{images} has {n_images} images but {labels} has {n_labels} labels")
        for start in range(0, n_images, rows_per_chunk):
            n = min(rows_per_chunk, n_images - start)
            pixels = np.frombuffer(img.read(n * IMAGE_BYTES), dtype=np.uint8)
            digits = np.frombuffer(lab.read(n), dtype=np.uint8)
            if pixels.size != n * IMAGE_BYTES or digits.size != n:
                raise ValueError(f"{images} or {labels} ends early (truncated at row {start})")
            if digits.max(initial=0) > 9:
                raise ValueError(f"{labels} has a label above 9 near row {start}")
            yield pixels.reshape(n, IMAGE_BYTES), digits.astype(np.int64)


def to_table(row_ids: np.ndarray, images: np.ndarray, labels: np.ndarray) -> pa.Table:
    """Build an Arrow table in ``SCHEMA`` from contiguous arrays (no per-row Python objects)."""
    image_col = pa.FixedSizeBinaryArray.from_buffers(
        pa.binary(IMAGE_BYTES), len(images), [None, pa.py_buffer(np.ascontiguousarray(images))]
    )
    return pa.Table.from_arrays([pa.array(row_ids), image_col, pa.array(labels)], schema=SCHEMA)


def images_from_column(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """(N, 784) uint8 view of a ``fixed_size_binary(784)`` column (copies only across chunks)."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    data = column.buffers()[1]
    start = column.offset * IMAGE_BYTES
    return np.frombuffer(data, dtype=np.uint8, count=len(column) * IMAGE_BYTES, offset=start).reshape(-1, IMAGE_BYTES)


class _SplitWriter:
    """Writes one split as numbered Parquet files of at most ``rows_per_file`` rows."""

    def __init__(self, folder: Path, cfg: ParquetConfig):
        self.folder, self.cfg = folder, cfg
        self.folder.mkdir(parents=True, exist_ok=True)
        self.writer: pq.ParquetWriter | None = None
        self.rows_in_file = 0
        self.files = 0
        self.rows = 0

    def write(self, table: pa.Table) -> None:
        while table.num_rows:
            if self.writer is None or self.rows_in_file >= self.cfg.rows_per_file:
                self._roll()
            take = min(table.num_rows, self.cfg.rows_per_file - self.rows_in_file)
            self.writer.write_table(table.slice(0, take), row_group_size=self.cfg.rows_per_group)
            self.rows_in_file += take
            self.rows += take
            table = table.slice(take)

    def _roll(self) -> None:
        self.close()
        path = self.folder / f"part-{self.files:05d}.parquet"
        self.writer = pq.ParquetWriter(path, SCHEMA, compression="zstd")
        self.files += 1
        self.rows_in_file = 0

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def convert(raw_dir: Path, out_dir: Path, cfg: ParquetConfig) -> dict[str, int]:
    """Stream the IDX files in ``raw_dir`` into train/val/test Parquet folders; return row counts."""
    writers = {split: _SplitWriter(out_dir / split, cfg) for split in SPLITS}
    next_row_id = 0
    try:
        for split, (images, labels) in SOURCE_FILES.items():
            for pixels, digits in iter_idx_rows(raw_dir / images, raw_dir / labels, cfg.rows_per_group):
                row_ids = np.arange(next_row_id, next_row_id + len(digits), dtype=np.int64)
                next_row_id += len(digits)
                table = to_table(row_ids, pixels, digits)
                if split == "test":
                    writers["test"].write(table)
                    continue
                is_val = (row_ids % cfg.validation_every) == cfg.validation_every - 1
                writers["val"].write(table.filter(pa.array(is_val)))
                writers["train"].write(table.filter(pa.array(~is_val)))
    finally:
        for writer in writers.values():
            writer.close()
    return {split: writer.rows for split, writer in writers.items()}


def build_manifest(directory: str | Path, fingerprint: str, inputs: dict[str, str], rows: dict[str, int]) -> dict:
    """Manifest of a dataset folder: inputs, row counts and the sha256 of every Parquet file."""
    files = {name: sha256_file(join(directory, name)) for name in list_files(directory, ".parquet")}
    return {"format_version": FORMAT_VERSION, "fingerprint": fingerprint, "inputs": inputs, "rows": rows, "files": files}


def manifest_problem(directory: str, fingerprint: str) -> str | None:
    """Why the dataset in ``directory`` cannot be reused (naming the file), or None when it verifies."""
    manifest_path = join(directory, MANIFEST)
    manifest = read_json(manifest_path)
    if not isinstance(manifest, dict):
        return f"{manifest_path} is missing or unreadable"
    if manifest.get("fingerprint") != fingerprint:
        return f"{manifest_path} describes another build ({manifest.get('fingerprint')!r})"
    files = manifest.get("files") or {}
    on_disk = set(list_files(directory, ".parquet"))
    if not files or set(files) != on_disk:
        extra, missing = sorted(on_disk - set(files)), sorted(set(files) - on_disk)
        return f"{directory}: Parquet files do not match the manifest (missing {missing}, unexpected {extra})"
    for name, digest in files.items():
        if sha256_file(join(directory, name)) != digest:
            return f"{join(directory, name)}: sha256 does not match the manifest (truncated or modified)"
    return None


def verify_manifest(directory: str, fingerprint: str) -> dict | None:
    """The manifest of ``directory`` if it matches ``fingerprint`` and every file's sha256, else None."""
    return None if manifest_problem(directory, fingerprint) else read_json(join(directory, MANIFEST))


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
