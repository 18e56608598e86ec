"""MNIST's IDX files: the four ``.gz`` files of a source, read and checked as they stream.

An IDX file is a big-endian header (magic: two zero bytes, the type 0x08 for uint8, the number
of dimensions, then each dimension's size) followed by the raw values.
"""

from __future__ import annotations

import gzip
import io
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np

IMAGE_BYTES = 28 * 28
# What every dataset converted from IDX files holds: one-channel 28x28 images of the digits 0-9.
IMAGE_SHAPE = (1, 28, 28)
NUM_CLASSES = 10


SOURCE_FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}


# What a damaged .gz file raises while it is read: a bad header, a corrupt or cut-short stream.
GZIP_ERRORS = (EOFError, gzip.BadGzipFile, zlib.error)


def read_idx_header(handle, path: Path, expected_dims: int) -> tuple[int, ...]:
    """Read and check an IDX header (uint8 data, ``expected_dims`` dimensions); return the shape.

    ValueError naming ``path`` when it is not one (a damaged gzip stream included)."""
    try:
        head = handle.read(4)
        if len(head) != 4 or head[:2] != b"\x00\x00" or head[2] != 0x08 or head[3] != expected_dims:
            raise ValueError(f"{path} is not an IDX uint8 file with {expected_dims} dimension(s)")
        raw_shape = handle.read(4 * expected_dims)
    except GZIP_ERRORS as exc:
        raise ValueError(f"{path}: damaged gzip stream ({type(exc).__name__}: {exc})") from None
    if len(raw_shape) != 4 * expected_dims:
        raise ValueError(f"{path}: the IDX header ends early (truncated?)")
    shape = struct.unpack(f">{expected_dims}I", raw_shape)
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
            try:
                pixels = np.frombuffer(img.read(n * IMAGE_BYTES), dtype=np.uint8)
                digits = np.frombuffer(lab.read(n), dtype=np.uint8)
            except GZIP_ERRORS as exc:
                raise ValueError(f"{images} or {labels}: damaged gzip stream near row {start} ({type(exc).__name__}: {exc})") from None
            if pixels.size != n * IMAGE_BYTES or digits.size != n:
                raise ValueError(f"{images} or {labels} ends early (truncated at row {start})")
            if digits.max(initial=0) > 9:
                raise ValueError(f"{labels} has a label above 9 near row {start}")
            yield pixels.reshape(n, IMAGE_BYTES), digits.astype(np.int64)
        for path, handle in ((images, img), (labels, lab)):  # to the end: gzip checks its CRC there
            try:
                trailing = handle.read(1)
            except GZIP_ERRORS as exc:
                raise ValueError(f"{path}: damaged gzip stream ({type(exc).__name__}: {exc})") from None
            if trailing:
                raise ValueError(f"{path} holds more values than its header says (trailing data)")


def read_idx(path: Path) -> np.ndarray:
    """The whole array in an IDX ``.gz`` file (small files; the conversion streams with `iter_idx_rows`)."""
    try:
        data = gzip.decompress(Path(path).read_bytes())
    except GZIP_ERRORS as exc:
        raise ValueError(f"{path}: damaged gzip stream ({type(exc).__name__}: {exc})") from None
    shape = read_idx_header(io.BytesIO(data), path, data[3] if len(data) > 3 else 0)
    values = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * len(shape))
    if values.size != int(np.prod(shape)):
        raise ValueError(f"{path} holds {values.size} values, its header says {shape} (truncated?)")
    return values.reshape(shape)
