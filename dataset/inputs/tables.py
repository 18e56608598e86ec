"""Each kind of file to score read as a table: Parquet, IDX, PNG/JPEG (`dataset.inputs.read.read_folder` reads a folder
of them).

What the images must be (their shape, the class names) is the model card's (`training.champion.registry_files.card_data`;
MNIST's 1x28x28 digits 0-9 for a card from before it recorded them). Accepted, in a local folder:

- Parquet files (searched recursively, e.g. a dataset's ``test/`` split) with an ``image`` column
  of H*W*C-byte uint8 images (784 for MNIST), and optionally ``row_id`` and ``label``;
- Parquet files of encoded images, as the Hugging Face ``datasets`` library writes a split (an ``image``
  column of structs ``{bytes, path}`` or binary, a ``label`` column of integers or class names; integers
  are read by the ClassLabel names in the file's metadata when it has them), decoded as the conversion
  decodes them. The columns are those the model's run read (its ``download.image_column`` and
  ``label_column``, ``columns``) in a file that has its image column, else ``image`` and ``label``;
- IDX image files (``*-images-idx3-ubyte``, gzipped or not), each with its labels file
  (``*-labels-idx1-ubyte``) when there is one (one-channel models only);
- PNG or JPEG images: in class subfolders (``<class>/*.png``, the layout of an image folder's
  ``test/``), labelled by the folder's name, which must be one of the model's classes; or
  directly in the folder, unlabelled. They are read as the conversion reads them (resized to the
  card's ``transform.image_size`` when set, then gray or RGB as the model takes them); an image
  of another size without it is refused, naming the file.

The result has the dataset schema (`dataset.formats.parquet.schema_for`): row_id, image, label (-1 when the
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

from dataset.formats import images
from dataset.formats.folder import IMAGE_EXTENSIONS
from dataset.formats.idx import IMAGE_SHAPE
from dataset.formats.parquet import MNIST_CLASSES, schema_for, to_table
from dataset.formats.parquet_files import class_names
from pipeline_config import DownloadConfig

NO_LABEL = -1
IMAGE_SUFFIXES = ("-images-idx3-ubyte", "-images-idx3-ubyte.gz", "-images.idx3-ubyte", "-images.idx3-ubyte.gz")
# Digits one call scores at most (784 MB of pixels); more is refused before reading it. Score a
# larger set in several calls.
MAX_IMAGES = 1_000_000
# Pixels (width x height) one PNG/JPEG may have, read from its header before it is decoded: the default
# of download.max_image_pixels, the limit a training run's images were held to.
MAX_IMAGE_PIXELS = DownloadConfig.model_fields["max_image_pixels"].default
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


def _idx_array(path: Path, dims: int, side: tuple[int, int] = IMAGE_SHAPE[1:]) -> np.ndarray:
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
            if dims == 3 and tuple(shape[1:]) != tuple(side):
                raise InputError(f"{path}: holds {shape[1]}x{shape[2]} images, expected {side[0]}x{side[1]} (the model's size)")
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


def _classes(num_classes: int) -> str:
    return "a digit 0-9" if num_classes == len(MNIST_CLASSES) else f"a class 0-{num_classes - 1}"


def _labels_of(images: Path) -> Path:
    return images.with_name(images.name.replace("-images", "-labels").replace("idx3", "idx1"))


def idx_table(images: Path, first_row: int, shape: tuple[int, int, int], num_classes: int) -> pa.Table:
    if shape[0] != 1:
        raise InputError(f"{images}: IDX images have one channel, the model takes {shape[0]}-channel images")
    pixels = _idx_array(images, 3, shape[1:]).reshape(-1, shape[1] * shape[2])
    labels_path = _labels_of(images)
    labels = np.full(len(pixels), NO_LABEL, dtype=np.int64)
    if labels_path.exists():
        digits = _idx_array(labels_path, 1)
        if len(digits) != len(pixels):
            raise InputError(f"{images} has {len(pixels)} images but {labels_path} has {len(digits)} labels")
        if len(digits) and int(digits.max()) >= num_classes:
            row = int(np.argmax(digits >= num_classes))
            raise InputError(f"{labels_path}: label {int(digits[row])} at row {row} is not {_classes(num_classes)}")
        labels = digits.astype(np.int64)
    return to_table(np.arange(first_row, first_row + len(pixels), dtype=np.int64), pixels, labels)


COLUMNS = ("image", "label")  # the dataset schema's, and download.image_column/label_column's defaults


def columns_of(schema: pa.Schema, columns: tuple[str, str] = COLUMNS) -> tuple[str, str]:
    """(image column, label column) of a file with ``schema``: ``columns`` (the run's ``download.image_column`` and
    ``label_column``) when it has that image column, else the dataset schema's ``image`` and ``label``."""
    return tuple(columns) if columns[0] in schema.names else COLUMNS


