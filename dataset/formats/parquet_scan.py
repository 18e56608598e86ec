"""Reading a Parquet folder's encoded images: a batch at a time in bounded memory, each image decoded in full or by its
header, and the shape the converted images will have (through the listing cache when a run has one)."""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from dataset.formats import images
from dataset.formats.folder import GRAY_MODES
from dataset.formats.listing import ListingCache
from dataset.formats.parquet_files import ParquetLayout, ParquetSourceError, open_file

ROWS_PER_READ = 1024  # rows of the image column read at once, at most
READ_BYTES = 1 << 20  # encoded images read at once, about (`batch_rows`)
READ_BUFFER = 1 << 20  # bytes a column chunk is read in (`iter_image_bytes`): never a whole chunk at once


def batch_rows(parquet: pq.ParquetFile, column: str) -> int:
    """Rows of ``column`` read at once: about `READ_BYTES` of its values (from the footer's sizes), 1 to `ROWS_PER_READ`."""
    meta, size = parquet.metadata, 0
    for group in range(meta.num_row_groups):
        chunks = meta.row_group(group)
        size += sum(chunks.column(i).total_uncompressed_size for i in range(chunks.num_columns)
                    if chunks.column(i).path_in_schema.split(".")[0] == column)
    per_row = size / max(1, meta.num_rows)
    return int(max(1, min(ROWS_PER_READ, READ_BYTES // max(1.0, per_row))))


def iter_image_bytes(path: str, rel: str, column: str) -> Iterator[bytes | None]:
    """The encoded images of one file (bytes, or None for an empty one), in row order, one at a time: read in batches
    of about `READ_BYTES`, one batch in memory whatever the file's row groups (its pages are read as needed)."""
    parquet = open_file(f"{path}/{rel}", buffer_size=READ_BUFFER)
    try:
        for batch in parquet.iter_batches(batch_size=batch_rows(parquet, column), columns=[column], use_threads=False):
            values = batch.column(0)
            encoded = (values.field("bytes") if pa.types.is_struct(values.type) else values).to_pylist()
            del batch, values
            yield from encoded
            del encoded  # before the next batch is read: one batch held, not two
            pa.default_memory_pool().release_unused()
    except (pa.ArrowException, OSError, ValueError, EOFError) as exc:
        raise ParquetSourceError(f"{path}/{rel}: damaged Parquet data ({' '.join(str(exc).split())[:300]})") from None


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
    for row, data in enumerate(iter_image_bytes(layout.path, rel, layout.image_column)):
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
