"""A folder of Parquet files as a labelled image dataset (``download.source=parquet``): its layout and checks.

``download.path`` (local or ``s3://``) holds Parquet files whose split is in the file or folder name,
as the Hugging Face hub stores a dataset: ``data/train-00000-of-00001.parquet``,
``default/train/0000.parquet``, a ``train/`` and a ``test/`` folder, ``test.parquet``. ``validation``,
``valid`` and ``val`` name the optional validation split; without it a seeded stratified split of the
training rows is held out (`dataset.folder.stratified_split`, as for an image folder).

Two columns are read, with pyarrow:

- ``download.image_column`` (``image``): the encoded image (PNG or JPEG), a struct ``{bytes, path}`` as the
  ``datasets`` library writes an ``Image`` feature, or plain binary;
- ``download.label_column`` (``label``): integers, or strings whose sorted training values become the
  classes. Integers take their class names from the file's Hugging Face metadata (the ``huggingface`` key of
  the Parquet schema's metadata: ``info.features.<label column>.names``, a ``ClassLabel``) when it has them,
  else ``0``, ``1``, ... up to the largest training label.

`check_layout` refuses, before any work, naming the field or the file: no folder, no Parquet files, a file
whose split its name does not tell, no train or test split, a file that is not Parquet, a missing column or
one of another type, an empty (null) label or a label that is not a class (named by file and row), a test or
validation class the training rows lack, one class only, an empty validation split. `scan` decodes the images
(named by file and row: not an image, cut short, over ``download.max_image_pixels``, sizes that differ
without ``transform.image_size``). The folder is only read: never copied, modified or deleted.
"""

from __future__ import annotations

import json
import re
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dataset import images
from dataset.folder import GRAY_MODES
from dataset.listing import ListingCache
from storage_io import filesystem, is_dir, list_files

SUFFIX = ".parquet"
# The words that name a split at the start of a file or folder name, and the split each names.
SPLIT_WORDS = {"train": "train", "test": "test", "validation": "val", "valid": "val", "val": "val"}
_SPLIT = re.compile(r"^(train|test|validation|valid|val)(?=$|[-_.])")
HF_METADATA = b"huggingface"
ROWS_PER_READ = 1024  # rows of the image column read at once while checking


class ParquetSourceError(ValueError):
    """A Parquet folder that cannot be used, naming the field or the file and what is wrong."""


class ParquetLayout(NamedTuple):
    """What `check_layout` found: the classes, and every split's rows as (file, row in it, label), in file order."""

    path: str
    classes: list[str]
    rows: dict[str, list[tuple[str, int, int]]]  # "train" / "val" / "test"
    image_column: str
    label_column: str

    @property
    def has_val(self) -> bool:
        return bool(self.rows.get("val"))

    @property
    def files(self) -> list[str]:
        """Every Parquet file that holds rows, relative to the folder: train's, then validation's, then test's."""
        return list(dict.fromkeys(rel for split in ("train", "val", "test") for rel, _, _ in self.rows.get(split, [])))


def split_of(rel: str) -> str | None:
    """The split a file's relative path names (``train``, ``val``, ``test``), None when none does; ParquetSourceError
    when two of its names name different splits (``train/test-0.parquet``)."""
    found = {SPLIT_WORDS[m.group(1)] for part in rel.removesuffix(SUFFIX).split("/") if (m := _SPLIT.match(part.lower()))}
    if len(found) > 1:
        raise ParquetSourceError(f"{rel}: its name names more than one split ({', '.join(sorted(found))}); rename it")
    return found.pop() if found else None


def open_file(path: str) -> pq.ParquetFile:
    """The Parquet file at ``path`` (local or s3://), opened: only its footer is read."""
    fs, where = filesystem(path)
    try:
        return pq.ParquetFile(fs.open_input_file(where))
    except (pa.ArrowException, OSError, ValueError, EOFError) as exc:
        raise ParquetSourceError(f"{path}: not a readable Parquet file ({' '.join(str(exc).split())[:300]})") from None


def class_names(schema: pa.Schema, column: str) -> list[str] | None:
    """The ClassLabel names of ``column`` in the schema's Hugging Face metadata, or None when it has none."""
    raw = (schema.metadata or {}).get(HF_METADATA)
    try:
        feature = json.loads(raw)["info"]["features"][column] if raw else None
    except (ValueError, KeyError, TypeError):
        return None
    names = feature.get("names") if isinstance(feature, dict) else None
    return [str(name) for name in names] if isinstance(names, list) and names else None


