"""A folder of Parquet files as a run's data (``download.source=parquet``): `ParquetSource`.

The layout, the columns and the checks are `dataset.formats.parquet_files`'s. Before any work a local folder's images
are decoded in full (as a local image folder's are), an ``s3://`` folder's footers and labels are read and its
images first by the conversion. What the check learned of each file (its sha256, that its images decoded in
full at a pixel limit, their mode and size) is kept in the listing cache on the storage root
(`dataset.formats.listing`), reused while a file keeps its size and mtime.

The conversion reads each split's encoded images with pyarrow, decodes them as an image folder's are
(`dataset.formats.images`: 16-bit grayscale scaled to 8 bits, resized to ``transform.image_size`` when set, gray when
every image is gray, else RGB) and writes the project's Parquet layout (`dataset.formats.parquet`) with its manifest.
Row ids: the training rows from 0 in an order drawn from ``parquet.split_seed``, then validation, then test,
as for an image folder. A split is converted in bounded memory: its encoded images read once, a batch at a
time, and taken back one at a time in the planned order (`dataset.formats.parquet_stream`).

The folder is the user's: read where it is, never copied, changed or deleted; the watcher watches it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dataset.formats import images
from dataset.formats.folder import stratified_split
from dataset.formats.listing import ListingCache
from dataset.formats.parquet import FORMAT_VERSION, SPLITS, SplitWriter, schema_for, to_table
from dataset.formats.parquet_files import ParquetLayout, ParquetSourceError, check_layout, listing_notes
from dataset.formats.parquet_scan import scan
from dataset.formats.parquet_stream import PlannedImages
from dataset.sources.interface import DataToCome, Defaults, RawData, Source, Written, check_reachable
from dataset.tensors.memory import release_memory
from pipeline_config import ParquetConfig
from storage_io import StorageLayout, is_remote, sha256_json

# How the images are decoded (`dataset.formats.images`, the image folder's decode 2: 16-bit scaled to 8 bits),
# part of the datasets' fingerprint.
DECODE = 2


class ParquetSource(Source):
    """``download.path``: Parquet files of a train and a test split (and optionally validation), named by split."""
    predict_input = "<folder of Parquet files>"

    kind = "parquet"
    title = "Parquet folder"
    options = ("image_column", "label_column")
    defaults = Defaults(measure_stats=True, augment="shifts")

    def _check_layout(self) -> ParquetLayout:
        cfg = self.cfg
        check_reachable(cfg.path, "download.path", ParquetSourceError)
        try:
            return check_layout(cfg.path, cfg.image_column, cfg.label_column)
        except OSError as exc:  # the listing failed half-way (network, permissions)
            raise ParquetSourceError(f"download.path {cfg.path}: cannot list it ({type(exc).__name__}: {exc})") from None

    def _cache(self, layout: ParquetLayout, storage_root: str | None) -> ListingCache:
        return ListingCache(layout.path, layout.files, storage_root)

    def check(self, image_size: int | None, storage_root: str | None, decode: bool = True) -> DataToCome:
        """The layout (ParquetSourceError naming the field or the file, `check_layout`) and, for a local folder, the
        images' shape from every image's header (``decode``: every image decoded in full, `scan`); an ``s3://`` folder's
        channels are known once converted. What a decoding check learns is held in this process, written by
        `keep_checks` once the run is past every check."""
        layout = self._check_layout()
        if is_remote(layout.path):
            return DataToCome((None, image_size, image_size), layout.classes)
        cache = self._cache(layout, storage_root)
        if not decode:
            return DataToCome(scan(layout, image_size, None, cache=cache), layout.classes)
        shape = scan(layout, image_size, self.cfg.max_image_pixels, decode=True, cache=cache)
        cache.hold()
        release_memory()  # what decoding every image took, handed back: the flow's process trains beside it
        return DataToCome(shape, layout.classes)

    def fetch(self, layout: StorageLayout | None, log) -> RawData:
        """The layout checked and every file's sha256 recorded (through the listing cache on ``layout``'s root)."""
        cfg = self.cfg
        found = self._check_layout()
        cache = self._cache(found, layout.root if layout is not None else None)
        files = {rel: cache.sha256(rel) for rel in found.files}
        cache.save()
        counts = {split: len(rows) for split, rows in found.rows.items() if rows}
        log.info("Parquet folder %s: %d files, %d classes (%s), rows %s", cfg.path, len(files), len(found.classes),
                 ", ".join(found.classes[:20]), counts)
        options = {name: getattr(cfg, name) for name in self.options}
        notes = [] if is_remote(cfg.path) else listing_notes(cfg.path)  # links the listing followed out or passed over
        return RawData(source="parquet", url=cfg.path, directory=cfg.path, files=files, skipped=False, options=options, notes=notes)

    def fingerprint(self, raw: RawData, cfg: ParquetConfig, image_size: int | None) -> str:
        key = {"v": FORMAT_VERSION, "source": "parquet", "inputs": raw.files, "options": raw.options, "cfg": cfg.model_dump(),
               "image_size": image_size, "decode": DECODE}
        return sha256_json(key)[:16]

    def write(self, raw, cfg, staging, image_size, max_pixels, storage_root) -> Written:
        """Every split decoded in bounded memory (`convert_layout`), as the download stage listed the files."""
        found = self._check_layout()
        if set(found.files) != set(raw.files):  # the folder changed between the download stage and now
            raise ParquetSourceError(f"{raw.directory}: its Parquet files changed since the download stage listed them; run again")
        shape = scan(found, image_size, max_pixels, cache=self._cache(found, storage_root))
        rows = convert_layout(found, staging, cfg, shape, image_size is not None, max_pixels)
        split = "its validation files" if found.has_val else f"a stratified split of train (parquet.split_seed={cfg.split_seed})"
        detail = f", {shape[1]}x{shape[2]}x{shape[0]} images, {len(found.classes)} classes; validation from {split}"
        return Written(rows, shape, found.classes, detail)


def plan_rows(layout: ParquetLayout, cfg: ParquetConfig) -> dict[str, list[tuple[str, int, int, int]]]:
    """Every split's rows as (file, row in it, row_id, label), in row_id order: the training rows from 0 in an order
    drawn from ``parquet.split_seed``, without validation files `stratified_split` of them held out for validation
    (keeping their row ids), then the validation rows and the test rows in file order."""
    planned: dict[str, list[tuple[str, int, int, int]]] = {split: [] for split in SPLITS}
    train = layout.rows["train"]
    held = set() if layout.has_val else set(stratified_split([label for _, _, label in train], cfg.validation_every, cfg.split_seed).tolist())
    row_id = 0
    for position in np.random.default_rng(cfg.split_seed).permutation(len(train)).tolist():
        rel, row, label = train[position]
        planned["val" if position in held else "train"].append((rel, row, row_id, label))
        row_id += 1
    for split in ("val", "test"):
        for rel, row, label in layout.rows[split] if (split == "test" or layout.has_val) else []:
            planned[split].append((rel, row, row_id, label))
            row_id += 1
    return planned


def convert_layout(
    layout: ParquetLayout, out_dir, cfg: ParquetConfig, shape: tuple[int, int, int], resize: bool, max_pixels: int | None,
) -> dict[str, int]:
    """Decode every split's images into ``out_dir/<split>/`` (`dataset.formats.parquet`'s layout); rows per split.
    ParquetSourceError naming the file and row of an image that is empty, not an image, cut short, over
    ``max_pixels`` or (without ``resize``) of another size."""
    channels, height, width = shape
    size = (width, height) if resize else None
    counts = {}
    for split, planned in plan_rows(layout, cfg).items():
        writer = SplitWriter(out_dir / split, cfg, schema_for(channels * height * width))
        try:
            with PlannedImages(layout, planned, Path(out_dir) / f".{split}.spill") as in_plan:
                encoded = iter(in_plan)  # one image at a time, in plan order (`dataset.formats.parquet_stream`)
                for start in range(0, len(planned), cfg.rows_per_group):
                    group = planned[start : start + cfg.rows_per_group]
                    pixels = np.empty((len(group), height * width * channels), dtype=np.uint8)
                    for i, (rel, row, _, _) in enumerate(group):
                        pixels[i] = _decode(next(encoded), f"{layout.path}/{rel} row {row}", shape, size, max_pixels)
                    ids = np.array([row_id for _, _, row_id, _ in group], dtype=np.int64)
                    labels = np.array([label for _, _, _, label in group], dtype=np.int64)
                    writer.write(to_table(ids, pixels, labels))
                    del pixels
                    release_memory()  # what the group's decoding and compression took, handed back: the peak stays one group's
        finally:
            writer.close()
        counts[split] = writer.rows
    return counts


def _decode(data, name: str, shape: tuple[int, int, int], size: tuple[int, int] | None, max_pixels: int | None) -> np.ndarray:
    """One image's pixels, flattened; ParquetSourceError naming it."""
    channels, height, width = shape
    if not data:
        raise ParquetSourceError(f"{name}: no image (empty bytes)")
    try:
        decoded = images.decode(data, name, channels, size, max_pixels)
    except images.ImageError as exc:
        raise ParquetSourceError(str(exc)) from None
    if decoded.shape != (height, width, channels):
        raise ParquetSourceError(f"{name}: {decoded.shape[1]}x{decoded.shape[0]} pixels, the other images are {width}x{height}; "
                                 "set transform.image_size")
    return decoded.reshape(-1)


SOURCE = ParquetSource
