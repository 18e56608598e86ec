"""The Ray Data transform from Parquet rows to normalized (channels, height, width) float32 tensors.

The shape is the dataset's (`ParquetDataset.image_shape`, from its manifest; MNIST: 1x28x28);
``transform.mean``/``std`` normalize each channel (resolved by the transform stage: an image folder's
own per-channel statistics unless set, `dataset.normalization`); ``transform.augment`` picks the
training augmentation (`dataset.augment`).

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
processes. A larger one streams in windows of row groups (`dataset.windows`): each Ray Data task
reads one window, the shuffle permutes the row groups and the rows within each window, and no
process holds a whole split, so memory stays flat however many images there are.

CPU split: training leaves ``train.data_cpus`` (at least one) logical CPUs free and every Ray
Data task here reserves ``cpus_per_task`` (a fraction), so reads, shuffles and maps always find
room beside the training workers, even when num_workers equals the machine's CPU count.
Measured without it: two workers holding both CPUs leave Ray Data's file-listing task (which
always asks for a whole CPU) waiting forever, and training waits on it.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.fs as pafs
import ray.data
from pydantic import BaseModel
from ray.data._internal.execution.execution_callback import ExecutionCallback

from dataset import windows
from dataset.memory import release_memory
from dataset.augment import augment as augment_images, augmentation, random_affine  # noqa: F401 (random_affine: callers' import)
from dataset.parquet import ParquetDataset, images_from_column, schema_for
from pipeline_config import TransformConfig
from storage_io import filesystem, join, read_json


class TransformSpec(BaseModel):
    """What training and evaluation read: the checked dataset plus the transform settings."""

    dataset: ParquetDataset
    config: TransformConfig
    checks: dict[str, dict]
    manifest: str
    skipped: bool = False  # the checks were recorded for this very dataset and config by an earlier run
    # The in-memory budget the transform stage settled (`transform.in_memory_mb`, or `auto_in_memory_mb`),
    # so every process that reads a split (each training rank, evaluation) takes the same path.
    in_memory_mb: int | None = None
    streamed: tuple[str, ...] = ()  # the splits over that budget, read in windows

    def budget_mb(self) -> int:
        """Decoded MB a split may have to be held in memory: the settled budget, the config's, or `auto_in_memory_mb`."""
        for value in (self.in_memory_mb, self.config.in_memory_mb):
            if value is not None:
                return value
        return auto_in_memory_mb()

    def terminal_detail(self) -> str:
        """What the transform stage's closing terminal line adds after its name and seconds."""
        reused = " (checks of this dataset and config reused)" if self.skipped else ""
        if not self.streamed:
            return reused
        return f"{reused}; {', '.join(self.streamed)} streamed in windows (over the {self.budget_mb():,} MB in-memory budget)"


CHECKS_RECORD_PREFIX = "transform-checks-"


def _config_key(cfg: TransformConfig) -> dict:
    """The transform config as the checks record keys it; an unset image_size is left out (so a record
    written before the field existed still matches: it is read by the conversion, not by the transform)."""
    dumped = cfg.model_dump(mode="json", exclude={"in_memory_mb", "window_mb"})  # how a split is read, not what comes out
    if dumped.get("image_size") is None:
        dumped.pop("image_size", None)
    return dumped


def checks_record_path(spec: TransformSpec) -> str:
    """Where the transform stage records its checks of ``spec.dataset`` under ``spec.config``.

    Beside the Parquet files (it goes when the dataset goes), one file per transform config, so
    a later run with the same verified dataset and config reuses the checks instead of running
    every split through Ray Data again.
    """
    config = json.dumps(_config_key(spec.config), sort_keys=True)
    return join(spec.dataset.directory, f"{CHECKS_RECORD_PREFIX}{hashlib.sha256(config.encode()).hexdigest()[:16]}.json")


