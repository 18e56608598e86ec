"""A folder of Parquet files as a labelled image dataset (``download.source=parquet``): its layout and checks.

``download.path`` (local or ``s3://``) holds Parquet files whose split is in the file or folder name,
as the Hugging Face hub stores a dataset: ``data/train-00000-of-00001.parquet``,
``default/train/0000.parquet``, a ``train/`` and a ``test/`` folder, ``test.parquet``. ``validation``,
``valid`` and ``val`` name the optional validation split; without it a seeded stratified split of the
training rows is held out (`dataset.formats.folder.stratified_split`, as for an image folder).

Two columns are read, with pyarrow:

- ``download.image_column`` (``image``): the encoded image (PNG or JPEG), a struct ``{bytes, path}`` as the
  ``datasets`` library writes an ``Image`` feature, or plain binary;
- ``download.label_column`` (``label``): integers, or strings whose sorted training values become the
  classes. Integers take their class names from the file's Hugging Face metadata (the ``huggingface`` key of
  the Parquet schema's metadata: ``info.features.<label column>.names``, a ``ClassLabel``) when it has them,
  else ``0``, ``1``, ... up to the largest training label. Every file's labels mean the same classes: all
  integers or all strings, and every file that has ClassLabel names has the same names in the same order.

`check_layout` refuses, before any work, naming the field or the file: no folder, no Parquet files, a file
whose split its name does not tell, no train or test split, a file that is not Parquet, a missing column or
one of another type, two files whose labels would mean different classes (string labels in one, integers in
another; ClassLabel names that differ or come in another order: both files named), an empty (null) label or a
label that is not a class (named by file and row), a test or validation class the training rows lack, one class
only, an empty validation split. Each file is listed once (`listing`): a link into the folder or around it is
not followed, a link out of it is, and the conversion's terminal line names both (`listing_notes`). `scan` decodes the images
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

from storage_io import filesystem, is_dir, list_tree
from storage_io.walk import Listing

SUFFIX = ".parquet"
# The words that name a split at the start of a file or folder name, and the split each names.
SPLIT_WORDS = {"train": "train", "test": "test", "validation": "val", "valid": "val", "val": "val"}
_SPLIT = re.compile(r"^(train|test|validation|valid|val)(?=$|[-_.])")
HF_METADATA = b"huggingface"


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


def listing(path: str) -> Listing:
    """The folder's Parquet files, each once, hidden ones (a name starting with ``.``, at any depth) left out: a link
    into the folder or around it is not followed, a link out of it is (`storage_io.list_tree`)."""
    tree = list_tree(path, SUFFIX)

    def seen(rel: str) -> bool:
        return not any(part.startswith(".") for part in rel.split("/"))

    return Listing([rel for rel in tree.files if seen(rel)], tuple(link for link in tree.links_out if seen(link[0])),
                   tuple(link for link in tree.skipped if seen(link[0])))


def listing_notes(path: str, shown: int = 3) -> list[str]:
    """What the listing line says of the folder's links: those followed out of it, those not followed (a loop, a
    folder or file listed already), each counted and the first ``shown`` named; empty when there are none."""
    tree, notes = listing(path), []
    if tree.links_out:
        more = f" and {len(tree.links_out) - shown} more" if len(tree.links_out) > shown else ""
        named = ", ".join(f"{rel} -> {target}" for rel, target in tree.links_out[:shown])
        notes.append(f"{len(tree.links_out)} link(s) out of {path} followed: {named}{more}")
    if tree.skipped:
        more = f" and {len(tree.skipped) - shown} more" if len(tree.skipped) > shown else ""
        named = ", ".join(f"{rel} ({why})" for rel, why in tree.skipped[:shown])
        notes.append(f"{len(tree.skipped)} link(s) in {path} not followed: {named}{more}")
    return notes


def split_of(rel: str) -> str | None:
    """The split a file's relative path names (``train``, ``val``, ``test``), None when none does; ParquetSourceError
    when two of its names name different splits (``train/test-0.parquet``)."""
    found = {SPLIT_WORDS[m.group(1)] for part in rel.removesuffix(SUFFIX).split("/") if (m := _SPLIT.match(part.lower()))}
    if len(found) > 1:
        raise ParquetSourceError(f"{rel}: its name names more than one split ({', '.join(sorted(found))}); rename it")
    return found.pop() if found else None


def open_file(path: str, buffer_size: int = 0) -> pq.ParquetFile:
    """The Parquet file at ``path`` (local or s3://), opened: only its footer is read. ``buffer_size``: 0 reads a
    column chunk whole, more reads it in buffers of that size, page by page, and nothing ahead (pyarrow's
    ``pre_buffer`` reads every row group asked for at once: a whole file's images held while reading its first)."""
    fs, where = filesystem(path)
    try:
        return pq.ParquetFile(fs.open_input_file(where), buffer_size=buffer_size, pre_buffer=not buffer_size)
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
    listed = listing(path).files
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
    labels, raw = _LabelsAgree(path, label_column), {}
    for split in ("train", "val", "test"):
        for rel in by_split.get(split, []):
            parquet = open_file(f"{path}/{rel}")
            _check_columns(f"{path}/{rel}", parquet.schema_arrow, image_column, label_column)
            labels.add(rel, parquet.schema_arrow)
            raw[rel] = _labels(f"{path}/{rel}", parquet, label_column)
    classes = _classes(path, by_split, raw, labels.names, label_column)
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


class _LabelsAgree:
    """The label column of every file read with one meaning, checked file by file (train's first): ParquetSourceError
    naming two files whose labels would mean different classes: one of string labels and one of integers (an integer
    would be read as an index into the sorted strings), or two ClassLabels whose names differ or come in another
    order (label i would be another class in each). ``names``: the ClassLabel names the files that have them agree on
    (None: no file has any)."""

    def __init__(self, path: str, column: str):
        self.path, self.column = path, column
        self.first: tuple[str, str] | None = None  # (file, "integers" or "strings")
        self.named: tuple[str, list[str]] | None = None  # (the first file with ClassLabel names, its names)

    @property
    def names(self) -> list[str] | None:
        return self.named[1] if self.named else None

    def add(self, rel: str, schema: pa.Schema) -> None:
        path, column = self.path, self.column
        kind = "integers" if pa.types.is_integer(schema.field(column).type) else "strings"
        self.first = self.first or (rel, kind)
        if kind != self.first[1]:
            raise ParquetSourceError(
                f"download.label_column {column!r}: {path}/{self.first[0]} holds {self.first[1]}, {path}/{rel} {kind}; "
                "every file's labels must be of one type, or a label means another class in each file: write them all "
                "as class names or all as ClassLabel integers")
        names = class_names(schema, column)
        if names is None:
            return
        self.named = self.named or (rel, names)
        if names != self.named[1]:
            order = " in order" if sorted(names) == sorted(self.named[1]) else ""
            raise ParquetSourceError(
                f"download.label_column {column!r}: the ClassLabel names of {path}/{self.named[0]} ({_shown(self.named[1])}) "
                f"and of {path}/{rel} ({_shown(names)}) differ{order}; label i would be another class in each file: "
                "write every file with the same ClassLabel names")


def _shown(names: list[str], most: int = 10) -> str:
    return ", ".join(names[:most]) + (", ..." if len(names) > most else "")


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


