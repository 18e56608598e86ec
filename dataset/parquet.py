"""The Parquet layout of a converted dataset, its conversion from IDX files, and its manifest.

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

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel

from dataset.idx import IMAGE_BYTES, IMAGE_SHAPE, NUM_CLASSES, SOURCE_FILES, iter_idx_rows
from pipeline_config import ParquetConfig
from storage_io import MANIFEST, join, list_files, read_json, sha256_file

FORMAT_VERSION = 1


SCHEMA = pa.schema(
    [
        pa.field("row_id", pa.int64(), nullable=False),
        pa.field("image", pa.binary(IMAGE_BYTES), nullable=False),
        pa.field("label", pa.int64(), nullable=False),
    ]
)


SPLITS = ("train", "val", "test")


class ParquetDataset(BaseModel):
    """A published Parquet dataset: where each split lives and how many rows it has."""

    directory: str
    fingerprint: str
    rows: dict[str, int]
    skipped: bool = False

    def split_dir(self, split: str) -> str:
        return join(self.directory, split)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """(channels, height, width) of every image: what the model is built for."""
        return IMAGE_SHAPE

    @property
    def num_classes(self) -> int:
        """Labels run 0..num_classes-1."""
        return NUM_CLASSES


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
