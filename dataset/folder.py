"""A labelled image folder (``download.source=folder``): its checks, its files, its conversion to Parquet.

Layout, as torchvision's ``ImageFolder`` and Hugging Face's ``imagefolder`` read it::

    <path>/train/<class>/*.png|jpg|jpeg
    <path>/test/<class>/...
    <path>/val/<class>/...        optional; without it a seeded stratified split of train/

``<path>`` is a local folder or an ``s3://bucket/prefix``. The class names are train/'s
subfolders, sorted; label i is the i-th. Every check (`check_folder`) runs before any work and
names the path that is wrong. The folder is only read: never copied, modified or deleted.

A local folder's images are decoded in full before any work (`check_source`): a file that stops
short, or one of more than ``download.max_image_pixels`` pixels (from its header), is refused by
name. With a storage root, what earlier runs learned (each file's sha256, that it decoded in full,
and its header) is kept in a `dataset.listing.ListingCache` and reused while a file keeps its size
and mtime: the checks after the first one and the conversion take the shape from it (`image_shape`).
Files that are not images and links to missing files are passed over and counted (`FolderLayout.skipped`;
the conversion's terminal line names the first few). Hidden entries (a name starting with ``.``: a
``.ipynb_checkpoints/`` or ``.git/`` folder, a ``.DS_Store`` or ``._x.png`` file) are never a class or an
image, wherever they are: each is counted once (a hidden folder as one entry, whatever it holds), and the
line says how many ("2 hidden entries skipped"). The dataset's fingerprint and the listing cache are made
of the images only, so a hidden entry added or removed changes neither.

The conversion (`convert_folder`) reads the files with Ray Data in one pass over every split (its
start paid once per run; each row sent to its split's writer by its path), decodes them as
`dataset.images` does (16-bit grayscale scaled to 8 bits), in grayscale when every image is
grayscale and RGB otherwise, resized to ``transform.image_size`` when set, and writes the IDX
conversion's Parquet layout (`dataset.parquet`): row_id, image (H x W x C uint8), label.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

import numpy as np

from dataset import images
from dataset.listing import ListingCache, save_held
from dataset.parquet import SPLITS, _SplitWriter, schema_for, to_table
from pipeline_config import ParquetConfig
from storage_io import StorageLayout, filesystem, is_dir, is_remote, join, list_dirs, list_files, read_bytes, sha256_file

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg")
# PIL modes read as one channel; any other (RGB, RGBA, P, CMYK, ...) makes the dataset RGB.
GRAY_MODES = {"1", "L", "LA", "I", "I;16", "I;16B", "I;16L", "F"}


class FolderError(ValueError):
    """An image folder that cannot be used, naming the path and what is wrong."""


class FolderLayout(NamedTuple):
    """What `check_folder` found: the class names, every split's images (relative paths, labels), and the
    files it passed over (relative paths, each with why: not an image, hidden, a link to a missing file; a hidden
    folder once, as ``train/.ipynb_checkpoints/``)."""

    path: str
    classes: list[str]
    files: dict[str, list[tuple[str, int]]]  # "train" / "val" / "test" -> [(relative path, label)], sorted
    skipped: tuple[str, ...] = ()

    @property
    def has_val(self) -> bool:
        return bool(self.files.get("val"))

    @property
    def hidden(self) -> tuple[str, ...]:
        """The hidden entries passed over (``train/.ipynb_checkpoints/``, ``train/cat/.DS_Store``)."""
        return tuple(entry.removesuffix(HIDDEN) for entry in self.skipped if entry.endswith(HIDDEN))

    def skipped_note(self, shown: int = 3) -> str | None:
        """What the check passed over: the hidden entries counted (``2 hidden entries skipped``), the other
        files counted and the first ``shown`` named; None when there are none."""
        notes = []
        if self.hidden:
            notes.append(f"{len(self.hidden)} hidden {'entry' if len(self.hidden) == 1 else 'entries'} skipped")
        others = [entry for entry in self.skipped if not entry.endswith(HIDDEN)]
        if others:
            more = f" and {len(others) - shown} more" if len(others) > shown else ""
            notes.append(f"{len(others)} file(s) in {self.path} skipped: {', '.join(others[:shown])}{more}")
        return "; ".join(notes) or None


HIDDEN = " (hidden)"


def _hidden_part(rel: str) -> str | None:
    """The hidden entry ``rel`` lies in or is: the path up to its first name that starts with ``.`` (a folder
    with a trailing ``/``), or None when no name in it does."""
    parts = rel.split("/")
    for depth, part in enumerate(parts):
        if part.startswith("."):
            return "/".join(parts[: depth + 1]) + ("/" if depth < len(parts) - 1 else "")
    return None


def _is_image(name: str) -> bool:
    return name.lower().endswith(IMAGE_EXTENSIONS) and _hidden_part(name) is None


def _passed_over(split: str, listed: list[str], hidden_dirs: list[str]) -> list[str]:
    """What one split's listing passes over, each with why: a hidden entry once (a hidden folder for all it
    holds, ``hidden_dirs``: the split's hidden subfolders, listed even when empty), any other file that is
    not a .png/.jpg/.jpeg."""
    hidden = {f"{name}/" for name in hidden_dirs}
    others = []
    for rel in listed:
        part = _hidden_part(rel)
        if part is not None:
            hidden.add(part)
        elif not _is_image(rel):
            others.append(f"{split}/{rel} (not .png/.jpg/.jpeg)")
    return others + [f"{split}/{part}{HIDDEN}" for part in sorted(hidden)]


def _dangling_links(folder: str) -> list[str]:
    """Relative paths of the symbolic links under a local ``folder`` whose target is missing (listings omit them);
    a hidden folder is not looked into, and a hidden link is passed over as hidden."""
    found = []
    for where, dirs, names in os.walk(folder):
        dirs[:] = [name for name in dirs if not name.startswith(".")]
        for name in names:
            if name.startswith("."):
                continue
            full = os.path.join(where, name)
            if os.path.islink(full) and not os.path.exists(full):
                found.append(os.path.relpath(full, folder).replace(os.sep, "/"))
    return sorted(found)


def _check_split(path: str, split: str, classes: list[str], field: str) -> tuple[list[str], list[tuple[str, int]], list[str]]:
    """(class folder names, images as (relative path, label), files passed over) of one split; FolderError naming the path."""
    split_dir = join(path, split)
    folders = list_dirs(split_dir)
    names = [name for name in folders if not name.startswith(".")]  # a hidden folder is never a class
    listed = list_files(split_dir)
    loose = [name for name in listed if "/" not in name and _is_image(name)]
    if loose:
        raise FolderError(f"{join(split_dir, loose[0])}: an image outside a class folder; put it in {split}/<class>/")
    if not names:
        raise FolderError(f"{field} {path}: {split}/ has no class subfolders ({split}/<class>/*.png|jpg)")
    if split != "train":
        unknown = [name for name in names if name not in classes]
        if unknown:
            raise FolderError(
                f"{join(split_dir, unknown[0])}: class {unknown[0]!r} is not in {join(path, 'train')} "
                f"(its classes: {', '.join(classes)})"
            )
    by_class: dict[str, list[str]] = {name: [] for name in names}
    for rel in listed:
        if "/" in rel and _is_image(rel) and rel.split("/", 1)[0] in by_class:
            by_class[rel.split("/", 1)[0]].append(rel)
    rows: list[tuple[str, int]] = []
    for name in names:
        if not by_class[name]:
            raise FolderError(f"{join(split_dir, name)}: no images (*.png, *.jpg, *.jpeg) in this class folder")
        label = (names if split == "train" else classes).index(name)
        rows += [(f"{split}/{rel}", label) for rel in by_class[name]]
    skipped = _passed_over(split, listed, [name for name in folders if name.startswith(".")])
    if not is_remote(path):
        skipped += [f"{split}/{rel} (a link to a missing file)" for rel in _dangling_links(split_dir)]
    return names, rows, skipped


def _check_learnable(layout: FolderLayout, field: str) -> None:
    """FolderError naming the folder and the fix: one class only, or no image left for validation."""
    path, classes = layout.path, layout.classes
    if len(classes) < 2:
        raise FolderError(
            f"{field} {path}: train/ has one class folder ({classes[0]}); a classifier needs at least two: "
            "add a train/<class>/ (and test/<class>/) folder for every other class"
        )
    if not layout.has_val:
        counts = np.bincount([label for _, label in layout.files["train"]], minlength=len(classes))
        if counts.max() < 2:
            raise FolderError(
                f"{field} {path}: the validation split would be empty: without a val/ folder it takes images from "
                "train/ classes of two images or more, and every class in train/ has one; add images to train/<class>/ "
                "or a val/<class>/ folder"
            )


def check_folder(path: str, field: str = "download.path") -> FolderLayout:
    """The layout of the image folder ``path``; FolderError naming the path when it is not one.

    Refused: a missing folder, no ``train/`` or ``test/``, a split without class subfolders or
    with images outside them, a class folder without images, a class in ``test/`` or ``val/``
    that ``train/`` does not have, a ``train/`` of one class, and (without ``val/``) a ``train/``
    whose classes have one image each, which leaves nothing for validation. Files that are not
    images, hidden entries (any name that starts with ``.``) and links to missing files are passed over and
    listed in ``skipped``.
    """
    if not is_dir(path):
        raise FolderError(f"{field} {path}: no such folder")
    splits = list_dirs(path)
    for split in ("train", "test"):
        if split not in splits:
            raise FolderError(
                f"{field} {path}: has no {split}/ folder; expected train/<class>/*.png|jpg, test/<class>/... (and optionally val/<class>/...)"
            )
    classes: list[str] = []
    files: dict[str, list[tuple[str, int]]] = {}
    skipped: list[str] = []
    for split in ("train", "val", "test"):
        if split in splits:
            names, files[split], passed = _check_split(path, split, classes, field)
            classes = names if split == "train" else classes
            skipped += passed
    layout = FolderLayout(path=path, classes=classes, files=files, skipped=tuple(skipped))
    _check_learnable(layout, field)
    return layout


def _check_reachable(path: str, field: str) -> None:
    """An ``s3://`` folder's bucket answers; FolderError with the storage root check's message, naming ``field``."""
    try:
        StorageLayout.create(path, "download-path-check").check_reachable()
    except ValueError as exc:
        raise FolderError(str(exc).replace(f"storage_root {path.rstrip('/')}", f"{field} {path}", 1)) from None


