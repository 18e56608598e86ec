"""The Parquet layout of a converted dataset, its conversion from IDX files, and its manifest.

Schema (one row per image):

    row_id  int64                     unique across splits, stable: train rows 0..n-1 in file order,
                                      test rows n..n+m-1
    image   fixed_size_binary(H*W*C)  the uint8 pixels, height x width x channels, row-major
                                      (MNIST: 28x28x1, 784 bytes)
    label   int64                     0..classes-1, an index into the manifest's ``classes``

Why ``fixed_size_binary`` and not ``list<uint8>``: it stores no per-row offsets, and a column of
it is one contiguous buffer, so a batch becomes an (N, H*W*C) uint8 array with one
``np.frombuffer`` (no per-row Python objects); the width is part of the type, so a wrong-sized
image cannot be written.

The manifest (``_manifest.json``) records what the data is, and every stage takes it from there:
``"image": {"channels": C, "height": H, "width": W}`` and ``"classes": [name, ...]`` (MNIST:
1x28x28 and "0".."9"; a manifest written before these fields existed is MNIST's).

``"leakage"`` counts the validation and test rows whose image is an exact copy of a training image (a
blake2b hash of each row's pixel bytes, `find_leakage`), with the first few of their row ids.

The training file is split once more: every n-th train row (``validation_every``) goes to
``val/`` for per-epoch validation, so the test split is touched only by evaluation.

Conversion streams one row group at a time (memory stays flat at any size) into a staging
folder that is published together with ``_manifest.json`` (one rename locally; on S3 an upload
with the manifest last); a finished conversion with a verified manifest is skipped on re-run,
and a half-written one is never read.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel

from dataset.formats.idx import IMAGE_BYTES, IMAGE_SHAPE, NUM_CLASSES, SOURCE_FILES, iter_idx_rows
from pipeline_config import ParquetConfig
from storage_io import MANIFEST, filesystem, join, list_files, read_json, sha256_file

FORMAT_VERSION = 1

# What a manifest written before it recorded the image shape and classes describes: MNIST's
# one-channel 28x28 digits 0-9 (the only data there was).
MNIST_CLASSES = tuple(str(digit) for digit in range(NUM_CLASSES))


def schema_for(image_bytes: int) -> pa.Schema:
    """The dataset schema for images of ``image_bytes`` bytes (height x width x channels)."""
    return pa.schema(
        [
            pa.field("row_id", pa.int64(), nullable=False),
            pa.field("image", pa.binary(image_bytes), nullable=False),
            pa.field("label", pa.int64(), nullable=False),
        ]
    )


SCHEMA = schema_for(IMAGE_BYTES)  # MNIST's


SPLITS = ("train", "val", "test")


def image_record(shape: tuple[int, int, int]) -> dict[str, int]:
    """The manifest's ``image`` entry for a (channels, height, width) shape."""
    channels, height, width = shape
    return {"channels": int(channels), "height": int(height), "width": int(width)}


def manifest_data(manifest: dict) -> tuple[tuple[int, int, int], list[str]]:
    """(channels, height, width) and class names a manifest records (MNIST's for a manifest from before they were)."""
    image = manifest.get("image")
    shape = IMAGE_SHAPE if not isinstance(image, dict) else (int(image["channels"]), int(image["height"]), int(image["width"]))
    classes = manifest.get("classes")
    return shape, list(classes) if isinstance(classes, list) and classes else list(MNIST_CLASSES)


class ParquetDataset(BaseModel):
    """A published Parquet dataset: where each split lives, how many rows it has, and what its images are.

    ``image_shape`` and ``classes`` come from the manifest (`manifest_data`); the defaults are
    MNIST's, what every dataset written before the manifest recorded them holds.
    """

    directory: str
    fingerprint: str
    rows: dict[str, int]
    skipped: bool = False
    image_shape: tuple[int, int, int] = IMAGE_SHAPE  # (channels, height, width): what the model is built for
    classes: list[str] = list(MNIST_CLASSES)  # label i is classes[i]
    source: str = "idx"  # the kind of source it was converted from (`dataset.sources.interface.Source.kind`): picks the defaults of transform.augment and mean/std (`dataset.sources.interface.defaults_for`)
    # What the conversion's terminal line says besides the counts: a stored dataset that failed its
    # check and was rebuilt (naming the file), files of an image folder that were passed over.
    notes: list[str] = []
    # Rows of "val" and "test" whose image is an exact copy of a training image (`find_leakage`, from the manifest).
    leakage: dict[str, int] = {}
    # (height, width) of the images as they were, when transform.image_size auto chose their size (`dataset.tensors.sizing`).
    auto_from: tuple[int, int] | None = None

    def split_dir(self, split: str) -> str:
        return join(self.directory, split)

    def terminal_detail(self) -> str:
        """What the conversion stage's closing terminal line adds after its name and seconds."""
        rows = self.rows
        counts = f"{rows.get('train', 0):,} train / {rows.get('val', 0):,} validation / {rows.get('test', 0):,} test rows"
        notes = "".join(f"; {note}" for note in self.notes)
        return f": {counts}{' (verified on storage, reused)' if self.skipped else ''}{notes}"

    @property
    def num_classes(self) -> int:
        """Labels run 0..num_classes-1."""
        return len(self.classes)

    @property
    def image_bytes(self) -> int:
        """Bytes of one image in the ``image`` column (height x width x channels)."""
        return int(np.prod(self.image_shape))


