"""A labelled image folder (``download.source=folder``): its checks, its files, its conversion to Parquet.

Layout, as torchvision's ``ImageFolder`` and Hugging Face's ``imagefolder`` read it::

    <path>/train/<class>/*.png|jpg|jpeg
    <path>/test/<class>/...
    <path>/val/<class>/...        optional; without it a seeded stratified split of train/

``<path>`` is a local folder or an ``s3://bucket/prefix``. The class names are train/'s
subfolders, sorted; label i is the i-th. Every check (`check_folder`) runs before any work and
names the path that is wrong. The folder is only read: never copied, modified or deleted.

The conversion (`convert_folder`) reads the images with Ray Data (``ray.data.read_images``, one
split at a time, in file order), in grayscale when every image is grayscale and RGB otherwise,
resized to ``transform.image_size`` when that is set, and writes the same Parquet layout as the
IDX conversion (`dataset.parquet`): row_id, image (height x width x channels uint8), label.
"""

from __future__ import annotations

import posixpath
from pathlib import Path
from typing import NamedTuple

import numpy as np

from dataset.parquet import SPLITS, _SplitWriter, schema_for, to_table
from pipeline_config import ParquetConfig
from storage_io import filesystem, is_dir, is_remote, join, list_dirs, list_files, sha256_file

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg")
# PIL modes read as one channel; any other (RGB, RGBA, P, CMYK, ...) makes the dataset RGB.
GRAY_MODES = {"1", "L", "LA", "I", "I;16", "I;16B", "I;16L", "F"}


class FolderError(ValueError):
    """An image folder that cannot be used, naming the path and what is wrong."""


class FolderLayout(NamedTuple):
    """What `check_folder` found: the class names and every split's images (relative paths, labels)."""

    path: str
    classes: list[str]
    files: dict[str, list[tuple[str, int]]]  # "train" / "val" / "test" -> [(relative path, label)], sorted

    @property
    def has_val(self) -> bool:
        return bool(self.files.get("val"))


def _is_image(name: str) -> bool:
    return name.lower().endswith(IMAGE_EXTENSIONS) and not posixpath.basename(name).startswith(".")


def check_folder(path: str, field: str = "download.path") -> FolderLayout:
    """The layout of the image folder ``path``; FolderError naming the path when it is not one.

    Refused: a missing folder, no ``train/`` or ``test/``, a split without class subfolders or
    with images outside them, a class folder without images, a class in ``test/`` or ``val/``
    that ``train/`` does not have.
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
    for split in ("train", "val", "test"):
        if split not in splits:
            continue
        split_dir = join(path, split)
        names = list_dirs(split_dir)
        loose = [name for name in list_files(split_dir) if "/" not in name and _is_image(name)]
        if loose:
            raise FolderError(f"{join(split_dir, loose[0])}: an image outside a class folder; put it in {split}/<class>/")
        if not names:
            raise FolderError(f"{field} {path}: {split}/ has no class subfolders ({split}/<class>/*.png|jpg)")
        if split == "train":
            classes = names
        else:
            unknown = [name for name in names if name not in classes]
            if unknown:
                raise FolderError(
                    f"{join(split_dir, unknown[0])}: class {unknown[0]!r} is not in {join(path, 'train')} "
                    f"(its classes: {', '.join(classes)})"
                )
        rows: list[tuple[str, int]] = []
        for name in names:
            images = [rel for rel in list_files(join(split_dir, name)) if _is_image(rel)]
            if not images:
                raise FolderError(f"{join(split_dir, name)}: no images (*.png, *.jpg, *.jpeg) in this class folder")
            rows += [(f"{split}/{name}/{rel}", classes.index(name)) for rel in images]
        files[split] = rows
    return FolderLayout(path=path, classes=classes, files=files)


def check_source(cfg, image_size: int | None = None) -> FolderLayout | None:
    """Before any work: the layout of ``download.path`` when ``download.source=folder``, else None.

    FolderError naming the path: a bad layout (`check_folder`), and for a local folder a file that
    is not a readable image or sizes that differ without ``transform.image_size`` (`scan_images`:
    headers only, no pixels). An ``s3://`` folder's images are opened by the conversion stage only:
    one request per image is too much to spend before any work."""
    if cfg.source != "folder" or not cfg.path:
        return None
    layout = check_folder(cfg.path)
    if not is_remote(cfg.path):
        scan_images(layout, image_size)
    return layout


def folder_files(layout: FolderLayout) -> dict[str, str]:
    """Relative path -> sha256 of every image the layout names: what the dataset's fingerprint is made of."""
    return {rel: sha256_file(join(layout.path, rel)) for split in ("train", "val", "test") for rel, _ in layout.files.get(split, [])}


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


