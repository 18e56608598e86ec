"""Every image in a folder as one table to score: Parquet files (searched recursively), IDX files, or PNG/JPEG images,
each file checked before anything is scored, at most MAX_IMAGES of them in one call."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa

from dataset.formats.idx import IMAGE_SHAPE
from dataset.formats.parquet import MNIST_CLASSES
from dataset.inputs.tables import (
    COLUMNS,
    IMAGE_SUFFIXES,
    MAX_IMAGES,
    InputError,
    columns_of,
    encoded_parquet_table,
    idx_table,
    image_files,
    image_table,
    is_encoded,
    parquet_file,
    parquet_table,
)


def read_folder(
    folder: str | Path,
    shape: tuple[int, int, int] = IMAGE_SHAPE,
    classes: list[str] | tuple[str, ...] = MNIST_CLASSES,
    image_size: int | None = None,
    columns: tuple[str, str] = COLUMNS,
) -> pa.Table:
    """Every image in ``folder`` as one table (row_id, image, label); ValueError (InputError) naming the folder or file.

    ``shape`` (C, H, W), ``classes`` and ``image_size`` (``transform.image_size``): the model card's; ``columns``:
    the image and label columns of Parquet files of encoded images (the run's ``download.image_column`` and
    ``label_column``, read where a file has that image column)."""
    root = Path(folder).expanduser()
    shape, classes = tuple(shape), list(classes)
    if not root.is_dir():
        raise InputError(f"input {root}: not a folder")
    try:
        parquet = sorted(  # none in a hidden folder (.ipynb_checkpoints/) either
            p for p in root.rglob("*.parquet") if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts)
        )
        idx = sorted(p for p in root.iterdir() if p.is_file() and p.name.endswith(IMAGE_SUFFIXES))
        images = image_files(root, classes) if not parquet and not idx else []
    except OSError as exc:
        raise InputError(f"input {root}: cannot list it ({exc})") from None
    if parquet and idx:
        raise InputError(f"input {root}: holds both Parquet and IDX files; point --input at a folder of one kind")
    if len(images) > MAX_IMAGES:
        raise InputError(f"input {root}: holds {len(images):,} images, more than the {MAX_IMAGES:,} scored in one call")
    tables: list[pa.Table] = []
    if images:
        tables.append(image_table(images, shape, image_size))
    if parquet:
        opened = [(path, parquet_file(path, shape, columns)) for path in parquet]  # every file's schema before any file's data
        rows = sum(p.metadata.num_rows for _, p in opened)
        if rows > MAX_IMAGES:
            raise InputError(f"input {root}: its Parquet files hold {rows:,} rows, more than the {MAX_IMAGES:,} scored in one call")
        tables = []
        for path, p in opened:  # encoded images: row ids are positions in file order, across the files
            if is_encoded(p.schema_arrow.field(columns_of(p.schema_arrow, columns)[0]).type):
                table = encoded_parquet_table(path, p, shape, classes, image_size, columns)
                first = sum(len(t) for t in tables)
                table = table.set_column(0, "row_id", pa.array(np.arange(first, first + len(table), dtype=np.int64)))
            else:
                table = parquet_table(path, p, len(classes))
            tables.append(table)
    for path in idx:
        tables.append(idx_table(path, sum(len(t) for t in tables), shape, len(classes)))
        if sum(len(t) for t in tables) > MAX_IMAGES:
            raise InputError(f"input {root}: more than the {MAX_IMAGES:,} images scored in one call")
    table = pa.concat_tables(tables) if tables else None
    if table is None or len(table) == 0:
        raise InputError(
            f"input {root}: no digits or images found; expected Parquet files with an 'image' column, IDX files named "
            f"*-images-idx3-ubyte[.gz] (with *-labels-idx1-ubyte[.gz] beside them for accuracy), or PNG/JPEG images "
            f"(in <class>/ subfolders for accuracy)"
        )
    if len(np.unique(table.column("row_id").to_numpy())) != len(table):
        raise InputError(f"input {root}: row_id repeats across its files; score one dataset split at a time")
    return table
