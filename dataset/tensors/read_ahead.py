"""One pass over a split in numpy batches without Ray Data (what the transform stage checks and evaluation scores on
one node), and batches read ahead by a thread while the consumer works."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator

import numpy as np

from dataset.tensors import windows
from dataset.tensors.batches import epoch_seed, prepare_batch
from dataset.tensors.memory import release_memory
from dataset.tensors.spec import TransformSpec
from dataset.tensors.transform import prepare_kwargs, rows_in_memory, split_table, windows_of


def split_batches(spec: TransformSpec, split: str, rows_per_batch: int, seed: int = 0) -> Iterator[dict[str, np.ndarray]]:
    """One pass over ``split`` as `build_split` makes it for epoch 0, in numpy batches of at most
    ``rows_per_batch`` rows, made in this process: what the transform stage checks and evaluation scores.

    The same rows in the same order through the same `prepare_batch` that `build_split`'s Ray Data tasks map, without
    Ray Data. A split held in memory is read whole here (`split_table`). Through Ray Data, checking it started Ray
    Data's own actors (its stats and autoscaling coordinators, about 230 MB) and its task workers (about 180 MB),
    which lived on beside the training that followed: the largest part of a small run's peak memory that was not
    training's (docs/design.md, "Data that fits never starts Ray Data before training"). A streamed split is read
    one window at a time (`stream_split`'s windows, in its order): nothing in the object store. Through Ray Data,
    checking the streamed splits of a 40,000-image folder left 0.55 GB of object-store pages mapped in two idle
    workers for the rest of the run (docs/performance.md, "Folders bigger than memory"); the stage took as long
    either way."""
    augment = split == "train"
    kwargs = prepare_kwargs(spec, augment, seed, 0)
    table = split_table(spec, split)
    if table is not None:
        table = rows_in_memory(table, augment, seed, 0, None, None)
        for start in range(0, table.num_rows, rows_per_batch):
            yield prepare_batch(table.slice(start, rows_per_batch), **kwargs)
        return
    fs, planned = windows_of(spec, split, epoch_seed(seed, 0) if augment else None)
    for window in planned:
        release_memory()  # the last window's rows and batches
        table = windows.read_window(fs, window)
        for start in range(0, table.num_rows, rows_per_batch):
            yield prepare_batch(table.slice(start, rows_per_batch), **kwargs)


def read_ahead(batches: Iterable[dict[str, np.ndarray]], depth: int = 2) -> Iterator[dict[str, np.ndarray]]:
    """``batches`` produced by a thread of this process up to ``depth`` ahead of the consumer: reading a
    streamed split's windows (pyarrow, numpy) overlaps with scoring them (torch), which both let go of the
    GIL for most of their work. An exception in the reading is raised here, at the batch it stopped at;
    a consumer that stops early stops the thread."""
    done, stop = object(), threading.Event()
    ready: queue.Queue = queue.Queue(maxsize=depth)

    def put(item) -> bool:
        while not stop.is_set():
            try:
                ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for batch in batches:
                if not put(batch):
                    return
            put(done)
        except BaseException as exc:  # handed to the consumer
            put(exc)

    thread = threading.Thread(target=produce, name="read-ahead", daemon=True)
    thread.start()
    try:
        while (item := ready.get()) is not done:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        thread.join()
