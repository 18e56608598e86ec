"""The Ray Data transform from Parquet rows to normalized (channels, height, width) float32 tensors.

The shape is the dataset's (`ParquetDataset.image_shape`, from its manifest; MNIST: 1x28x28);
``transform.mean``/``std`` normalize each channel (resolved by the transform stage: an image folder's
own per-channel statistics unless set, `dataset.tensors.normalization`); ``transform.augment`` picks the
training augmentation (`dataset.tensors.augment`).

The transform is vectorized (one numpy expression per batch, no per-row PIL), and lazy: the
training stage builds the same pipeline (`build_split`) so it streams into Ray Train, with each
epoch's shuffle and augmentation fixed by (seed, epoch). The transform stage (`tasks.transform`)
runs the pipeline once over every split before any training starts, checks what comes out
(shape, dtype, finite values, label range, row counts) and publishes a manifest of it; training
then consumes exactly what was checked.

Reading: a split whose decoded pixels fit the run's budget (``transform.in_memory_mb``; unset, a
share of the smallest node's memory, `auto_in_memory_mb`) is read with pyarrow in the calling
process, shuffled by one permutation and handed to Ray Data as in-memory blocks (`split_table`,
`blocks`): fast for small splits, but its copies cost about 20x the pixels over the run's
processes. A larger one streams in windows of row groups (`dataset.tensors.windows`): each Ray Data task
reads one window, the shuffle permutes the row groups and the rows within each window, and no
process holds a whole split, so memory stays flat however many images there are.

CPU split: training leaves ``train.data_cpus`` (at least one) logical CPUs free and every Ray
Data task here reserves ``cpus_per_task`` (a fraction), so reads, shuffles and maps always find
room beside the training workers, even when num_workers equals the machine's CPU count.
Measured without it: two workers holding both CPUs leave Ray Data's file-listing task (which
always asks for a whole CPU) waiting forever, and training waits on it.
"""

from __future__ import annotations

import time

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.fs as pafs
import ray.data
from ray.data._internal.execution.execution_callback import ExecutionCallback

from dataset.formats.parquet import schema_for
from dataset.tensors import windows
from dataset.tensors.augment import augmentation
from dataset.tensors.batches import (
    epoch_seed,
    prepare_batch,
)
from dataset.tensors.memory import release_memory
from dataset.tensors.spec import (
    TransformSpec,
    fits_in_memory,
)
from storage_io import filesystem


def _parquet_files(spec: TransformSpec, split: str) -> list[pafs.FileInfo]:
    fs, path = filesystem(spec.dataset.split_dir(split))  # a local folder or an S3 prefix
    infos = [i for i in fs.get_file_info(pafs.FileSelector(path, recursive=True)) if i.path.endswith(".parquet")]
    if not infos:
        raise FileNotFoundError(f"{spec.dataset.split_dir(split)}: no Parquet files")
    return sorted(infos, key=lambda info: info.path)


def split_table(spec: TransformSpec, split: str) -> pa.Table | None:
    """The split's rows in file order, read with pyarrow here (threaded), or None when it does not
    `fits_in_memory` and must stream in windows (`dataset.tensors.windows`). One listing of the files."""
    infos = _parquet_files(spec, split)
    if not fits_in_memory(spec, split):
        return None
    fs, _ = filesystem(spec.dataset.split_dir(split))
    return pads.dataset([i.path for i in infos], format="parquet", filesystem=fs).to_table()


def stream_split(
    spec: TransformSpec, split: str, shuffle_seed: int | None = None, exclude: np.ndarray | None = None,
    part: tuple[int, int] | None = None,
) -> ray.data.Dataset:
    """One split's rows streamed in windows of row groups (`dataset.tensors.windows`): bounded memory, any size.

    ``shuffle_seed``: None keeps file order; ``exclude`` and ``part`` as `build_split` takes them."""
    fs, planned = windows_of(spec, split, shuffle_seed, exclude, part)
    # One block per window, made here (`blocks`: no Ray Data read task, which would ask for a whole CPU).
    ds = blocks(pa.table({"window": np.arange(len(planned), dtype=np.int64)}), 1)
    ds = ds.map_batches(_read_windows, batch_format="numpy", batch_size=None, fn_kwargs={"fs": fs, "planned": planned, "image_bytes": int(np.prod(spec.dataset.image_shape))},
                        num_cpus=spec.config.cpus_per_task)
    # Read ahead of the consumer by a few windows at most (Ray Data would otherwise fill a share of the
    # object store, which grows with the machine, not with what the run needs).
    limits = ds.context.execution_options.resource_limits
    ds.context.execution_options.resource_limits = limits.copy(object_store_memory=int(STREAM_AHEAD_WINDOWS * spec.config.window_mb * 2**20))
    # Blocks of about one window, in and out of every map fused onto this read. At Ray Data's 128 MB
    # default, the fused task buffered about eleven windows before `prepare_batch` saw any, then
    # 128 MB of float32 batches before handing them on: about 1 GB in one worker at 40,000 64x64
    # images (2-core AMD EPYC Zen 4), held until the epoch's last window (docs/performance.md).
    ds.context.target_max_block_size = max(1 << 20, int(spec.config.window_mb * 2**20))
    return ds


