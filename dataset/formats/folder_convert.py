"""An image folder's conversion to Parquet (``download.source=folder``): every image read and decoded in one pass.

`convert_folder` reads the files in one pass over every split (each row sent to its split's writer by its path):
on one node, or when its decoded pixels fit the in-memory budget, in the stage's own process by a few threads
(`decodes_here`), else (a large folder on a cluster) with Ray Data's tasks, their start paid once per run. Either
way it decodes them as `dataset.formats.images` does (16-bit grayscale scaled to 8 bits), in grayscale when every image is grayscale and RGB otherwise, resized to
``transform.image_size`` when set, and writes the IDX conversion's Parquet layout (`dataset.formats.parquet`):
row_id, image (H x W x C uint8), label. The folder's checks and listing are `dataset.formats.folder`'s.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from dataset.formats import images
from dataset.formats.folder import FolderError, FolderLayout, stratified_split
from dataset.formats.folder_scan import decode_task_cpus, image_shape
from dataset.formats.parquet import SPLITS, SplitWriter, schema_for, to_table
from dataset.tensors.spec import auto_in_memory_mb
from pipeline_config import ParquetConfig
from storage_io import filesystem, is_remote, join


def _key(path: str) -> str:
    return path.lstrip("/")


def plan_rows(layout: FolderLayout, cfg: ParquetConfig) -> dict[str, list[tuple[str, int, int]]]:
    """Every split's images as (relative path, row_id, label), in row_id order.

    Row ids: train/ from 0 in a random order drawn from ``parquet.split_seed`` (so a window of a few
    row groups mixes the classes, as a streamed split is read: `dataset.tensors.windows`), then val/ (when
    there is one) and test/ in file order. Without a val/ folder, `stratified_split`
    (``parquet.validation_every``, ``parquet.split_seed``) moves some of train/'s rows to val,
    keeping their row ids."""
    planned: dict[str, list[tuple[str, int, int]]] = {split: [] for split in SPLITS}
    row_id = 0
    train = layout.files["train"]
    held = set(stratified_split([label for _, label in train], cfg.validation_every, cfg.split_seed).tolist()) if not layout.has_val else set()
    for position in np.random.default_rng(cfg.split_seed).permutation(len(train)).tolist():
        rel, label = train[position]
        planned["val" if position in held else "train"].append((rel, row_id, label))
        row_id += 1
    for split in ("val", "test"):
        if split == "val" and not layout.has_val:
            continue
        for rel, label in layout.files[split]:
            planned[split].append((rel, row_id, label))
            row_id += 1
    return planned


def decodes_here(images: int, shape: tuple[int, int, int], nodes: int) -> bool:
    """Whether the stage's own process decodes a folder of ``images`` images of ``shape`` on a cluster of ``nodes``
    alive nodes: always on one node, and on a cluster when the decoded pixels fit the budget a split may hold in
    memory (`dataset.tensors.spec.auto_in_memory_mb`); a larger folder on a cluster is spread over its nodes by Ray
    Data's tasks. On one node Ray Data's tasks only started processes: its actors (its stats and autoscaling
    coordinators, about 230 MB) and task workers (200-400 MB) stayed beside the training that followed
    (docs/design.md, "Data that fits never starts Ray Data before training"), and a plain loop in one process
    already decoded 40,000 64x64 PNGs faster than Ray Data's tasks on 2 cores (5.3-6.2 s against 6.2-6.5 s, Zen 4)."""
    return nodes <= 1 or images * int(np.prod(shape)) <= auto_in_memory_mb() * 2**20


def _alive_nodes() -> int:
    """Alive nodes of the Ray cluster this process is connected to (1 without one)."""
    import ray  # Ray: only where the cluster is used

    return sum(1 for node in ray.nodes() if node.get("Alive")) if ray.is_initialized() else 1


