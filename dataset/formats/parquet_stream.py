"""A Parquet folder's encoded images in the order a conversion plans them, in bounded memory (`PlannedImages`).

The conversion of a Parquet folder (`dataset.sources.parquet_source.convert_layout`) writes the training rows in an
order drawn from ``parquet.split_seed``, so each output row group takes rows from anywhere in the input
files. Reading a row of a Parquet file alone is not possible (its pages are compressed and encoded), and
holding a split's encoded images in memory grows with the split (20,000 64x64 PNGs: about 250 MB). So a
split's images are read once, in file order, a batch at a time (`dataset.formats.parquet_scan.iter_image_bytes`),
and written as they come to a local spill file beside the dataset being built; the plan then reads them
back one at a time, each from its offset in that file. The process holds a batch while reading and one
image while decoding, whatever the split's size, plus 16 bytes a row for the offsets. A split in file
order (test) goes through the spill file too: its reads then never overlap the writer's buffers.

The spill file is in the conversion's staging folder (local, also for an ``s3://`` storage root), removed
when its split is written or the conversion fails: it takes as much disk as the split's encoded images.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Self

import numpy as np

from dataset.formats.parquet_files import ParquetLayout, open_file
from dataset.formats.parquet_scan import iter_image_bytes


class PlannedImages:
    """The encoded images (bytes; b"" for an empty or null one) of ``planned`` rows, ``(file, row, ...)`` each, in
    that order, as an iterator; a context manager that removes its spill file (``spill``, a local path) on exit."""

    def __init__(self, layout: ParquetLayout, planned: list[tuple], spill: Path):
        self.layout, self.planned, self.spill = layout, planned, spill
        self.files = list(dict.fromkeys(row[0] for row in planned))
        self.index: dict[str, np.ndarray] = {}  # file -> plan position of each of its rows (-1: not in this plan)
        for rel in self.files:
            self.index[rel] = np.full(open_file(f"{layout.path}/{rel}").metadata.num_rows, -1, dtype=np.int64)
        for at, (rel, row, *_) in enumerate(planned):
            self.index[rel][row] = at

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.spill.unlink(missing_ok=True)

    def __iter__(self) -> Iterator[bytes]:
        offsets = np.zeros(len(self.planned), dtype=np.int64)
        lengths = np.zeros(len(self.planned), dtype=np.int64)
        with open(self.spill, "wb") as out:
            end = 0
            for rel in self.files:
                for at, data in zip(self.index[rel].tolist(), iter_image_bytes(self.layout.path, rel, self.layout.image_column)):
                    if at >= 0 and data:
                        out.write(data)
                        offsets[at], lengths[at] = end, len(data)
                        end += len(data)
        handle = os.open(self.spill, os.O_RDONLY)
        try:
            for offset, length in zip(offsets.tolist(), lengths.tolist()):
                yield os.pread(handle, length, offset) if length else b""
        finally:
            os.close(handle)