def check_source(cfg, image_size: int | None = None, storage_root: str | None = None) -> FolderLayout | None:
    """Before any work: the layout of ``download.path`` when ``download.source=folder``, else None.

    FolderError naming the path: an ``s3://`` folder whose endpoint or bucket does not answer (the
    storage root's check, `StorageLayout.check_reachable`), a bad layout (`check_folder`), and for a
    local folder every image decoded in full (`scan_images`): a file that is not a readable image or
    stops short, one of more than ``download.max_image_pixels`` pixels, sizes that differ without
    ``transform.image_size``. An ``s3://`` folder's images are opened by the conversion stage only:
    reading every image over the network before any work is too much to spend. ``storage_root``: where
    the listing cache lives (`listing_cache`); an image it says decoded in full at this limit or a
    stricter one, and unchanged since (size, mtime), has its header read only. What the check learns is
    held in this process, not written (`keep_checks` writes it once the run is past every check)."""
    if cfg.source != "folder" or not cfg.path:
        return None
    remote = is_remote(cfg.path)
    if remote:
        _check_reachable(cfg.path, "download.path")
    try:
        layout = check_folder(cfg.path)
    except OSError as exc:  # the listing failed half-way (network, permissions)
        raise FolderError(f"download.path {cfg.path}: cannot list it ({type(exc).__name__}: {exc})") from None
    if not remote:
        cache = listing_cache(layout, storage_root)
        scan_images(layout, image_size, cfg.max_image_pixels, decode=True, cache=cache)
        cache.hold()  # written by `keep_checks` once the run is past every check: a refused run writes nothing
    return layout