def checks_record(spec: TransformSpec, checks: dict[str, dict]) -> dict:
    """What `checks_record_path` holds: the dataset's fingerprint, the config and the checks."""
    return {"fingerprint": spec.dataset.fingerprint, "config": _config_key(spec.config), "checks": checks}


def recorded_checks(spec: TransformSpec, splits: tuple[str, ...]) -> dict[str, dict] | None:
    """The checks an earlier run recorded for this dataset (same fingerprint, same rows) and config, else None."""
    record = read_json(checks_record_path(spec))
    if not isinstance(record, dict) or record != checks_record(spec, record.get("checks")):
        return None
    checks = record["checks"]
    if not isinstance(checks, dict) or set(checks) != set(splits):
        return None
    if any(not isinstance(checks[split], dict) or checks[split].get("rows") != spec.dataset.rows.get(split) for split in splits):
        return None
    return checks


MNIST_SHAPE = (1, 28, 28)  # what a caller that names no shape means: the seeds' digits


def to_chw(images: np.ndarray, shape: tuple[int, int, int]) -> np.ndarray:
    """(N, H*W*C) or (N, H, W, C) pixels as stored (height x width x channels) -> (N, C, H, W)."""
    channels, height, width = shape
    return images.reshape(-1, height, width, channels).transpose(0, 3, 1, 2)