def _check_columns(path: str, schema: pa.Schema, image_column: str, label_column: str) -> None:
    """ParquetSourceError naming the field and the file: a column missing or of a type that is not read."""
    for field, column in (("download.image_column", image_column), ("download.label_column", label_column)):
        if column not in schema.names:
            raise ParquetSourceError(f"{field} {column!r}: {path} has no such column (its columns: {', '.join(schema.names)})")
    image = schema.field(image_column).type
    inner = image.field("bytes").type if pa.types.is_struct(image) and image.get_field_index("bytes") >= 0 else image
    encoded = pa.types.is_binary(inner) or pa.types.is_large_binary(inner)
    if not encoded:
        raise ParquetSourceError(f"download.image_column {image_column!r}: in {path} it is {image}, expected encoded images "
                                 "(a struct {bytes, path}, as the datasets library writes an Image feature, or binary)")
    label = schema.field(label_column).type
    if not (pa.types.is_integer(label) or pa.types.is_string(label) or pa.types.is_large_string(label)):
        raise ParquetSourceError(f"download.label_column {label_column!r}: in {path} it is {label}, expected integers or strings")


def _labels(path: str, parquet: pq.ParquetFile, column: str) -> list:
    """The label column's values; ParquetSourceError naming the file and the row of an empty (null) one."""
    try:
        values = parquet.read(columns=[column]).column(column)
    except (pa.ArrowException, OSError, ValueError, EOFError) as exc:
        raise ParquetSourceError(f"{path}: damaged Parquet data ({' '.join(str(exc).split())[:300]})") from None
    if values.null_count:
        row = int(np.flatnonzero(values.is_null().to_numpy(zero_copy_only=False))[0])
        raise ParquetSourceError(f"{path} row {row}: empty (null) label in download.label_column {column!r}")
    return values.to_pylist()


def check_layout(path: str, image_column: str = "image", label_column: str = "label", field: str = "download.path") -> ParquetLayout:
    """The layout of the Parquet folder ``path``; ParquetSourceError naming the field or the file when it is not one
    (see the module's docstring). Reads every file's footer and label column, not its images."""
    if not is_dir(path):
        raise ParquetSourceError(f"{field} {path}: no such folder")
    listed = [rel for rel in list_files(path, SUFFIX) if not any(part.startswith(".") for part in rel.split("/"))]
    if not listed:
        raise ParquetSourceError(f"{field} {path}: no Parquet files (*.parquet) in it")
    by_split: dict[str, list[str]] = {}
    for rel in listed:
        split = split_of(rel)
        if split is None:
            raise ParquetSourceError(f"{path}/{rel}: its split is not in its name; name it train-*.parquet, test-*.parquet "
                                     "(validation-* optional) or put it in a train/, test/ or validation/ folder")
        by_split.setdefault(split, []).append(rel)
    for split in ("train", "test"):
        if split not in by_split:
            raise ParquetSourceError(f"{field} {path}: no {split} split: no file or folder named {split}*.parquet or {split}/")
    names, raw = None, {}
    for split in ("train", "val", "test"):
        for rel in by_split.get(split, []):
            parquet = open_file(f"{path}/{rel}")
            _check_columns(f"{path}/{rel}", parquet.schema_arrow, image_column, label_column)
            names = names or class_names(parquet.schema_arrow, label_column)
            raw[rel] = _labels(f"{path}/{rel}", parquet, label_column)
    classes = _classes(path, by_split, raw, names, label_column)
    rows: dict[str, list[tuple[str, int, int]]] = {}
    for split in ("train", "val", "test"):
        rows[split] = [(rel, i, _label(path, rel, i, value, classes, split, label_column))
                       for rel in by_split.get(split, []) for i, value in enumerate(raw[rel])]
    for split in ("train", "test"):
        if not rows[split]:
            raise ParquetSourceError(f"{field} {path}: the {split} split's files hold no rows")
    if "val" in by_split and not rows["val"]:
        raise ParquetSourceError(f"{field} {path}: the validation split would be empty: its files "
                                 f"({', '.join(by_split['val'])}) hold no rows; add rows or remove them")
    layout = ParquetLayout(path, classes, rows, image_column, label_column)
    _check_learnable(layout, field)
    return layout


def _classes(path: str, by_split: dict, raw: dict, names: list[str] | None, column: str) -> list[str]:
    """The class names: the ClassLabel's, the sorted training strings, or 0..the largest training integer."""
    if names:
        return names
    train = [value for rel in by_split["train"] for value in raw[rel]]
    if all(isinstance(value, str) for value in train):
        return sorted(set(train))
    bad = [value for value in train if not isinstance(value, int) or value < 0]
    if bad:
        rel, row = next((rel, i) for rel in by_split["train"] for i, v in enumerate(raw[rel]) if v == bad[0])
        raise ParquetSourceError(f"{path}/{rel} row {row}: label {bad[0]!r} in download.label_column {column!r} is not a "
                                 "class: integer labels are 0, 1, ...")
    return [str(i) for i in range(max(train) + 1)]