def _rows_per_batch(shape: tuple[int, int, int], most: int) -> int:
    """Images a decoding batch takes: at most ``most`` and about 64 MB of pixels."""
    return max(1, min(most, (64 << 20) // int(np.prod(shape))))


# Threads decoding a folder in the stage's process (Pillow lets go of the GIL while it decodes): one per CPU this
# process may run on, at most this many; the images each takes at a time, few enough that a few thousand images
# keep every thread busy; and the batches asked for ahead of the one being written, per thread (what bounds the
# memory whatever the folder's size).
MOST_DECODE_THREADS = 8
ROWS_PER_THREAD_BATCH = 128
AHEAD_PER_THREAD = 2


def _decoded_here(paths: list[str], fs, prefix: str, shape: tuple[int, int, int], resize: bool,
                  max_pixels: int | None) -> Iterator[dict]:
    """The files at ``paths`` read and decoded in this process by a thread per CPU (at most `MOST_DECODE_THREADS`),
    batches in their order, each through the function Ray Data's tasks map (`dataset.formats.images.read_decode_batch`),
    at most `AHEAD_PER_THREAD` batches a thread ahead of the caller."""
    rows = _rows_per_batch(shape, ROWS_PER_THREAD_BATCH)
    threads = min(MOST_DECODE_THREADS, len(os.sched_getaffinity(0)))
    pool = ThreadPoolExecutor(threads, thread_name_prefix="decode")
    pending: deque = deque()
    try:
        for start in range(0, len(paths), rows):
            batch = {"path": np.asarray(paths[start:start + rows])}
            pending.append(pool.submit(images.read_decode_batch, batch, fs, shape, resize, max_pixels, prefix))
            if len(pending) > AHEAD_PER_THREAD * threads:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # a caller that stopped early (a bad file) leaves nothing running


def _decoded(paths: list[str], fs, remote: bool, shape: tuple[int, int, int], resize: bool, max_pixels: int | None,
             num_cpus: float):
    """A Ray Data dataset of the files at ``paths`` (on ``fs``) in their order, each task reading and decoding its
    own files (`dataset.formats.images.read_decode_batch`: no per-file read tasks, no bytes through the object store):
    columns ``image`` (N, H, W, C), ``path`` and ``error``."""
    import ray.data  # Ray: only where the cluster is used

    rows_per_batch = _rows_per_batch(shape, 1024)
    ds = ray.data.from_items([{"path": path} for path in paths], override_num_blocks=-(-len(paths) // rows_per_batch))
    kwargs = {"fs": fs, "shape": shape, "resize": resize, "max_pixels": max_pixels, "prefix": "s3://" if remote else ""}
    ds = ds.map_batches(images.read_decode_batch, fn_kwargs=kwargs, batch_size=rows_per_batch, batch_format="numpy",
                        num_cpus=num_cpus)
    ds.context.execution_options.preserve_order = True
    return ds


class _Router:
    """Decoded rows of any split in; each split's rows out to its writer in ``group``-row tables, in arrival
    order, so a split gets the row groups a pass over that split alone gave it."""

    def __init__(self, writers: dict[str, SplitWriter], by_path: dict[str, tuple[str, int, int]], group: int):
        self.writers, self.by_path, self.group = writers, by_path, group
        self.pending: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {split: [] for split in writers}
        self.seen = dict.fromkeys(writers, 0)

    def add(self, batch: dict) -> None:
        """Route ``batch``; FolderError naming its first file that was not read, not decoded or not the size."""
        if any(batch["error"]):
            raise FolderError(next(message for message in batch["error"] if message))
        planned = [self.by_path[_key(p)] for p in batch["path"]]
        splits = np.array([split for split, _, _ in planned])
        ids_labels = np.array([row[1:] for row in planned], dtype=np.int64).reshape(-1, 2)
        pixels = batch["image"].reshape(len(planned), -1)
        for split in dict.fromkeys(splits.tolist()):
            where = np.flatnonzero(splits == split)
            self.pending[split].append((ids_labels[where], pixels[where]))
            self.seen[split] += len(where)
            if sum(len(ids) for ids, _ in self.pending[split]) >= self.group:
                self.flush(split, final=False)

    def flush(self, split: str, final: bool = True) -> None:
        """Write ``split``'s pending rows in ``group``-row tables: all of them (``final``) or whole groups only."""
        if not self.pending[split]:
            return
        ids, pixels = (np.concatenate(part) for part in zip(*self.pending[split]))
        full = len(ids) if final else len(ids) - len(ids) % self.group
        for rows in (slice(start, min(start + self.group, full)) for start in range(0, full, self.group)):
            self.writers[split].write(to_table(ids[rows, 0], pixels[rows], ids[rows, 1]))
        self.pending[split] = [(ids[full:], pixels[full:])] if full < len(ids) else []


def convert_folder(
    layout: FolderLayout, out_dir: Path, cfg: ParquetConfig, image_size: int | None, num_cpus: float | None = None,
    max_pixels: int | None = None, storage_root: str | None = None, here: bool | None = None,
) -> tuple[dict[str, int], tuple[int, int, int]]:
    """Read the folder's images into train/val/test Parquet folders; (row counts, (C, H, W)).

    One pass over every split's files (train, then val, then test, each in `plan_rows` order), each row sent to its
    split's writer by its path with the row id and label `plan_rows` gave it: in this process when ``here`` (unset:
    `decodes_here`), else with Ray Data's tasks; the same rows and files either way. ``max_pixels``:
    ``download.max_image_pixels`` (None: not checked again; a local folder's images were checked before any work).
    ``storage_root``: where the listing cache is (`image_shape`): the shape comes from the headers the checks
    before the run read, not from a pass over the files; every image's size is checked again as it is decoded.
    ``num_cpus``: what each decoding task asks for (None: `decode_task_cpus`)."""
    shape = image_shape(layout, image_size, storage_root, max_pixels)
    plan = plan_rows(layout, cfg)
    base = filesystem(layout.path)[1].rstrip("/")  # the folder on its filesystem, once (not once per image)
    paths = [f"{base}/{rel}" for planned in plan.values() for rel, _, _ in planned]
    routes = [(split, row_id, label) for split, planned in plan.items() for _, row_id, label in planned]
    writers = {split: SplitWriter(out_dir / split, cfg, schema_for(int(np.prod(shape)))) for split in plan}
    router = _Router(writers, {_key(p): route for p, route in zip(paths, routes)}, cfg.rows_per_group)
    try:
        if paths:
            fs, remote, resize = filesystem(layout.path)[0], is_remote(layout.path), image_size is not None
            if decodes_here(len(paths), shape, _alive_nodes()) if here is None else here:
                batches = _decoded_here(paths, fs, "s3://" if remote else "", shape, resize, max_pixels)
            else:
                ds = _decoded(paths, fs, remote, shape, resize, max_pixels, decode_task_cpus() if num_cpus is None else num_cpus)
                batches = ds.iter_batches(batch_size=None, batch_format="numpy")
            for batch in batches:
                router.add(batch)
        for split, planned in plan.items():
            router.flush(split)
            if router.seen[split] != len(planned):
                raise FolderError(f"{join(layout.path, split)}: {router.seen[split]} images read, "
                                  f"the folder lists {len(planned)}")
    finally:
        for writer in writers.values():
            writer.close()
    return {split: writer.rows for split, writer in writers.items()}, shape
