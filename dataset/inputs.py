"""Digits to score with a trained model (`flows.predict`): a folder of Parquet or IDX files, as one table.

Accepted, in a local folder:

- Parquet files (searched recursively, e.g. a dataset's ``test/`` split) with an ``image`` column
  of 784-byte 28x28 uint8 images, and optionally ``row_id`` and ``label``;
- IDX image files (``*-images-idx3-ubyte``, gzipped or not), each with its labels file
  (``*-labels-idx1-ubyte``) when there is one.

The result has the dataset schema (`dataset.parquet.SCHEMA`): row_id, image, label (-1 when the
input has no labels). Row ids are the Parquet file's own, or positions in file order.
"""

from __future__ import annotations

import gzip
import io
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dataset.idx import IMAGE_BYTES, read_idx_header
from dataset.parquet import SCHEMA, to_table

NO_LABEL = -1
IMAGE_SUFFIXES = ("-images-idx3-ubyte", "-images-idx3-ubyte.gz", "-images.idx3-ubyte", "-images.idx3-ubyte.gz")


def _idx_array(path: Path, dims: int) -> np.ndarray:
    data = path.read_bytes()
    if path.suffix == ".gz":
        data = gzip.decompress(data)
    shape = read_idx_header(io.BytesIO(data), path, dims)
    values = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * dims)
    if values.size != int(np.prod(shape)):
        raise ValueError(f"{path} holds {values.size} values, its header says {shape} (truncated?)")
    return values.reshape(shape)


def _idx_table(images: Path, first_row: int) -> pa.Table:
    pixels = _idx_array(images, 3).reshape(-1, IMAGE_BYTES)
    labels_path = images.with_name(images.name.replace("-images", "-labels").replace("idx3", "idx1"))
    labels = np.full(len(pixels), NO_LABEL, dtype=np.int64)
    if labels_path.exists():
        labels = _idx_array(labels_path, 1).astype(np.int64)
        if len(labels) != len(pixels):
            raise ValueError(f"{images} has {len(pixels)} images but {labels_path} has {len(labels)} labels")
    return to_table(np.arange(first_row, first_row + len(pixels), dtype=np.int64), pixels, labels)


def _parquet_table(path: Path) -> pa.Table:
    table = pq.read_table(path)
    if "image" not in table.column_names or table.schema.field("image").type != pa.binary(IMAGE_BYTES):
        raise ValueError(f"{path}: needs an 'image' column of {IMAGE_BYTES}-byte images (28x28 uint8), has {table.schema}")
    count = len(table)
    row_ids = table.column("row_id") if "row_id" in table.column_names else pa.array(np.arange(count, dtype=np.int64))
    labels = table.column("label") if "label" in table.column_names else pa.array(np.full(count, NO_LABEL, dtype=np.int64))
    return pa.table({"row_id": row_ids, "image": table.column("image"), "label": labels}).cast(SCHEMA)


def read_folder(folder: str | Path) -> pa.Table:
    """Every image in ``folder`` as one table (row_id, image, label); ValueError naming the folder or file."""
    root = Path(folder).expanduser()
    if not root.is_dir():
        raise ValueError(f"input {root}: not a folder")
    parquet = sorted(p for p in root.rglob("*.parquet") if p.is_file() and not p.name.startswith("."))
    idx = sorted(p for p in root.iterdir() if p.is_file() and p.name.endswith(IMAGE_SUFFIXES))
    if parquet and idx:
        raise ValueError(f"input {root}: holds both Parquet and IDX files; point --input at a folder of one kind")
    tables: list[pa.Table] = []
    if parquet:
        tables = [_parquet_table(path) for path in parquet]
    for path in idx:
        tables.append(_idx_table(path, sum(len(t) for t in tables)))
    table = pa.concat_tables(tables) if tables else None
    if table is None or len(table) == 0:
        raise ValueError(
            f"input {root}: no digits found; expected Parquet files with an 'image' column or IDX files named "
            f"*-images-idx3-ubyte[.gz] (with *-labels-idx1-ubyte[.gz] beside them for accuracy)"
        )
    if len(np.unique(table.column("row_id").to_numpy())) != len(table):
        raise ValueError(f"input {root}: row_id repeats across its files; score one dataset split at a time")
    return table