def _open_image(path: str):
    from PIL import Image

    fs, where = filesystem(path)
    handle = fs.open_input_file(where)
    try:
        with Image.open(handle) as image:
            return image.mode, image.size  # header only: the pixels are not decoded
    finally:
        handle.close()


def scan_images(layout: FolderLayout, image_size: int | None) -> tuple[int, int, int]:
    """(channels, height, width) the converted images will have; FolderError naming a file that cannot be read,
    or one whose size differs from the first one's when ``image_size`` is unset."""
    channels, first = 1, None
    for split in ("train", "val", "test"):
        for rel, _ in layout.files.get(split, []):
            path = join(layout.path, rel)
            try:
                mode, size = _open_image(path)
            except Exception as exc:  # PIL's UnidentifiedImageError, a truncated header, an unreadable file
                raise FolderError(f"{path}: not a readable image ({type(exc).__name__}: {exc})") from None
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

    Row ids: train/ in file order from 0, then val/ (when there is one), then test/. Without a
    val/ folder, `stratified_split` (``parquet.validation_every``, ``parquet.split_seed``) moves
    some of train/'s rows to val, keeping their row ids."""
    planned: dict[str, list[tuple[str, int, int]]] = {split: [] for split in SPLITS}
    row_id = 0
    train = layout.files["train"]
    held = set(stratified_split([label for _, label in train], cfg.validation_every, cfg.split_seed).tolist()) if not layout.has_val else set()
    for position, (rel, label) in enumerate(train):
        planned["val" if position in held else "train"].append((rel, row_id, label))
        row_id += 1
    for split in ("val", "test"):
        if split == "val" and not layout.has_val:
            continue
        for rel, label in layout.files[split]:
            planned[split].append((rel, row_id, label))
            row_id += 1
    return planned


def convert_folder(
    layout: FolderLayout, out_dir: Path, cfg: ParquetConfig, image_size: int | None, num_cpus: float = 0.25
) -> tuple[dict[str, int], tuple[int, int, int]]:
    """Read the folder's images with Ray Data into train/val/test Parquet folders; (row counts, (C, H, W))."""
    import ray.data

    shape = scan_images(layout, image_size)
    channels, height, width = shape
    schema = schema_for(channels * height * width)
    fs, _ = filesystem(layout.path)
    rows: dict[str, int] = {}
    for split, planned in plan_rows(layout, cfg).items():
        writer = _SplitWriter(out_dir / split, cfg, schema)
        try:
            if planned:
                paths = [filesystem(join(layout.path, rel))[1] for rel, _, _ in planned]
                by_path = {_key(p): (row_id, label) for p, (_, row_id, label) in zip(paths, planned)}
                ds = ray.data.read_images(
                    paths, filesystem=fs, mode="L" if channels == 1 else "RGB",
                    size=(height, width) if image_size is not None else None, include_paths=True,
                    num_cpus=num_cpus, file_extensions=None, shuffle=None,
                )
                ds.context.execution_options.preserve_order = True
                seen = 0
                for batch in ds.iter_batches(batch_size=cfg.rows_per_group, batch_format="numpy"):
                    images = np.stack(list(batch["image"])) if batch["image"].dtype == object else batch["image"]
                    if images.shape[1:3] != (height, width):
                        raise FolderError(f"{batch['path'][0]}: read as {images.shape[2]}x{images.shape[1]}, expected {width}x{height}")
                    ids_labels = np.array([by_path[_key(p)] for p in batch["path"]], dtype=np.int64).reshape(-1, 2)
                    writer.write(to_table(ids_labels[:, 0], images.reshape(len(images), -1), ids_labels[:, 1]))
                    seen += len(images)
                if seen != len(planned):
                    raise FolderError(f"{join(layout.path, split)}: Ray Data read {seen} images, the folder lists {len(planned)}")
        finally:
            writer.close()
        rows[split] = writer.rows
    return rows, shape


def describe(path: str) -> str:
    """``path`` for messages: as given (an s3:// URI) or absolute."""
    return path if is_remote(path) else str(Path(path).expanduser().absolute())