def to_table(row_ids: np.ndarray, images: np.ndarray, labels: np.ndarray) -> pa.Table:
    """Build an Arrow table in the dataset schema from contiguous arrays (no per-row Python objects).

    ``images``: (N, bytes) or (N, ...) uint8; the image width of the schema is its per-row size."""
    images = np.ascontiguousarray(images, dtype=np.uint8)
    width = int(np.prod(images.shape[1:])) if images.ndim > 1 else IMAGE_BYTES
    images = images.reshape(len(images), width)
    image_col = pa.FixedSizeBinaryArray.from_buffers(pa.binary(width), len(images), [None, pa.py_buffer(images)])
    return pa.Table.from_arrays([pa.array(row_ids, pa.int64()), image_col, pa.array(labels, pa.int64())], schema=schema_for(width))


def images_from_column(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """(N, bytes) uint8 view of a ``fixed_size_binary(bytes)`` column (copies only across chunks)."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    width = column.type.byte_width
    data = column.buffers()[1]
    if data is None:
        return np.zeros((0, width), dtype=np.uint8)
    start = column.offset * width
    return np.frombuffer(data, dtype=np.uint8, count=len(column) * width, offset=start).reshape(-1, width)


class SplitWriter:
    """Writes one split as numbered Parquet files of at most ``rows_per_file`` rows."""

    def __init__(self, folder: Path, cfg: ParquetConfig, schema: pa.Schema = SCHEMA):
        self.folder, self.cfg, self.schema = folder, cfg, schema
        self.folder.mkdir(parents=True, exist_ok=True)
        self.writer: pq.ParquetWriter | None = None
        self.rows_in_file = 0
        self.files = 0
        self.rows = 0

    def write(self, table: pa.Table) -> None:
        while table.num_rows:
            if self.writer is None or self.rows_in_file >= self.cfg.rows_per_file:
                self._roll()
            take = min(table.num_rows, self.cfg.rows_per_file - self.rows_in_file)
            self.writer.write_table(table.slice(0, take), row_group_size=self.cfg.rows_per_group)
            self.rows_in_file += take
            self.rows += take
            table = table.slice(take)

    def _roll(self) -> None:
        self.close()
        path = self.folder / f"part-{self.files:05d}.parquet"
        self.writer = pq.ParquetWriter(path, self.schema, compression="zstd")
        self.files += 1
        self.rows_in_file = 0

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def convert(raw_dir: Path, out_dir: Path, cfg: ParquetConfig) -> dict[str, int]:
    """Stream the IDX files in ``raw_dir`` into train/val/test Parquet folders; return row counts."""
    writers = {split: SplitWriter(out_dir / split, cfg) for split in SPLITS}
    next_row_id = 0
    try:
        for split, (images, labels) in SOURCE_FILES.items():
            for pixels, digits in iter_idx_rows(raw_dir / images, raw_dir / labels, cfg.rows_per_group):
                row_ids = np.arange(next_row_id, next_row_id + len(digits), dtype=np.int64)
                next_row_id += len(digits)
                table = to_table(row_ids, pixels, digits)
                if split == "test":
                    writers["test"].write(table)
                    continue
                is_val = (row_ids % cfg.validation_every) == cfg.validation_every - 1
                writers["val"].write(table.filter(pa.array(is_val)))
                writers["train"].write(table.filter(pa.array(~is_val)))
    finally:
        for writer in writers.values():
            writer.close()
    return {split: writer.rows for split, writer in writers.items()}


def build_manifest(
    directory: str | Path,
    fingerprint: str,
    inputs: dict[str, str],
    rows: dict[str, int],
    image_shape: tuple[int, int, int] = IMAGE_SHAPE,
    classes: list[str] | tuple[str, ...] = MNIST_CLASSES,
) -> dict:
    """Manifest of a dataset folder: inputs, row counts, the images' shape and class names, the validation and
    test rows that copy a training image (`find_leakage`), and the sha256 of every Parquet file."""
    files = {name: sha256_file(join(directory, name)) for name in list_files(directory, ".parquet")}
    return {
        "format_version": FORMAT_VERSION, "fingerprint": fingerprint, "inputs": inputs, "rows": rows,
        "image": image_record(image_shape), "classes": list(classes), "files": files, "leakage": find_leakage(directory),
    }


LEAKED_IDS_KEPT = 5  # row ids of copies a manifest names per split


def _row_hashes(directory: str | Path, split: str, with_ids: bool = False):
    """(hashes, row ids) of every row of ``split``: the first 8 bytes of a blake2b of its image bytes, as uint64,
    read one row group's ``image`` column at a time (memory: 8 bytes a row, plus one row group)."""
    fs, where = filesystem(join(directory, split))
    hashes, ids = [], []
    for name in list_files(join(directory, split), ".parquet"):
        with fs.open_input_file(f"{where}/{name}") as handle:
            parquet = pq.ParquetFile(handle)
            for group in range(parquet.num_row_groups):
                table = parquet.read_row_group(group, columns=["row_id", "image"] if with_ids else ["image"])
                images = images_from_column(table.column("image"))
                flat, width = memoryview(np.ascontiguousarray(images)).cast("B"), images.shape[1]
                digests = b"".join([hashlib.blake2b(flat[i * width : (i + 1) * width], digest_size=8).digest() for i in range(len(images))])
                hashes.append(np.frombuffer(digests, dtype="<u8").astype(np.uint64))
                if with_ids:
                    ids.append(table.column("row_id").to_numpy())
    empty = np.zeros(0, dtype=np.uint64)
    return (np.concatenate(hashes) if hashes else empty), (np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64))