def parquet_file(path: Path, shape: tuple[int, int, int] = IMAGE_SHAPE, columns: tuple[str, str] = COLUMNS) -> pq.ParquetFile:
    """The opened Parquet file, its schema checked before any data is read; InputError naming it."""
    try:
        parquet = pq.ParquetFile(path)
        schema = parquet.schema_arrow
    except (pa.ArrowException, OSError, ValueError, EOFError) as exc:
        raise InputError(f"{path}: not a readable Parquet file ({' '.join(str(exc).split())[:300]})") from None
    image_bytes = int(np.prod(shape))
    image, label = columns_of(schema, columns)
    if image in schema.names and is_encoded(schema.field(image).type):
        if label in schema.names and not (pa.types.is_integer(schema.field(label).type) or pa.types.is_string(schema.field(label).type)):
            raise InputError(f"{path}: column '{label}' is {schema.field(label).type}, expected integers or class names")
        return parquet
    if image not in schema.names or schema.field(image).type != pa.binary(image_bytes):
        theirs = f" or the '{columns[0]}' column the model's run read (download.image_column)" if columns[0] != image else ""
        raise InputError(
            f"{path}: needs an 'image' column of {image_bytes}-byte images ({shape[1]}x{shape[2]}x{shape[0]} uint8){theirs}, has {schema}"
        )
    for name in ("row_id", "label"):
        if name in schema.names and not pa.types.is_integer(schema.field(name).type):
            raise InputError(f"{path}: column '{name}' is {schema.field(name).type}, expected integers")
    return parquet


def parquet_table(path: Path, parquet: pq.ParquetFile, num_classes: int = len(MNIST_CLASSES)) -> pa.Table:
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
    bad = (values != NO_LABEL) & ((values < 0) | (values >= num_classes))
    if bad.any():
        row = int(np.argmax(bad))
        raise InputError(f"{path}: label {int(values[row])} at row {row} is not {_classes(num_classes)} (or {NO_LABEL} for unknown)")
    try:
        schema = schema_for(table.schema.field("image").type.byte_width)
        return pa.table({"row_id": row_ids, "image": table.column("image"), "label": labels}).cast(schema)
    except (pa.ArrowException, ValueError) as exc:
        raise InputError(f"{path}: {exc}") from None


def is_encoded(image_type: pa.DataType) -> bool:
    """Whether an ``image`` column holds encoded images (PNG, JPEG): a struct ``{bytes, path}`` as the Hugging
    Face ``datasets`` library writes an Image feature, or variable-length binary."""
    if pa.types.is_struct(image_type) and image_type.get_field_index("bytes") >= 0:
        image_type = image_type.field("bytes").type
    return pa.types.is_binary(image_type) or pa.types.is_large_binary(image_type)