def keep_checks(cfg, storage_root: str | None) -> None:
    """Once the run is past every check before its work: write what `check_source` learned of
    ``download.path``'s images (held in this process until now) to the listing cache on ``storage_root``,
    so the next run's checks and the download stage's hashing reuse it. Nothing for other sources."""
    if cfg.source == "folder" and cfg.path and storage_root and not is_remote(cfg.path):
        save_held(storage_root, cfg.path)


def image_shape(
    layout: FolderLayout, image_size: int | None, storage_root: str | None, max_pixels: int | None = None,
) -> tuple[int, int, int]:
    """`scan_images` through the listing cache on ``storage_root``: the headers `check_source` recorded are
    not read again while their files are unchanged (None: every header read). The cache is only read here:
    a check that refuses the run before any work writes nothing on the storage root."""
    return scan_images(layout, image_size, max_pixels, cache=listing_cache(layout, storage_root) if storage_root else None)


def image_paths(layout: FolderLayout) -> list[str]:
    """The relative path of every image the layout names: train/, val/, test/, each in file order."""
    return [rel for split in ("train", "val", "test") for rel, _ in layout.files.get(split, [])]


def listing_cache(layout: FolderLayout, storage_root: str | None) -> ListingCache:
    """The layout's images as listed now (size, mtime) with what earlier runs learned about them, kept on
    ``storage_root`` (None: nothing kept)."""
    return ListingCache(layout.path, image_paths(layout), storage_root)


