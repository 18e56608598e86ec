"""A split too big for memory, streamed in windows of row groups: bounded memory, one fixed order per (seed, epoch).

A streamed split is read by Ray Data tasks, each reading one **window**: a few of the split's Parquet
row groups, about ``transform.window_mb`` of decoded pixels. The order of an epoch is planned here,
in the calling process, from the row groups' ``row_id`` column only (8 bytes a row):

- training (``shuffle``): the row groups in a permutation drawn from `epoch_seed`, cut into windows,
  the rows of each window permuted by the same generator; other splits: file order, unshuffled;
- ``exclude``: row ids to leave out after the shuffle (what an interrupted attempt trained on), so a
  resumed epoch is the interrupted one without those rows, in the order they would have come;
- ``part=(i, n)``: every n-th row of that order from the i-th, as the in-memory path cuts it, and on
  the training split an equal count for every part (DDP ranks take the same number of steps).

So each task gets the positions it must return, and nothing waits on a coordinator: any world size,
the same rows. A window is the unit of memory and of shuffling: the conversion writes an image
folder's training rows in a seeded random order (`dataset.formats.folder.plan_rows`), so a window of a few
row groups already mixes the classes, as MNIST's IDX order does.

Memory: a task holds one window; Ray Data's backpressure bounds how many run ahead. No process holds
a whole split, however many images it has.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from dataset.tensors.memory import release_memory


class Window(NamedTuple):
    """One task's read: row groups (file, index within it) and the positions of their concatenated rows to return, in order."""

    groups: tuple[tuple[str, int], ...]
    take: np.ndarray


def row_groups(fs: pafs.FileSystem, paths: list[str]) -> tuple[list[tuple[str, int]], list[np.ndarray]]:
    """Every row group of ``paths`` in file order, with its ``row_id``s (the only column read)."""
    groups, ids = [], []
    for path in paths:
        with fs.open_input_file(path) as handle:
            parquet = pq.ParquetFile(handle)
            for index in range(parquet.metadata.num_row_groups):
                groups.append((path, index))
                ids.append(parquet.read_row_group(index, columns=["row_id"]).column(0).to_numpy())
    return groups, ids


def plan(
    groups: list[tuple[str, int]],
    ids: list[np.ndarray],
    window_rows: int,
    shuffle_seed: int | None = None,
    exclude: np.ndarray | None = None,
    part: tuple[int, int] | None = None,
) -> list[Window]:
    """The windows of one pass over a split, in order (see the module's docstring).

    ``window_rows``: rows per window, at least one row group each; ``shuffle_seed``: None reads in file
    order, else the seed of the permutations (training); ``part``: ``(i, n)``, cut to an equal count per
    part when shuffled (training)."""
    rng = np.random.default_rng(shuffle_seed) if shuffle_seed is not None else None
    order = rng.permutation(len(groups)) if rng is not None else np.arange(len(groups))
    windows: list[list[int]] = [[]]
    rows = 0
    for index in order.tolist():
        if rows >= window_rows:
            windows.append([])
            rows = 0
        windows[-1].append(index)
        rows += len(ids[index])
    planned: list[tuple[tuple[tuple[str, int], ...], np.ndarray, np.ndarray]] = []
    for members in windows:
        window_ids = np.concatenate([ids[i] for i in members]) if members else np.zeros(0, np.int64)
        positions = rng.permutation(len(window_ids)) if rng is not None else np.arange(len(window_ids))
        if exclude is not None and len(exclude):
            positions = positions[~np.isin(window_ids[positions], exclude)]
        planned.append((tuple(groups[i] for i in members), positions, window_ids))
    if part is not None and part[1] > 1:
        index, count = part
        total = sum(len(positions) for _, positions, _ in planned)
        end = total // count * count if shuffle_seed is not None else total
        start, cut = 0, []
        for members, positions, window_ids in planned:
            where = np.arange(start, start + len(positions))
            cut.append((members, positions[(where % count == index) & (where < end)], window_ids))
            start += len(positions)
        planned = cut
    return [Window(members, positions) for members, positions, _ in planned if len(positions)]


def read_window(fs: pafs.FileSystem, window: Window) -> pa.Table:
    """The rows ``window`` names, in its order (each of its row groups read once)."""
    tables = []
    for path, index in window.groups:
        with fs.open_input_file(path) as handle:
            tables.append(pq.ParquetFile(handle).read_row_group(index))
    return pa.concat_tables(tables).take(pa.array(window.take))


def read_rows(fs: pafs.FileSystem, paths: list[str], positions=None, row_ids=None) -> pa.Table:
    """A few rows of the Parquet files ``paths``, by position (in file order) or by ``row_id``, in the order asked.

    Only the row groups that hold them are read, one at a time, and the memory they took is handed back:
    a report's nine pictures from a split of 4,000 images of 128x128 held 0.5 GB in the flow's process while
    the whole split was read for them, 0.25 GB with only their row groups read and nothing handed back
    (docs/performance.md, "Folders bigger than memory"). IndexError for a position past the end; KeyError
    whose argument is the list of ``row_id``s that are not there."""
    groups, ids = row_groups(fs, paths)
    starts = np.cumsum([0] + [len(group_ids) for group_ids in ids])
    if row_ids is not None:
        every = np.concatenate(ids) if ids else np.zeros(0, np.int64)
        where = {int(rid): at for at, rid in enumerate(every.tolist())}
        missing = [int(rid) for rid in row_ids if int(rid) not in where]
        if missing:
            raise KeyError(missing)
        wanted = np.array([where[int(rid)] for rid in row_ids], dtype=np.int64)
    else:
        wanted = np.asarray(positions, dtype=np.int64).reshape(-1)
        if len(wanted) and (wanted.min() < 0 or wanted.max() >= starts[-1]):
            raise IndexError(f"row positions {wanted.tolist()} out of range for {starts[-1]} rows")
    group_of = np.searchsorted(starts, wanted, side="right") - 1
    pieces, placed = [], []
    for group in np.unique(group_of).tolist():
        at = np.flatnonzero(group_of == group)
        pieces.append(read_window(fs, Window((groups[group],), wanted[at] - starts[group])))
        placed.extend(at.tolist())
    if not pieces:
        return pq.read_schema(paths[0], filesystem=fs).empty_table()
    rows = pa.concat_tables(pieces).take(pa.array(np.argsort(placed)))
    del pieces
    release_memory()  # the row groups read for these rows: kept by Arrow's pool and malloc otherwise
    return rows
