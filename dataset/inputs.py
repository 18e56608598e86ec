"""Digits to score with a trained model (`flows.predict`): a folder of Parquet or IDX files, as one table.

Accepted, in a local folder:

- Parquet files (searched recursively, e.g. a dataset's ``test/`` split) with an ``image`` column
  of 784-byte 28x28 uint8 images, and optionally ``row_id`` and ``label``;
- IDX image files (``*-images-idx3-ubyte``, gzipped or not), each with its labels file
  (``*-labels-idx1-ubyte``) when there is one.

The result has the dataset schema (`dataset.parquet.SCHEMA`): row_id, image, label (-1 when the
input has no labels). Row ids are the Parquet file's own, or positions in file order.

Every file is checked before anything is scored, and a file that is not what it claims (a
truncated or corrupt gzip stream, an IDX header that disagrees with the data, a file that is not
Parquet, labels outside 0-9) is refused with a ValueError naming it. The cost of reading is
bounded however the file was built: at most `MAX_IMAGES` digits per call, read in chunks up to
what the header declares, so a small file that would expand to gigabytes is refused after
reading at most that much.
"""

from __future__ import annotations

import gzip
import struct
import zlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dataset.idx import IMAGE_BYTES, NUM_CLASSES
from dataset.parquet import SCHEMA, to_table

NO_LABEL = -1
IMAGE_SUFFIXES = ("-images-idx3-ubyte", "-images-idx3-ubyte.gz", "-images.idx3-ubyte", "-images.idx3-ubyte.gz")
# Digits one call scores at most (784 MB of pixels); more is refused before reading it. Score a
# larger set in several calls.
MAX_IMAGES = 1_000_000
_CHUNK = 1 << 22
_GZIP_ERRORS = (EOFError, gzip.BadGzipFile, zlib.error, struct.error)


class InputError(ValueError):
    """An input file that cannot be scored, named with what is wrong with it."""


def _open(path: Path):
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def _read_exactly(handle, count: int, path: Path) -> bytes:
    """``count`` bytes from ``handle`` in chunks (so a short stream costs what it holds, not what it claims)."""
    parts, left = [], count
    while left:
        block = handle.read(min(left, _CHUNK))
        if not block:
            raise InputError(f"{path}: ends early: its header announces {count:,} bytes of values, it holds {count - left:,} (truncated?)")
        parts.append(block)
        left -= len(block)
    return b"".join(parts)


def _idx_array(path: Path, dims: int) -> np.ndarray:
    """The uint8 array in an IDX file (``dims`` dimensions), checked against its header; InputError naming the file."""
    try:
        with _open(path) as handle:
            head = handle.read(4)
            if len(head) != 4 or head[:2] != b"\x00\x00" or head[2] != 0x08 or head[3] != dims:
                raise InputError(f"{path}: not an IDX uint8 file with {dims} dimension(s) (its first bytes are {head[:4]!r})")
            raw_shape = handle.read(4 * dims)
            if len(raw_shape) != 4 * dims:
                raise InputError(f"{path}: the IDX header ends early (truncated?)")
            shape = struct.unpack(f">{dims}I", raw_shape)
            if dims == 3 and shape[1:] != (28, 28):
                raise InputError(f"{path}: holds {shape[1]}x{shape[2]} images, expected 28x28")
            if shape[0] > MAX_IMAGES:
                raise InputError(f"{path}: its header announces {shape[0]:,} rows, more than the {MAX_IMAGES:,} scored in one call")
            count = int(np.prod(shape, dtype=np.int64))
            data = _read_exactly(handle, count, path)
            if handle.read(1):
                raise InputError(f"{path}: holds more values than its header's shape {tuple(shape)} (trailing data)")
    except InputError:
        raise
    except _GZIP_ERRORS as exc:
        raise InputError(f"{path}: damaged gzip stream ({type(exc).__name__}: {exc})") from None
    except OSError as exc:
        raise InputError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    return np.frombuffer(data, dtype=np.uint8).reshape(shape)


def _labels_of(images: Path) -> Path:
    return images.with_name(images.name.replace("-images", "-labels").replace("idx3", "idx1"))


def _idx_table(images: Path, first_row: int) -> pa.Table:
    pixels = _idx_array(images, 3).reshape(-1, IMAGE_BYTES)
    labels_path = _labels_of(images)
    labels = np.full(len(pixels), NO_LABEL, dtype=np.int64)
    if labels_path.exists():
        digits = _idx_array(labels_path, 1)
        if len(digits) != len(pixels):
            raise InputError(f"{images} has {len(pixels)} images but {labels_path} has {len(digits)} labels")
        if len(digits) and int(digits.max()) >= NUM_CLASSES:
            row = int(np.argmax(digits >= NUM_CLASSES))
            raise InputError(f"{labels_path}: label {int(digits[row])} at row {row} is not a digit 0-9")
        labels = digits.astype(np.int64)
    return to_table(np.arange(first_row, first_row + len(pixels), dtype=np.int64), pixels, labels)