def folder_files(layout: FolderLayout, cache: ListingCache | None = None) -> dict[str, str]:
    """Relative path -> sha256 of every image the layout names: what the dataset's fingerprint is made of.
    ``cache``: an unchanged file's sha256 is the cached one (the caller saves the cache)."""
    if cache is None:
        return {rel: sha256_file(join(layout.path, rel)) for rel in image_paths(layout)}
    return {rel: cache.sha256(rel) for rel in image_paths(layout)}


def stratified_split(labels: list[int], every: int, seed: int) -> np.ndarray:
    """Positions (into ``labels``) held out for validation: about 1/``every`` of each class, at least
    one from a class of two or more, chosen by ``seed``. The same labels and seed, the same positions."""
    labels_arr = np.asarray(labels, dtype=np.int64)
    rng = np.random.default_rng(seed)
    held: list[np.ndarray] = []
    for label in np.unique(labels_arr):
        where = np.flatnonzero(labels_arr == label)
        count = 0 if len(where) < 2 else max(1, int(round(len(where) / every)))
        held.append(where[rng.permutation(len(where))[:count]])
    return np.sort(np.concatenate(held)) if held else np.zeros(0, dtype=np.int64)


def _read_image(path: str, max_pixels: int | None, decode: bool) -> tuple[str, tuple[int, int]]:
    """(PIL mode, (width, height)) of the image at ``path``: from its header, or (``decode``) after decoding all of it."""
    if decode:
        return images.check_image(read_bytes(path), path, max_pixels)
    if is_remote(path):
        fs, where = filesystem(path)
        handle = fs.open_input_file(where)
    else:  # Python's own file: PIL reads a header in many small reads, each a call into pyarrow otherwise
        handle = open(path, "rb")  # noqa: SIM115 (closed below)
    try:
        with images.open_image(handle, path, max_pixels) as image:
            return image.mode, image.size  # header only: the pixels are not decoded
    finally:
        handle.close()


def scan_images(
    layout: FolderLayout, image_size: int | None, max_pixels: int | None = None, decode: bool = False,
    cache: ListingCache | None = None,
) -> tuple[int, int, int]:
    """(channels, height, width) the converted images will have; FolderError naming a file that cannot be read,
    one of more than ``max_pixels`` pixels (None: no limit), one whose size differs from the first one's when
    ``image_size`` is unset, and (``decode``) one that cannot be decoded in full. ``cache``: a file it says
    was decoded already is not decoded again, an unchanged file's header is taken from it instead of the
    file, and each header read and each file decoded is recorded there (the caller saves it)."""
    channels, first = 1, None
    for split in ("train", "val", "test"):
        for rel, _ in layout.files.get(split, []):
            path = join(layout.path, rel)
            full = decode and not (cache is not None and cache.checked(rel, max_pixels))
            known = cache.header(rel) if cache is not None and not full else None
            if known is not None and max_pixels is not None and known[1][0] * known[1][1] > max_pixels:
                known = None  # read it again: the file's own read names the limit it is over
            try:
                mode, size = known or _read_image(path, max_pixels, full)
            except images.ImageError as exc:
                raise FolderError(str(exc)) from None
            except OSError as exc:  # gone since the listing, unreadable
                raise FolderError(f"{path}: cannot read it ({type(exc).__name__}: {exc})") from None
            if cache is not None:
                cache.mark_header(rel, mode, size)
                if full:
                    cache.mark_checked(rel, max_pixels)
            if mode not in GRAY_MODES:
                channels = 3
            if first is None:
                first = (rel, size)
            elif image_size is None and size != first[1]:
                raise FolderError(
                    f"{path}: {size[0]}x{size[1]} pixels, but {join(layout.path, first[0])} is {first[1][0]}x{first[1][1]}; "
                    "set transform.image_size to resize every image to one square size"
                )
    if first is None:
        raise FolderError(f"download.path {layout.path}: no images")
    width, height = (image_size, image_size) if image_size is not None else first[1]
    return channels, height, width


def _key(path: str) -> str:
    return path.lstrip("/")