def _label(path: str, rel: str, row: int, value, classes: list[str], split: str, column: str) -> int:
    """The class index of one label; ParquetSourceError naming the file and the row when it is not a class."""
    if isinstance(value, str) and value in classes:
        return classes.index(value)
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < len(classes):
        return value
    where = "the training rows'" if split != "train" else "the"
    raise ParquetSourceError(f"{path}/{rel} row {row}: label {value!r} in download.label_column {column!r} is not one of "
                             f"{where} {len(classes)} classes ({', '.join(classes[:10])}{', ...' if len(classes) > 10 else ''})")


def _check_learnable(layout: ParquetLayout, field: str) -> None:
    """ParquetSourceError naming the folder and the fix: one class only, or no row left for validation."""
    counts = np.bincount([label for _, _, label in layout.rows["train"]], minlength=len(layout.classes))
    if np.count_nonzero(counts) < 2:
        present = [layout.classes[i] for i in np.flatnonzero(counts)]
        raise ParquetSourceError(f"{field} {layout.path}: the train split has one class ({', '.join(present)}); a classifier "
                                 "needs at least two")
    if not layout.has_val and counts.max() < 2:
        raise ParquetSourceError(f"{field} {layout.path}: the validation split would be empty: without validation files it "
                                 "takes rows from training classes of two rows or more, and every class has one")


def image_bytes(path: str, rel: str, column: str) -> list:
    """The encoded images of one file (bytes, or None for an empty one), in row order."""
    parquet = open_file(f"{path}/{rel}")
    try:
        values = parquet.read(columns=[column]).column(column)
    except (pa.ArrowException, OSError, ValueError, EOFError) as exc:
        raise ParquetSourceError(f"{path}/{rel}: damaged Parquet data ({' '.join(str(exc).split())[:300]})") from None
    if pa.types.is_struct(values.type):
        values = pa.chunked_array([chunk.field("bytes") for chunk in values.chunks], type=values.type.field("bytes").type)
    return values.to_pylist()


def scan(
    layout: ParquetLayout, image_size: int | None, max_pixels: int | None, decode: bool = False, cache: ListingCache | None = None,
) -> tuple[int, int, int]:
    """(channels, height, width) the converted images will have; ParquetSourceError naming the file and row of an image
    that is empty, not an image, over ``max_pixels``, of another size than the first one without ``image_size``, and
    (``decode``) one that cannot be decoded in full. ``cache``: a file it says was checked at this limit (and is
    unchanged) is not read again; what is read is recorded there (the caller keeps it)."""
    channels, first = 1, None
    for rel in layout.files:
        full = decode and not (cache is not None and cache.checked(rel, max_pixels))
        known = cache.header(rel) if cache is not None and not full else None
        if known is None:
            known = _scan_file(layout, rel, image_size, max_pixels, full)
            if cache is not None:
                cache.mark_header(rel, *known)
                if full:
                    cache.mark_checked(rel, max_pixels)
        mode, size = known
        channels = 3 if mode not in GRAY_MODES else channels
        if first is None:
            first = (rel, size)
        elif image_size is None and size != first[1]:
            raise ParquetSourceError(f"{layout.path}/{rel}: {size[0]}x{size[1]} pixels, but {layout.path}/{first[0]} holds "
                                     f"{first[1][0]}x{first[1][1]}; set transform.image_size to resize every image")
    width, height = (image_size, image_size) if image_size is not None else first[1]
    return channels, height, width


def _scan_file(layout: ParquetLayout, rel: str, image_size: int | None, max_pixels: int | None, decode: bool) -> tuple[str, tuple[int, int]]:
    """("L" when every image of the file is gray, else "RGB"; the first image's (width, height))."""
    gray, first = True, None
    for row, data in enumerate(image_bytes(layout.path, rel, layout.image_column)):
        name = f"{layout.path}/{rel} row {row}"
        if not data:
            raise ParquetSourceError(f"{name}: no image (empty bytes in download.image_column {layout.image_column!r})")
        try:
            if decode:
                mode, size = images.check_image(data, name, max_pixels)
            else:
                with images.open_image(data, name, max_pixels) as image:
                    mode, size = image.mode, image.size
        except images.ImageError as exc:
            raise ParquetSourceError(str(exc)) from None
        gray = gray and mode in GRAY_MODES
        if first is None:
            first = size
        elif image_size is None and size != first:
            raise ParquetSourceError(f"{name}: {size[0]}x{size[1]} pixels, but row 0 is {first[0]}x{first[1]}; "
                                     "set transform.image_size to resize every image")
    return ("L" if gray else "RGB"), first or (0, 0)