def _parquet_file(path: Path) -> pq.ParquetFile:
    """The opened Parquet file, its schema checked before any data is read; InputError naming it."""
    try:
        parquet = pq.ParquetFile(path)
        schema = parquet.schema_arrow
    except (pa.ArrowException, OSError, ValueError, EOFError) as exc:
        raise InputError(f"{path}: not a readable Parquet file ({' '.join(str(exc).split())[:300]})") from None
    if "image" not in schema.names or schema.field("image").type != pa.binary(IMAGE_BYTES):
        raise InputError(f"{path}: needs an 'image' column of {IMAGE_BYTES}-byte images (28x28 uint8), has {schema}")
    for name in ("row_id", "label"):
        if name in schema.names and not pa.types.is_integer(schema.field(name).type):
            raise InputError(f"{path}: column '{name}' is {schema.field(name).type}, expected integers")
    return parquet


def _parquet_table(path: Path, parquet: pq.ParquetFile) -> pa.Table:
    names = [name for name in ("row_id", "image", "label") if name in parquet.schema_arrow.names]
    try:
        table = parquet.read(columns=names)
    except (pa.ArrowException, OSError, ValueError, EOFError) as exc:
        raise InputError(f"{path}: damaged Parquet data ({' '.join(str(exc).split())[:300]})") from None
    count = len(table)
    for name in names:
        if table.column(name).null_count:
            raise InputError(f"{path}: column '{name}' has {table.column(name).null_count} empty (null) value(s)")
    row_ids = table.column("row_id") if "row_id" in names else pa.array(np.arange(count, dtype=np.int64))
    labels = table.column("label") if "label" in names else pa.array(np.full(count, NO_LABEL, dtype=np.int64))
    values = np.asarray(labels.to_numpy(), dtype=np.int64)
    bad = (values != NO_LABEL) & ((values < 0) | (values >= NUM_CLASSES))
    if bad.any():
        row = int(np.argmax(bad))
        raise InputError(f"{path}: label {int(values[row])} at row {row} is not a digit 0-9 (or {NO_LABEL} for unknown)")
    try:
        return pa.table({"row_id": row_ids, "image": table.column("image"), "label": labels}).cast(SCHEMA)
    except (pa.ArrowException, ValueError) as exc:
        raise InputError(f"{path}: {exc}") from None


def read_folder(folder: str | Path) -> pa.Table:
    """Every image in ``folder`` as one table (row_id, image, label); ValueError (InputError) naming the folder or file."""
    root = Path(folder).expanduser()
    if not root.is_dir():
        raise InputError(f"input {root}: not a folder")
    try:
        parquet = sorted(p for p in root.rglob("*.parquet") if p.is_file() and not p.name.startswith("."))
        idx = sorted(p for p in root.iterdir() if p.is_file() and p.name.endswith(IMAGE_SUFFIXES))
    except OSError as exc:
        raise InputError(f"input {root}: cannot list it ({exc})") from None
    if parquet and idx:
        raise InputError(f"input {root}: holds both Parquet and IDX files; point --input at a folder of one kind")
    tables: list[pa.Table] = []
    if parquet:
        opened = [(path, _parquet_file(path)) for path in parquet]  # every file's schema before any file's data
        rows = sum(p.metadata.num_rows for _, p in opened)
        if rows > MAX_IMAGES:
            raise InputError(f"input {root}: its Parquet files hold {rows:,} rows, more than the {MAX_IMAGES:,} scored in one call")
        tables = [_parquet_table(path, p) for path, p in opened]
    for path in idx:
        tables.append(_idx_table(path, sum(len(t) for t in tables)))
        if sum(len(t) for t in tables) > MAX_IMAGES:
            raise InputError(f"input {root}: more than the {MAX_IMAGES:,} digits scored in one call")
    table = pa.concat_tables(tables) if tables else None
    if table is None or len(table) == 0:
        raise InputError(
            f"input {root}: no digits found; expected Parquet files with an 'image' column or IDX files named "
            f"*-images-idx3-ubyte[.gz] (with *-labels-idx1-ubyte[.gz] beside them for accuracy)"
        )
    if len(np.unique(table.column("row_id").to_numpy())) != len(table):
        raise InputError(f"input {root}: row_id repeats across its files; score one dataset split at a time")
    return table
