"""A labelled image folder (``download.source=folder``): its checks, its files, its listing cache.

Layout, as torchvision's ``ImageFolder`` and Hugging Face's ``imagefolder`` read it::

    <path>/train/<class>/*.png|jpg|jpeg
    <path>/test/<class>/...
    <path>/val/<class>/...        optional; without it a seeded stratified split of train/

``<path>`` is a local folder or an ``s3://bucket/prefix``. The class names are train/'s
subfolders, sorted; label i is the i-th. Every check (`check_folder`) runs before any work and
names the path that is wrong. The folder is only read: never copied, modified or deleted.

A local folder's images are decoded in full before any work (`dataset.formats.folder_scan.scan_images`, from `dataset.sources.folder_source`'s
check): a file that stops
short, or one of more than ``download.max_image_pixels`` pixels (from its header), is refused by
name. With a storage root, what earlier runs learned (each file's sha256, that it decoded in full,
and its header) is kept in a `dataset.formats.listing.ListingCache` and reused while a file keeps its size
and mtime: the checks after the first one and the conversion take the shape from it (`dataset.formats.folder_scan.image_shape`).
Files that are not images and links to missing files are passed over and counted (`FolderLayout.skipped`;
the conversion's terminal line names the first few). Hidden entries (a name starting with ``.``: a
``.ipynb_checkpoints/`` or ``.git/`` folder, a ``.DS_Store`` or ``._x.png`` file) are never a class or an
image, wherever they are: each is counted once (a hidden folder as one entry, whatever it holds), and the
line says how many ("2 hidden entries skipped"). The dataset's fingerprint and the listing cache are made
of the images only, so a hidden entry added or removed changes neither.

Each image is listed once (`storage_io.list_tree`): a link to a folder is not followed when it points into its
split's folder or one around it (``train/a/loop -> ..``: a loop) or to a folder listed already, nor a link to an
image listed already; each is passed over by name. A link to a folder outside the split's folder is followed,
and the conversion's terminal line names it (`FolderLayout.links_out`: ``train/a/more -> /disk2/a``).

The folder as a run's data source (its checks before any work, listing, fingerprint, conversion) is
`dataset.sources.folder_source`; its conversion to Parquet, with Ray Data, `dataset.formats.folder_convert`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

import numpy as np

from dataset.formats.listing import ListingCache
from storage_io import is_dir, is_remote, join, list_dirs, list_tree, sha256_file

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
    links_out: tuple[str, ...] = ()  # the links followed out of a split's folder, as ``train/a/more -> /elsewhere``

    @property
    def has_val(self) -> bool:
        return bool(self.files.get("val"))

    @property
    def hidden(self) -> tuple[str, ...]:
        """The hidden entries passed over (``train/.ipynb_checkpoints/``, ``train/cat/.DS_Store``)."""
        return tuple(entry.removesuffix(HIDDEN) for entry in self.skipped if entry.endswith(HIDDEN))

    def skipped_note(self, shown: int = 3) -> str | None:
        """What the check passed over: the hidden entries counted (``2 hidden entries skipped``), the other
        files counted and the first ``shown`` named (a link not followed among them), and the links followed out of
        the folder; None when there are none."""
        notes = []
        if self.links_out:
            more = f" and {len(self.links_out) - shown} more" if len(self.links_out) > shown else ""
            notes.append(f"{len(self.links_out)} link(s) out of {self.path} followed: {', '.join(self.links_out[:shown])}{more}")
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


def _check_split(
    path: str, split: str, classes: list[str], field: str,
) -> tuple[list[str], list[tuple[str, int]], list[str], list[str]]:
    """(class folder names, images as (relative path, label), files passed over, links followed out of the split's
    folder) of one split; FolderError naming the path. Each file is listed once (`storage_io.list_tree`): a link
    into the split's folder or around it is not followed, and is passed over by name."""
    split_dir = join(path, split)
    folders = list_dirs(split_dir)
    names = [name for name in folders if not name.startswith(".")]  # a hidden folder is never a class
    tree = list_tree(split_dir)
    listed = tree.files
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
    skipped += [f"{split}/{rel} ({why})" for rel, why in tree.skipped if _hidden_part(rel) is None]
    if not is_remote(path):
        skipped += [f"{split}/{rel} (a link to a missing file)" for rel in _dangling_links(split_dir)]
    links_out = [f"{split}/{rel} -> {target}" for rel, target in tree.links_out if _hidden_part(rel) is None]
    return names, rows, skipped, links_out


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
    links_out: list[str] = []
    for split in ("train", "val", "test"):
        if split in splits:
            names, files[split], passed, linked = _check_split(path, split, classes, field)
            classes = names if split == "train" else classes
            skipped += passed
            links_out += linked
    layout = FolderLayout(path=path, classes=classes, files=files, skipped=tuple(skipped), links_out=tuple(links_out))
    _check_learnable(layout, field)
    return layout


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
        count = 0 if len(where) < 2 else max(1, round(len(where) / every))
        held.append(where[rng.permutation(len(where))[:count]])
    return np.sort(np.concatenate(held)) if held else np.zeros(0, dtype=np.int64)


def describe(path: str) -> str:
    """``path`` for messages: as given (an s3:// URI) or absolute."""
    return path if is_remote(path) else str(Path(path).expanduser().absolute())