def normalize(
    images: np.ndarray, mean: float | list[float], std: float | list[float], shape: tuple[int, int, int] = MNIST_SHAPE
) -> np.ndarray:
    """Pixels -> float32 (N, C, H, W), ``(x - mean) / std`` on the 0..1 scale; ``mean`` and ``std``: one
    number for every channel or one per channel.

    uint8 input (N, H*W*C) or (N, C, H, W) is scaled by 1/255 first (the seeds' ToTensor);
    float input is taken as already on the 0..1 scale. ``shape``: (C, H, W).
    """
    scaled = images.reshape(-1, *shape).astype(np.float32)
    if images.dtype == np.uint8:
        scaled /= np.float32(255.0)
    per_channel = (-1, 1, 1)  # (C, 1, 1): broadcast over rows, height and width
    return (scaled - np.asarray(mean, np.float32).reshape(per_channel)) / np.asarray(std, np.float32).reshape(per_channel)


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer on a uint64 array: a cheap, well-spread hash (wraps modulo 2**64)."""
    x = x + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def row_hash(row_ids: np.ndarray, seed: int, epoch: int, stream: int) -> np.ndarray:
    """A uint64 per row from (seed, epoch, stream, row_id): the same wherever and whenever it is computed."""
    parts = _mix64(np.array([seed, epoch, stream], dtype=np.uint64))
    key = _mix64(_mix64(parts[0:1] ^ parts[1:2] * _GOLDEN) ^ parts[2:3])
    return _mix64(np.asarray(row_ids).astype(np.uint64) ^ key)


def epoch_seed(seed: int, epoch: int) -> int:
    """The seed of epoch ``epoch``'s shuffle of the training rows (< 2**32, as Ray Data's shuffle needs)."""
    return int(row_hash(np.array([epoch]), seed, epoch, stream=0)[0] >> np.uint64(32))


def row_draws(row_ids: np.ndarray, seed: int, epoch: int) -> np.ndarray:
    """(N, 4) uniforms in [0, 1) per row for `random_affine`, fixed by (seed, epoch, row_id)."""
    bits = np.stack([row_hash(row_ids, seed, epoch, stream) for stream in (1, 2, 3, 4)], 1)
    return (bits >> np.uint64(11)).astype(np.float64) * 2.0**-53


def prepare_batch(
    batch: pa.Table,
    mean: float,
    std: float,
    augment: dict[str, float] | None = None,
    seed: int = 0,
    epoch: int = 0,
    shape: tuple[int, int, int] = MNIST_SHAPE,
) -> dict[str, np.ndarray]:
    """Parquet batch -> {"image": float32 (N,C,H,W), "label": int64 (N,), "row_id": int64 (N,)}.

    ``augment`` (training only): keyword arguments of `dataset.augment.augment` (shift_px, rotate_deg,
    scale); each row's transform is drawn from (seed, epoch, row_id), not from its batch.
    ``shape``: the dataset's (C, H, W).
    """
    row_ids = batch.column("row_id").to_numpy()
    images = to_chw(images_from_column(batch.column("image")), shape)
    if shape[0] == 1:
        images = images[:, 0]  # (N, H, W), as the seeds' digits always were
    if augment:
        images = augment_images(images, row_draws(row_ids, seed, epoch), **augment)
    return {
        "image": normalize(images, mean, std, shape),
        "label": batch.column("label").to_numpy().astype(np.int64),
        "row_id": row_ids.astype(np.int64),
    }


def drop_rows(batch: pa.Table, row_ids: np.ndarray) -> pa.Table:
    """``batch`` without the rows whose ``row_id`` is in ``row_ids`` (rows already trained on)."""
    keep = pc.invert(pc.is_in(batch.column("row_id"), value_set=pa.array(row_ids, type=pa.int64())))
    return batch.filter(keep)


def _parquet_files(spec: TransformSpec, split: str) -> list[pafs.FileInfo]:
    fs, path = filesystem(spec.dataset.split_dir(split))  # a local folder or an S3 prefix
    infos = [i for i in fs.get_file_info(pafs.FileSelector(path, recursive=True)) if i.path.endswith(".parquet")]
    if not infos:
        raise FileNotFoundError(f"{spec.dataset.split_dir(split)}: no Parquet files")
    return sorted(infos, key=lambda info: info.path)


# The in-memory path's copies of a split (the reader's table, its shuffled copy, the blocks in the object
# store, float32 batches, in each process that reads it) measured about 20x the split's pixels summed over
# the run's processes (docs/performance.md, "Folders bigger than memory"). A split is held in memory while
# its pixels are at most this fraction of the smallest node's memory: at 20x, about 8% of the node.
IN_MEMORY_FRACTION = 1 / 256


def auto_in_memory_mb() -> int:
    """``transform.in_memory_mb`` when unset: `IN_MEMORY_FRACTION` of the memory Ray gives the smallest
    alive node (of this machine's physical memory when Ray is not running), in MB."""
    if ray.is_initialized():
        nodes = [n["Resources"].get("memory", 0) for n in ray.nodes() if n.get("Alive")]
        memory = min((m for m in nodes if m), default=0)
    else:
        memory = 0
    if not memory:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(memory * IN_MEMORY_FRACTION / 2**20)


def split_mb(spec: TransformSpec, split: str) -> float:
    """The split's decoded pixels in MB: rows x channels x height x width bytes (from the manifest)."""
    return spec.dataset.rows.get(split, 0) * int(np.prod(spec.dataset.image_shape)) / 2**20


def fits_in_memory(spec: TransformSpec, split: str) -> bool:
    """Whether the split's decoded pixels (`split_mb`) are at most the run's in-memory budget (`TransformSpec.budget_mb`)."""
    return split_mb(spec, split) <= spec.budget_mb()


def split_table(spec: TransformSpec, split: str) -> pa.Table | None:
    """The split's rows in file order, read with pyarrow here (threaded), or None when it does not
    `fits_in_memory` and must stream in windows (`dataset.windows`). One listing of the files."""
    infos = _parquet_files(spec, split)
    if not fits_in_memory(spec, split):
        return None
    fs, _ = filesystem(spec.dataset.split_dir(split))
    return pads.dataset([i.path for i in infos], format="parquet", filesystem=fs).to_table()


def stream_split(
    spec: TransformSpec, split: str, shuffle_seed: int | None = None, exclude: np.ndarray | None = None,
    part: tuple[int, int] | None = None,
) -> ray.data.Dataset:
    """One split's rows streamed in windows of row groups (`dataset.windows`): bounded memory, any size.

    ``shuffle_seed``: None keeps file order; ``exclude`` and ``part`` as `build_split` takes them."""
    fs, planned = _windows_of(spec, split, shuffle_seed, exclude, part)
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


def _windows_of(
    spec: TransformSpec, split: str, shuffle_seed: int | None, exclude: np.ndarray | None = None, part: tuple[int, int] | None = None,
) -> tuple[pafs.FileSystem, list[windows.Window]]:
    """(filesystem, the windows of one pass over ``split``) as `dataset.windows.plan` orders them."""
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
    release_memory()  # what this worker's last task freed: its window and batches (`dataset.memory`)
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
    from ray.data._internal.logical.interfaces import LogicalPlan
    from ray.data._internal.logical.operators.from_operators import FromArrow
    from ray.data._internal.stats import DatasetStats
    from ray.data._internal.util import get_table_block_metadata_schema
    from ray.data.context import DataContext
    from ray.data.dataset import MaterializedDataset

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
    row groups and of the rows within each window when streamed, `dataset.windows`), each row's augmentation is drawn from (seed, epoch,
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
        ds = blocks(_rows_in_memory(table, augment, seed, epoch, exclude, part), cfg.block_rows)
    else:
        ds = _rows_streamed(spec, split, augment, seed, epoch, exclude, part)
        # At most a window of rows a call: 512 rows of 128x128 RGB make 100 MB float32 batches. Each row's
        # draws come from its row_id, so how the rows are batched changes nothing in what comes out.
        rows = min(rows, _window_rows(spec))
    ds = ds.map_batches(
        prepare_batch, batch_format="pyarrow", batch_size=rows, fn_kwargs=_prepare_kwargs(spec, augment, seed, epoch),
        **task_args,
    )
    ds.context.execution_options.preserve_order = True
    return ds


