"""Paths the storage root stores about itself, written relative to the root so a root can move.

Model cards, the champion pointer and run leases name other things under the root. They store
them relative to it (``datasets/mnist-<fp>``, ``models/<model>/v3``), so a root that is copied,
moved or synced to S3 still names its own files (`to_stored` writes such a path, `from_stored`
reads it back under the current root).

A root written before this rule holds absolute paths (``/old/place/datasets/mnist-<fp>``). Read
back, such a path is used as it is when it lies under the current root; when it points into
another root's layout (``.../raw/...``, ``.../datasets/...``, ``.../runs/...``, ``.../models/...``)
it is mapped to the same relative place under the current root (`mapped_places`), and only a
place that exists there counts. Nothing is ever deleted by such a path: cleanup deletes only
what `StorageLayout.contains`.
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

from storage_io.filesystem import S3_SCHEME, exists, is_remote, join

# The folders directly under a storage root (`storage_io.layout`): where a foreign root's layout is recognized.
ROOT_FOLDERS = ("raw", "datasets", "runs", "models", "leases", "locks", "predictions")


class StoredPathError(ValueError):
    """A path stored under the root that cannot name anything under it (malformed, or '..')."""


def has_control_characters(text: str) -> bool:
    """Line breaks, tabs, NUL, DEL and the other C0/C1 control characters."""
    return any(ord(c) < 32 or 127 <= ord(c) < 160 for c in text)


def _is_absolute(text: str) -> bool:
    return is_remote(text) or os.path.isabs(text)


def relative_to_root(root: str, path: str | os.PathLike[str]) -> str | None:
    """``path`` as a '/'-separated path relative to ``root`` when it lies strictly inside it, else None."""
    text, root = str(path), str(root)
    if is_remote(root) != is_remote(text) or not _is_absolute(text):
        return None
    if is_remote(root):
        base, target = root.rstrip("/"), text.rstrip("/")
        if not target.startswith(base + "/"):
            return None
        rel = target[len(base) + 1 :]
        return None if any(part in ("", ".", "..") for part in rel.split("/")) else rel
    base_path, target_path = Path(os.path.normpath(root)), Path(os.path.normpath(text))
    for base_try, target_try in ((base_path, target_path), (base_path.resolve(), target_path.resolve())):
        if target_try != base_try and target_try.is_relative_to(base_try):
            return target_try.relative_to(base_try).as_posix()
    return None


def to_stored(root: str, path: str | os.PathLike[str] | None) -> str | None:
    """How ``path`` is written into a file under ``root``: relative to the root when it lies inside.

    A path outside the root is kept as given (it names nothing the root holds).
    """
    if path is None:
        return None
    rel = relative_to_root(root, path)
    return rel if rel is not None else str(path)


def _relative_parts(stored: str) -> list[str]:
    parts = PurePosixPath(stored).parts
    if not parts or any(part in (".", "..") for part in parts) or "\\" in stored:
        raise StoredPathError(f"stored path {stored!r} is not a plain path relative to the storage root")
    return list(parts)


def _check(stored: object) -> str:
    if not isinstance(stored, str) or not stored.strip():
        raise StoredPathError(f"stored path {stored!r} is not a non-empty string")
    if has_control_characters(stored):
        raise StoredPathError(f"stored path {stored!r} contains a line break or another control character")
    return stored


def mapped_places(root: str, stored: str) -> list[str]:
    """Where an absolute ``stored`` path of another root may lie under ``root``: one place per
    recognized root folder in it (``/old/datasets/x`` -> ``<root>/datasets/x``), longest first.
    None when it holds '..' (never mapped)."""
    text = _check(stored).rstrip("/")
    if is_remote(text):
        parts = text[len(S3_SCHEME) :].split("/")[1:]  # without the bucket
    else:
        parts = list(PurePosixPath(text).parts[1:])
    if any(part in ("", ".", "..") for part in parts):
        return []
    return [join(root, *parts[i:]) for i, part in enumerate(parts) if part in ROOT_FOLDERS]


def from_stored(root: str, stored: str, must_exist: bool = False) -> str | None:
    """The place under ``root`` a stored path names, or None when an older root's absolute path maps to nothing here.

    Relative: joined to the root. Absolute under the root: as it is. Absolute elsewhere: the first
    of `mapped_places` that exists. ``must_exist``: also None for a relative or inside path that is
    not there. StoredPathError for a malformed path.
    """
    text = _check(stored)
    if not _is_absolute(text):
        place = join(root, *_relative_parts(text))
    elif relative_to_root(root, text) is not None:
        place = text.rstrip("/") if is_remote(text) else str(Path(text))
    else:
        return next((place for place in mapped_places(root, text) if exists(place)), None)
    return place if not must_exist or exists(place) else None


def stored_places(root: str, stored: str, existing_only: bool = False) -> list[str]:
    """Every place under ``root`` (and the stored path itself when it is absolute) that ``stored`` may name.

    For what must be left alone (cleanup's protections): an older root's absolute path counts as
    itself and as each of its `mapped_places` (only those that exist with ``existing_only``).
    """
    text = _check(stored)
    if not _is_absolute(text):
        return [join(root, *_relative_parts(text))]
    if relative_to_root(root, text) is not None:
        return [text.rstrip("/") if is_remote(text) else str(Path(text))]
    mapped = [place for place in mapped_places(root, text) if not existing_only or exists(place)]
    return [text, *[place for place in mapped if place != text]]