def plan_rows(layout: FolderLayout, cfg: ParquetConfig) -> dict[str, list[tuple[str, int, int]]]:
    """Every split's images as (relative path, row_id, label), in row_id order.

    Row ids: train/ from 0 in a random order drawn from ``parquet.split_seed`` (so a window of a few
    row groups mixes the classes, as a streamed split is read: `dataset.windows`), then val/ (when
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


def _decoded(paths: list[str], fs, remote: bool, shape: tuple[int, int, int], resize: bool, max_pixels: int | None,
             num_cpus: float):
    """A Ray Data dataset of the files at ``paths`` (on ``fs``) in their order, each task reading and decoding its
    own files (`dataset.images.read_decode_batch`: no per-file read tasks, no bytes through the object store):
    columns ``image`` (N, H, W, C), ``path`` and ``error``."""
    import ray.data

    channels, height, width = shape
    rows_per_batch = max(1, min(1024, (64 << 20) // (channels * height * width)))  # at most about 64 MB of pixels
    ds = ray.data.from_items([{"path": path} for path in paths], override_num_blocks=-(-len(paths) // rows_per_batch))
    kwargs = {"fs": fs, "shape": shape, "resize": resize, "max_pixels": max_pixels, "prefix": "s3://" if remote else ""}
    ds = ds.map_batches(images.read_decode_batch, fn_kwargs=kwargs, batch_size=rows_per_batch, batch_format="numpy",
                        num_cpus=num_cpus)
    ds.context.execution_options.preserve_order = True
    return ds


def decode_task_cpus() -> float:
    """Logical CPUs each decoding task of `convert_folder` asks for: as many tasks run at once as the cluster
    has CPUs, beside the CPUs the calling process holds (the to-parquet stage holds one, and only routes and
    writes the decoded rows, about a fifth of the work): 0.5 each on 2 CPUs, 0.94 on 16.

    At one whole CPU each, a 2-CPU machine decoded one batch at a time while the stage's CPU sat mostly idle:
    40,000 64x64 RGB PNGs took 7.7-8.4 s, against 6.2-6.5 s two at a time, and the plain PIL loop's 5.3-6.2 s
    (2-core AMD EPYC Zen 4, docs/performance.md)."""
    import ray

    context = ray.get_runtime_context()
    cpus = float(ray.cluster_resources().get("CPU", 1))
    held = float(context.get_assigned_resources().get("CPU", 0)) if context.worker.mode == ray.WORKER_MODE else 0.0
    return round(max(0.25, (cpus - held) / cpus), 3)


class _Router:
    """Decoded rows of any split in; each split's rows out to its writer in ``group``-row tables, in arrival
    order, so a split gets the row groups a pass over that split alone gave it."""

    def __init__(self, writers: dict[str, _SplitWriter], by_path: dict[str, tuple[str, int, int]], group: int):
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
    max_pixels: int | None = None, storage_root: str | None = None,
) -> tuple[dict[str, int], tuple[int, int, int]]:
    """Read the folder's images with Ray Data into train/val/test Parquet folders; (row counts, (C, H, W)).

    One Ray Data pass over every split's files (train, then val, then test, each in `plan_rows` order), each
    row sent to its split's writer by its path with the row id and label `plan_rows` gave it. ``max_pixels``:
    ``download.max_image_pixels`` (None: not checked again; a local folder's images were checked before any work).
    ``storage_root``: where the listing cache is (`image_shape`): the shape comes from the headers the checks
    before the run read, not from a pass over the files; every image's size is checked again as it is decoded.
    ``num_cpus``: what each decoding task asks for (None: `decode_task_cpus`)."""
    shape = image_shape(layout, image_size, storage_root, max_pixels)
    plan = plan_rows(layout, cfg)
    base = filesystem(layout.path)[1].rstrip("/")  # the folder on its filesystem, once (not once per image)
    paths = [f"{base}/{rel}" for planned in plan.values() for rel, _, _ in planned]
    routes = [(split, row_id, label) for split, planned in plan.items() for _, row_id, label in planned]
    writers = {split: _SplitWriter(out_dir / split, cfg, schema_for(int(np.prod(shape)))) for split in plan}
    router = _Router(writers, {_key(p): route for p, route in zip(paths, routes)}, cfg.rows_per_group)
    try:
        if paths:
            fs, remote, resize = filesystem(layout.path)[0], is_remote(layout.path), image_size is not None
            ds = _decoded(paths, fs, remote, shape, resize, max_pixels, decode_task_cpus() if num_cpus is None else num_cpus)
            for batch in ds.iter_batches(batch_size=None, batch_format="numpy"):
                router.add(batch)
        for split, planned in plan.items():
            router.flush(split)
            if router.seen[split] != len(planned):
                raise FolderError(f"{join(layout.path, split)}: Ray Data read {router.seen[split]} images, "
                                  f"the folder lists {len(planned)}")
    finally:
        for writer in writers.values():
            writer.close()
    return {split: writer.rows for split, writer in writers.items()}, shape


def describe(path: str) -> str:
    """``path`` for messages: as given (an s3:// URI) or absolute."""
    return path if is_remote(path) else str(Path(path).expanduser().absolute())