def _prepare_kwargs(spec: TransformSpec, augment: bool, seed: int, epoch: int) -> dict:
    """`prepare_batch`'s keyword arguments for one split of ``spec`` (``augment``: the training split)."""
    cfg = spec.config
    return {
        **dict(zip(("mean", "std"), cfg.per_channel(spec.dataset.image_shape[0]))),
        "augment": augmentation(cfg, spec.dataset.source) if augment else None, "seed": seed, "epoch": epoch,
        "shape": tuple(spec.dataset.image_shape),
    }


def split_batches(spec: TransformSpec, split: str, rows_per_batch: int, seed: int = 0) -> Iterator[dict[str, np.ndarray]]:
    """One pass over ``split`` as `build_split` makes it for epoch 0, in numpy batches of at most
    ``rows_per_batch`` rows: what the transform stage checks.

    A split held in memory goes through Ray Data (`build_split`). A streamed split is read here, one window
    at a time (`stream_split`'s windows, in its order), through the same `prepare_batch`: no Ray Data task
    and nothing in the object store. Through Ray Data, checking the streamed splits of a 40,000-image
    folder left 0.55 GB of object-store pages mapped in two idle workers for the rest of the run
    (docs/performance.md, "Folders bigger than memory"); the stage took as long either way."""
    if fits_in_memory(spec, split):
        yield from build_split(spec, split, seed).iter_batches(batch_size=rows_per_batch, batch_format="numpy")
        return
    augment = split == "train"
    fs, planned = _windows_of(spec, split, epoch_seed(seed, 0) if augment else None)
    kwargs = _prepare_kwargs(spec, augment, seed, 0)
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
    import queue
    import threading

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