def windows_of(
    spec: TransformSpec, split: str, shuffle_seed: int | None, exclude: np.ndarray | None = None, part: tuple[int, int] | None = None,
) -> tuple[pafs.FileSystem, list[windows.Window]]:
    """(filesystem, the windows of one pass over ``split``) as `dataset.tensors.windows.plan` orders them."""
    fs, _ = filesystem(spec.dataset.split_dir(split))
    groups, ids = windows.row_groups(fs, [info.path for info in _parquet_files(spec, split)])
    return fs, windows.plan(groups, ids, _window_rows(spec), shuffle_seed, exclude, part)


def _window_rows(spec: TransformSpec) -> int:
    """Rows of decoded pixels in ``transform.window_mb`` (at least one)."""
    return max(1, int(spec.config.window_mb * 2**20) // int(np.prod(spec.dataset.image_shape)))


# How much a streamed split may hold in Ray's object store, in windows of decoded pixels: 16, so about 4
# windows as float32 batches. Reading keeps ahead of training without growing with the data.
STREAM_AHEAD_WINDOWS = 16


def _read_windows(batch: dict, fs: pafs.FileSystem, planned: list[windows.Window], image_bytes: int) -> pa.Table:
    release_memory()  # what this worker's last task freed: its window and batches (`dataset.tensors.memory`)
    tables = [windows.read_window(fs, planned[int(i)]) for i in batch["window"]]
    return pa.concat_tables(tables) if tables else schema_for(image_bytes).empty_table()  # nothing left to read


# How long Ray Data's scheduling loop pauses after a step while the consumer still has output waiting.
IDLE_STEP_PAUSE_S = 0.01


class PauseWhileFed(ExecutionCallback):
    """Ray Data execution callback: after a scheduling step, a pause of `IDLE_STEP_PAUSE_S` while the
    consumer has output waiting.

    Ray Data's scheduling loop (a thread of the consuming process) steps again at once whenever it has
    nothing to wait for: every task paused by backpressure, or a task whose finished output is held back by
    the read-ahead limit. With a consumer slower than the reader (training, scoring) it stepped about a
    thousand times a second, and the thread took most of a core beside the consumer's torch threads:
    50 batches taken 0.3 s apart cost that process 13-15 s of CPU time, against 0.5-2.6 s with this pause,
    and the consumer's waits for its batches were about as long (1.0-8.2 s against 3.0-7.6 s, over runs of
    16-23 s; 2-core AMD EPYC Zen 4, docs/performance.md). A
    consumer waiting for data (nothing in the output queue) gets no pause. Ray Data calls
    ``on_execution_step`` after every step; ``_consumer_idling`` is its own test (Ray is pinned)."""

    def on_execution_step(self, executor) -> None:
        if not executor._consumer_idling():
            time.sleep(IDLE_STEP_PAUSE_S)


def blocks(table: pa.Table, block_rows: int) -> ray.data.Dataset:
    """An in-memory table as a Ray Dataset of ``block_rows``-row blocks: `ray.data.from_arrow`, with
    each block's metadata computed in this process instead of in a Ray task per block.

    ``from_arrow`` asks every block's metadata from a task that reserves a whole CPU. On one machine
    `train.data_cpus` keeps one free; on a cluster of 1-CPU nodes whose training workers each hold
    part of a CPU no node ever has a whole one, and training waited on those tasks forever (the
    cluster test, tests/test_cluster.py). The metadata is a few fields read off the table. Ray
    2.60's own steps (``ray.data.read_api.from_arrow_refs``) otherwise; Ray is pinned.
    """
    from ray.data._internal.logical.interfaces import LogicalPlan  # Ray: only where the cluster is used
    from ray.data._internal.logical.operators.from_operators import FromArrow  # Ray: only where the cluster is used
    from ray.data._internal.stats import DatasetStats  # Ray: only where the cluster is used
    from ray.data._internal.util import get_table_block_metadata_schema  # Ray: only where the cluster is used
    from ray.data.context import DataContext  # Ray: only where the cluster is used
    from ray.data.dataset import MaterializedDataset  # Ray: only where the cluster is used

    tables = [table.slice(start, block_rows) for start in range(0, max(len(table), 1), block_rows)]
    metadata = [get_table_block_metadata_schema(t) for t in tables]
    refs = [ray.put(t) for t in tables]
    stats = DatasetStats(metadata={"FromArrow": metadata}, parent=None)
    context = DataContext.get_current().copy()
    context.custom_execution_callback_classes = [*context.custom_execution_callback_classes, PauseWhileFed]
    return MaterializedDataset(LogicalPlan(FromArrow(refs, metadata), context), context, stats)


def read_split(spec: TransformSpec, split: str) -> ray.data.Dataset:
    """One split's rows in file order: in-memory blocks of its `split_table`, or `stream_split` in windows."""
    table = split_table(spec, split)
    return stream_split(spec, split) if table is None else blocks(table, spec.config.block_rows)


def build_split(
    spec: TransformSpec,
    split: str,
    seed: int = 0,
    epoch: int = 0,
    exclude: np.ndarray | None = None,
    part: tuple[int, int] | None = None,
) -> ray.data.Dataset:
    """One split as a lazy Ray Dataset; train is shuffled and augmented by (seed, epoch).

    Training rows are shuffled by `epoch_seed` (one permutation of the in-memory table, or of the
    row groups and of the rows within each window when streamed, `dataset.tensors.windows`), each row's augmentation is drawn from (seed, epoch,
    row_id), and the order is kept through the pipeline (``preserve_order``): an epoch is the same
    sequence every time it is built, whichever process builds it. ``exclude``: row_ids to leave
    out after the shuffle (the part of an interrupted epoch a checkpoint already covers), so a
    resumed epoch trains on exactly the rows the interrupted attempt had not reached, in the
    order they would have come.

    ``part=(i, n)``: only part i of n, for one of n training workers, without a coordinator actor:
    every n-th row of the (shuffled, excluded) order from the i-th, in memory or streamed; on the
    training split every part gets the same count (DDP ranks must take the same number of steps),
    which leaves out up to n - 1 rows per epoch, as ``streaming_split(equal=True)`` does.
    """
    cfg = spec.config
    task_args = {"num_cpus": cfg.cpus_per_task}
    augment = split == "train"
    table = split_table(spec, split)
    rows = cfg.batch_rows
    if table is not None:
        ds = blocks(rows_in_memory(table, augment, seed, epoch, exclude, part), cfg.block_rows)
    else:
        ds = _rows_streamed(spec, split, augment, seed, epoch, exclude, part)
        # At most a window of rows a call: 512 rows of 128x128 RGB make 100 MB float32 batches. Each row's
        # draws come from its row_id, so how the rows are batched changes nothing in what comes out.
        rows = min(rows, _window_rows(spec))
    ds = ds.map_batches(
        prepare_batch, batch_format="pyarrow", batch_size=rows, fn_kwargs=prepare_kwargs(spec, augment, seed, epoch),
        **task_args,
    )
    ds.context.execution_options.preserve_order = True
    return ds


def prepare_kwargs(spec: TransformSpec, augment: bool, seed: int, epoch: int) -> dict:
    """`prepare_batch`'s keyword arguments for one split of ``spec`` (``augment``: the training split)."""
    cfg = spec.config
    return {
        **dict(zip(("mean", "std"), cfg.per_channel(spec.dataset.image_shape[0]))),
        "augment": augmentation(cfg, spec.dataset.source) if augment else None, "seed": seed, "epoch": epoch,
        "shape": tuple(spec.dataset.image_shape),
    }


def rows_in_memory(
    table: pa.Table, augment: bool, seed: int, epoch: int, exclude: np.ndarray | None, part: tuple[int, int] | None
) -> pa.Table:
    """`build_split`'s rows of an in-memory split: the table's rows at `epoch_positions` (the table itself when
    that is every row in file order, as an unshuffled split whole is)."""
    positions = epoch_positions(table.column("row_id").to_numpy(), augment, seed, epoch, exclude, part)
    return table if not augment and len(positions) == len(table) else table.take(positions)


def epoch_positions(
    row_ids: np.ndarray, augment: bool, seed: int, epoch: int, exclude: np.ndarray | None = None,
    part: tuple[int, int] | None = None,
) -> np.ndarray:
    """The positions (into ``row_ids``, a split's rows in file order) of one epoch's rows of an in-memory split,
    in `build_split`'s order: shuffled by `epoch_seed` (training, ``augment``), without the rows whose row_id
    is in ``exclude``, then every n-th of ``part=(i, n)`` from the i-th, cut to an equal count per part on the
    training split. Shared by the Ray Data path (`rows_in_memory`) and a split held on the device
    (`dataset.tensors.resident`), so both yield the same rows in the same order."""
    positions = np.random.default_rng(epoch_seed(seed, epoch)).permutation(len(row_ids)) if augment else np.arange(len(row_ids))
    if exclude is not None and len(exclude):
        positions = positions[~np.isin(np.asarray(row_ids)[positions], np.asarray(exclude, dtype=np.int64))]
    if part is not None and part[1] > 1:
        index, count = part
        positions = positions[index:len(positions) // count * count if augment else len(positions):count]
    return positions


def _rows_streamed(
    spec: TransformSpec, split: str, augment: bool, seed: int, epoch: int, exclude: np.ndarray | None,
    part: tuple[int, int] | None,
) -> ray.data.Dataset:
    """`build_split`'s rows of a streamed split: windows of row groups in the epoch's order (training),
    without ``exclude``, then ``part`` (`dataset.tensors.windows.plan`)."""
    return stream_split(spec, split, epoch_seed(seed, epoch) if augment else None, exclude, part)


def build_datasets(spec: TransformSpec, seed: int = 0, splits=("train", "val")) -> dict[str, ray.data.Dataset]:
    """Lazy Ray Datasets for ``splits`` (see `build_split`; train as in epoch 0)."""
    return {split: build_split(spec, split, seed) for split in splits}

