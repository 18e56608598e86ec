"""What changed in a user's folder since it was last looked at: a listing of names, sizes and times.

The files listed are the ones a run reads from it: images (``download.source=folder``) and Parquet files
(``download.source=parquet``).

The listing is one directory walk (local, each file once: `storage_io.list_files`) or one paginated LIST (``s3://``): no image is
opened, so it costs about the same at ten thousand images as the folder's metadata does. A file
counts as changed when it was added, removed, or its size or modification time differs; an edit
that keeps both is not seen (as with ``make`` and ``rsync``'s default check). The last listing is
kept on the storage root, ``<root>/watch/<12 hex of sha256(folder)>.json``, never in the folder;
`compare` keeps nothing, so that a sender keeps the new listing (`keep`) only once the change was told.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import pyarrow.fs as pafs

from storage_io import atomic_write_json, filesystem, is_remote, join, list_files, read_json, sha256_json

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
WATCHED_SUFFIXES = (*IMAGE_SUFFIXES, ".parquet")
WATCH_DIR = "watch"


def listing(path: str) -> dict[str, list[int]]:
    """Relative path -> [size, mtime_ns] of every image and Parquet file under ``path`` (hidden files and other
    suffixes left out). A local folder is listed as a run reads it (`storage_io.list_files`: each file once, no
    link followed into the folder or around it), then each file's size and time read."""
    if not is_remote(path):
        root = Path(path)
        found = {}
        for rel in list_files(path):
            if rel.lower().endswith(WATCHED_SUFFIXES) and not any(part.startswith(".") for part in rel.split("/")):
                stat = (root / rel).stat()
                found[rel] = [int(stat.st_size), int(stat.st_mtime_ns)]
        return found
    fs, where = filesystem(path)
    infos = fs.get_file_info(pafs.FileSelector(where, recursive=True, allow_not_found=True))
    base = where.rstrip("/") + "/"
    found: dict[str, list[int]] = {}
    for info in infos:
        rel = info.path[len(base):] if info.path.startswith(base) else info.path
        if info.type != pafs.FileType.File or not rel.lower().endswith(WATCHED_SUFFIXES):
            continue
        if any(part.startswith(".") for part in rel.split("/")):
            continue
        found[rel] = [int(info.size or 0), int(info.mtime_ns or 0)]
    return found


@dataclass(frozen=True)
class Change:
    """How a folder's listing differs from the last one: counts, a few names, and the new listing's digest."""

    files: int
    added: int
    removed: int
    modified: int
    digest: str
    examples: tuple[str, ...] = ()

    @property
    def any(self) -> bool:
        return bool(self.added or self.removed or self.modified)

    def describe(self) -> str:
        return f"{self.added} added, {self.removed} removed, {self.modified} changed of {self.files} images"


def diff(old: dict[str, list[int]], new: dict[str, list[int]]) -> Change:
    """The change from listing ``old`` to listing ``new``."""
    added = sorted(set(new) - set(old))
    removed = sorted(set(old) - set(new))
    modified = sorted(rel for rel in set(new) & set(old) if list(new[rel]) != list(old[rel]))
    examples = tuple((added + modified + removed)[:5])
    return Change(len(new), len(added), len(removed), len(modified), sha256_json(new)[:16], examples)


def state_path(storage_root: str, folder: str) -> str:
    """Where the folder's last listing is kept on the storage root."""
    return join(storage_root, WATCH_DIR, hashlib.sha256(folder.encode()).hexdigest()[:12] + ".json")


def compare(storage_root: str, folder: str) -> tuple[Change, dict[str, list[int]], bool]:
    """List ``folder`` and compare with the listing kept from the last look, keeping nothing: (the change,
    the new listing, whether it should be kept: `keep`). The sender keeps it once the change was told.

    The first look at a folder compares with an empty listing: everything in it is new.
    A kept listing that cannot be read counts as empty (the next kept one replaces it).
    """
    kept = read_json(state_path(storage_root, folder))
    old = kept.get("files") if isinstance(kept, dict) and kept.get("folder") == folder else None
    new = listing(folder)
    change = diff(old if isinstance(old, dict) else {}, new)
    return change, new, change.any or not isinstance(old, dict)


def keep(storage_root: str, folder: str, change: Change, new: dict[str, list[int]]) -> None:
    """Keep ``new`` as the folder's last listing: the next look compares with it."""
    atomic_write_json(state_path(storage_root, folder), {"folder": folder, "digest": change.digest, "files": new})


def look(storage_root: str, folder: str) -> Change:
    """`compare`, then `keep` the new listing: a look whose change needs no telling."""
    change, new, changed = compare(storage_root, folder)
    if changed:
        keep(storage_root, folder, change, new)
    return change