def _rows_in_memory(
    table: pa.Table, augment: bool, seed: int, epoch: int, exclude: np.ndarray | None, part: tuple[int, int] | None
) -> pa.Table:
    """`build_split`'s rows of an in-memory split: shuffled (training), without ``exclude``, then every
    n-th row of ``part=(i, n)``, cut to an equal count per part on the training split."""
    if augment:
        table = table.take(np.random.default_rng(epoch_seed(seed, epoch)).permutation(len(table)))
    if exclude is not None and len(exclude):
        table = drop_rows(table, exclude)
    if part is not None and part[1] > 1:
        index, count = part
        table = table.take(np.arange(index, len(table) // count * count if augment else len(table), count))
    return table


def _rows_streamed(
    spec: TransformSpec, split: str, augment: bool, seed: int, epoch: int, exclude: np.ndarray | None,
    part: tuple[int, int] | None,
) -> ray.data.Dataset:
    """`build_split`'s rows of a streamed split: windows of row groups in the epoch's order (training),
    without ``exclude``, then ``part`` (`dataset.windows.plan`)."""
    return stream_split(spec, split, epoch_seed(seed, epoch) if augment else None, exclude, part)


def build_datasets(spec: TransformSpec, seed: int = 0, splits=("train", "val")) -> dict[str, ray.data.Dataset]:
    """Lazy Ray Datasets for ``splits`` (see `build_split`; train as in epoch 0)."""
    return {split: build_split(spec, split, seed) for split in splits}


CHECK_BATCH_BYTES = 16 << 20  # `check_split`'s batches: 4,096 MNIST digits, 341 64x64 RGB images


def check_rows(shape: tuple[int, int, int]) -> int:
    """Rows per batch `check_split` takes: about `CHECK_BATCH_BYTES` of float32 pixels."""
    return max(1, min(4096, CHECK_BATCH_BYTES // (4 * int(np.prod(shape)))))


def check_split(
    batches: Iterable[dict[str, np.ndarray]], expected_rows: int, name: str, shape: tuple[int, int, int] = MNIST_SHAPE,
    num_classes: int = 10,
) -> dict:
    """Check every numpy batch of one split (`split_batches`) against the dataset's (C, H, W) ``shape`` and
    ``num_classes``; return row count, label counts and pixel stats (overall, and per channel when
    there is more than one)."""
    shape = tuple(shape)
    channels = shape[0]
    rows, labels = 0, np.zeros(num_classes, dtype=np.int64)
    total, total_sq = np.zeros(channels), np.zeros(channels)
    for batch in batches:
        image, label = batch["image"], batch["label"]
        if image.dtype != np.float32 or image.shape[1:] != shape:
            raise ValueError(f"{name}: transform produced {image.dtype} {image.shape[1:]}, expected float32 {shape}")
        if not np.isfinite(image).all():
            raise ValueError(f"{name}: transform produced non-finite pixel values")
        if label.min(initial=0) < 0 or label.max(initial=0) > num_classes - 1:
            raise ValueError(f"{name}: labels outside 0..{num_classes - 1}")
        rows += len(label)
        total += image.sum(axis=(0, 2, 3), dtype=np.float64)
        total_sq += np.square(image, dtype=np.float64).sum(axis=(0, 2, 3))
        labels += np.bincount(label, minlength=num_classes)
    if rows != expected_rows:
        raise ValueError(f"{name}: transform yielded {rows} rows, the Parquet manifest says {expected_rows}")
    per_channel = rows * shape[1] * shape[2]
    mean = float(total.sum()) / (per_channel * channels) if rows else 0.0
    std = (float(total_sq.sum()) / (per_channel * channels) - mean**2) ** 0.5 if rows else 0.0
    out = {"rows": rows, "pixel_mean": round(mean, 5), "pixel_std": round(std, 5), "label_counts": labels.tolist()}
    if channels > 1:
        means = total / per_channel if rows else np.zeros(channels)
        stds = np.sqrt(np.maximum(total_sq / per_channel - means**2, 0)) if rows else np.zeros(channels)
        out |= {"channel_mean": [round(float(m), 5) for m in means], "channel_std": [round(float(v), 5) for v in stds]}
    return out