def encoded_parquet_table(
    path: Path, parquet: pq.ParquetFile, shape: tuple[int, int, int], classes: list[str], image_size: int | None,
    columns: tuple[str, str] = COLUMNS,
) -> pa.Table:
    """A Parquet file of encoded images (a Hugging Face dataset's split) decoded as the conversion decodes them;
    labels: integers (mapped by name when the file's ClassLabel names differ from the model's classes) or class
    names. ``columns``: the run's image and label columns (`columns_of`). InputError naming the file and row of
    an image that cannot be read or a label that is not a class."""
    image, label = columns_of(parquet.schema_arrow, columns)
    names = [image, *([label] if label in parquet.schema_arrow.names else [])]
    try:
        table = parquet.read(columns=names)
    except (pa.ArrowException, OSError, ValueError, EOFError) as exc:
        raise InputError(f"{path}: damaged Parquet data ({' '.join(str(exc).split())[:300]})") from None
    column = table.column(image)
    if pa.types.is_struct(column.type):
        column = pa.chunked_array([chunk.field("bytes") for chunk in column.chunks], type=column.type.field("bytes").type)
    encoded = column.to_pylist()
    channels, height, width = shape
    pixels = np.empty((len(encoded), height * width * channels), dtype=np.uint8)
    for row, data in enumerate(encoded):
        name = f"{path} row {row}"
        if not data:
            raise InputError(f"{name}: no image (empty bytes in column '{image}')")
        try:
            with images.open_image(data, name, MAX_IMAGE_PIXELS, None) as image:
                if image_size is None and image.size != (width, height):
                    raise InputError(f"{name}: {image.size[0]}x{image.size[1]} pixels, the model takes {width}x{height}")
                pixels[row] = images.pixels(image, channels, (width, height) if image_size is not None else None, name).reshape(-1)
        except images.ImageError as exc:
            raise InputError(str(exc)) from None
    labels = np.full(len(encoded), NO_LABEL, dtype=np.int64)
    if label in names:
        file_names = class_names(parquet.schema_arrow, label)
        for row, value in enumerate(table.column(label).to_pylist()):
            labels[row] = _class_of(value, classes, file_names, f"{path} row {row}")
    return to_table(np.arange(len(encoded), dtype=np.int64), pixels, labels)


def _class_of(value, classes: list[str], file_names: list[str] | None, name: str) -> int:
    """The model's class index of one label: a class name, or an integer (a name of the file's ClassLabel, when it has
    one); `NO_LABEL` for an empty one or -1. InputError naming the row when it is not one of the model's classes."""
    if value is None or value == NO_LABEL:
        return NO_LABEL
    if isinstance(value, int) and file_names is not None and 0 <= value < len(file_names):
        value = file_names[value]
    if isinstance(value, str) and value in classes:
        return classes.index(value)
    if isinstance(value, int) and file_names is None and 0 <= value < len(classes):
        return value
    raise InputError(f"{name}: label {value!r} is not one of the model's classes ({', '.join(classes[:10])}{', ...' if len(classes) > 10 else ''})")


def image_files(root: Path, classes: list[str]) -> list[tuple[Path, int]]:
    """PNG/JPEG files directly in ``root`` (unlabelled) and in its class subfolders (labelled by the folder's name)."""
    def images_in(folder: Path) -> list[Path]:
        return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS and not p.name.startswith("."))

    found = [(path, NO_LABEL) for path in images_in(root)]
    for sub in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        images = images_in(sub)
        if not images:
            continue
        if sub.name not in classes:
            raise InputError(f"input {sub}: class folder {sub.name!r} is not one of the model's classes ({', '.join(classes)})")
        found += [(path, classes.index(sub.name)) for path in images]
    return found


def image_table(files: list[tuple[Path, int]], shape: tuple[int, int, int], image_size: int | None) -> pa.Table:
    """The images decoded as the conversion decodes them (`dataset.formats.images`: 16-bit scaled to 8 bits, resized
    first, then converted to gray or RGB); InputError naming a file that is not an image, stops short, has
    more than `MAX_IMAGE_PIXELS` pixels or is not the model's size."""
    channels, height, width = shape
    pixels = np.empty((len(files), height * width * channels), dtype=np.uint8)
    for i, (path, _) in enumerate(files):
        try:
            with images.open_image(path.read_bytes(), str(path), MAX_IMAGE_PIXELS, None) as image:
                if image_size is None and image.size != (width, height):
                    raise InputError(f"{path}: {image.size[0]}x{image.size[1]} pixels, the model takes {width}x{height}")
                resize = (width, height) if image_size is not None else None
                pixels[i] = images.pixels(image, channels, resize, str(path)).reshape(-1)
        except InputError:
            raise
        except images.ImageError as exc:
            raise InputError(str(exc)) from None
        except OSError as exc:
            raise InputError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    labels = np.array([label for _, label in files], dtype=np.int64)
    return to_table(np.arange(len(files), dtype=np.int64), pixels, labels)