def find_leakage(directory: str | Path) -> dict[str, dict]:
    """The ``val`` and ``test`` rows of the dataset in ``directory`` whose image bytes are those of a training row:
    ``{"test": {"rows": n, "row_ids": [the first few]}, "val": {...}}``, each split its own count (0: none).

    Found by a 64-bit blake2b of each row's bytes: the training split's hashes are held (8 bytes a row),
    each other split's rows are looked up in them a row group at a time."""
    train, _ = _row_hashes(directory, "train")
    train = np.unique(train)
    found = {}
    for split in ("val", "test"):
        hashes, ids = _row_hashes(directory, split, with_ids=True)
        copied = np.isin(hashes, train, assume_unique=False)
        found[split] = {"rows": int(copied.sum()), "row_ids": [int(i) for i in np.sort(ids[copied])[:LEAKED_IDS_KEPT]]}
    return found


def manifest_leakage(manifest: dict) -> dict[str, dict] | None:
    """What a manifest records of copies of training images (`find_leakage`), or None for one written before it did."""
    leakage = manifest.get("leakage")
    if not isinstance(leakage, dict):
        return None
    if not all(isinstance(leakage.get(split), dict) and isinstance(leakage[split].get("rows"), int) for split in ("val", "test")):
        return None
    return leakage


def manifest_problem(directory: str, fingerprint: str) -> str | None:
    """Why the dataset in ``directory`` cannot be reused (naming the file), or None when it verifies."""
    manifest_path = join(directory, MANIFEST)
    manifest = read_json(manifest_path)
    if not isinstance(manifest, dict):
        return f"{manifest_path} is missing or unreadable"
    if manifest.get("fingerprint") != fingerprint:
        return f"{manifest_path} describes another build ({manifest.get('fingerprint')!r})"
    files = manifest.get("files") or {}
    on_disk = set(list_files(directory, ".parquet"))
    if not files or set(files) != on_disk:
        extra, missing = sorted(on_disk - set(files)), sorted(set(files) - on_disk)
        return f"{directory}: Parquet files do not match the manifest (missing {missing}, unexpected {extra})"
    for name, digest in files.items():
        if sha256_file(join(directory, name)) != digest:
            return f"{join(directory, name)}: sha256 does not match the manifest (truncated or modified)"
    return None


def verify_manifest(directory: str, fingerprint: str) -> dict | None:
    """The manifest of ``directory`` if it matches ``fingerprint`` and every file's sha256, else None."""
    return None if manifest_problem(directory, fingerprint) else read_json(join(directory, MANIFEST))
