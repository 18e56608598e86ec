"""A cheap listing of an image folder's files, and what earlier runs learned about each of them.

Checking a labelled image folder before a run decodes every image in full, and the download stage
hashes every image (sha256) for the dataset's fingerprint: many seconds for tens of thousands of
images. `ListingCache` keeps, on the storage root (never in the user's folder, which may be
read-only), one entry a file::

    <storage_root>/listings/<12 hex of sha256(folder path)>.json
    {"version": 2, "folder": "<path>",
     "files": {"train/cat/1.png": [size, mtime_ns, sha256, checked_max_pixels, [mode, width, height]]}}

A file whose size and modification time (``mtime_ns``; an ``s3://`` object's LastModified) are the
cached ones reuses its sha256, counts as decoded already and has its header (PIL mode and size)
taken from the cache instead of from the file; any other file is hashed, decoded and its header
read again, and a file no longer in the folder loses its entry. A version 1 file (no headers) is
read as version 2 with no header known.

What counts as a change: a different size or modification time. An edit that keeps both (a tool
that writes the same number of bytes and then restores the old mtime) is NOT noticed: the run
reuses the old sha256 and the old check. Touch the file, or delete the cache file, to have it read
again. A damaged or foreign cache file is ignored (treated as empty), never an error; one that
cannot be read or written only costs the work it would have saved.

The checks before a run (`dataset.sources.interface.check_data`) do not write the file: what they learn is
held in this process (`ListingCache.hold`) and written once the run is past every check
(`save_held`, or the download stage's `ListingCache.save` in this process), so a run refused before
any work (exit 2) leaves the storage root as it was. Every `ListingCache` of that folder on that root
made in this process meanwhile starts from what is held.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import re
from collections.abc import Iterable
from pathlib import Path

import pyarrow.fs as pafs

from storage_io import StorageWriteError, atomic_write_json, filesystem, is_remote, join, read_json, sha256_file

VERSION = 2
_HEADERLESS = 1  # an older cache file's version: its entries have no header
FOLDER = "listings"
_SHA256 = re.compile(r"[0-9a-f]{64}")
# checked_max_pixels of a file decoded in full with no pixel limit (None), stored as 0 in the cache.
NO_LIMIT = 0
# What the checks before a run learned and did not write yet (`ListingCache.hold`): cache file -> (folder key, entries).
_HELD: dict[str, tuple[str, dict[str, list]]] = {}


def folder_key(path: str) -> str:
    """The folder as the cache names it: an ``s3://`` URI as given (no trailing '/'), a local path absolute."""
    return path.rstrip("/") if is_remote(path) else str(Path(path).expanduser().absolute())


def cache_path(storage_root: str, path: str) -> str:
    """``<storage_root>/listings/<12 hex of sha256(folder path)>.json``."""
    return join(storage_root, FOLDER, hashlib.sha256(folder_key(path).encode()).hexdigest()[:12] + ".json")


def stat_files(path: str, rels: Iterable[str]) -> dict[str, tuple[int, int]]:
    """Relative path -> (size, mtime_ns) of each of ``rels`` under the folder ``path``; a file that is gone
    (or an object without a modification time) is left out, so it is read again, and fails there by name."""
    rels = list(rels)
    if is_remote(path):
        fs, where = filesystem(path)
        infos = fs.get_file_info(pafs.FileSelector(where, recursive=True, allow_not_found=True))
        found = {posixpath.relpath(i.path, where): (i.size, i.mtime_ns) for i in infos if i.type == pafs.FileType.File}
        return {rel: found[rel] for rel in rels if rel in found and found[rel][1] is not None}
    base, stats = folder_key(path), {}
    for rel in rels:
        try:
            st = os.stat(os.path.join(base, rel))
        except OSError:
            continue
        stats[rel] = (st.st_size, st.st_mtime_ns)
    return stats


def _count(n, least: int = 0) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= least


def _valid_header(header) -> bool:
    return header is None or (
        isinstance(header, list) and len(header) == 3 and isinstance(header[0], str)
        and _count(header[1], 1) and _count(header[2], 1)
    )


def _valid_entry(entry) -> bool:
    if not isinstance(entry, list) or len(entry) != 5:
        return False
    size, mtime_ns, digest, checked, header = entry
    return (
        all(isinstance(n, int) and not isinstance(n, bool) for n in (size, mtime_ns))
        and (digest is None or (isinstance(digest, str) and _SHA256.fullmatch(digest) is not None))
        and (checked is None or _count(checked))
        and _valid_header(header)
    )


def read_entries(where: str, key: str) -> dict[str, list]:
    """The entries of the cache file ``where`` for the folder ``key``; empty when it is missing, damaged,
    of an unknown version or of another folder. A version 1 file's entries come with no header."""
    try:
        data = read_json(where)
    except Exception:  # an unreachable root: the cache only saves work
        return {}
    if not isinstance(data, dict) or data.get("version") not in (VERSION, _HEADERLESS) or data.get("folder") != key:
        return {}
    files = data.get("files")
    if not isinstance(files, dict):
        return {}
    if data["version"] == _HEADERLESS:
        files = {rel: [*entry, None] if isinstance(entry, list) else entry for rel, entry in files.items()}
    if not all(isinstance(rel, str) and _valid_entry(e) for rel, e in files.items()):
        return {}
    return files


class ListingCache:
    """What earlier runs learned about the images ``rels`` of the folder ``path`` (see the module's docstring).

    ``storage_root`` None: nothing is read or written; every file is hashed and decoded as without a cache."""

    def __init__(self, path: str, rels: Iterable[str], storage_root: str | None = None):
        self.path, self.key = path, folder_key(path)
        self.where = cache_path(storage_root, path) if storage_root else None
        self.stats = stat_files(path, rels)
        held = _HELD.get(self.where) if self.where else None
        held = held[1] if held is not None and held[0] == self.key else None
        old = held if held is not None else read_entries(self.where, self.key) if self.where else {}
        self.entries: dict[str, list] = {}
        for rel, stat in self.stats.items():
            entry = old.get(rel)
            same = entry is not None and (entry[0], entry[1]) == stat
            self.entries[rel] = list(entry) if same else [stat[0], stat[1], None, None, None]
        self.changed = held is not None or self.entries != old  # what is held is not on the storage root yet

    def sha256(self, rel: str) -> str:
        """The file's sha256: the cached one when the file is unchanged, else read and hashed (and kept)."""
        entry = self.entries.get(rel)
        if entry is not None and entry[2] is not None:
            return entry[2]
        digest = sha256_file(join(self.path, rel))
        if entry is not None:
            entry[2], self.changed = digest, True
        return digest

    def checked(self, rel: str, max_pixels: int | None) -> bool:
        """Whether the unchanged file was decoded in full without error at ``max_pixels`` or a stricter limit."""
        entry = self.entries.get(rel)
        done = entry[3] if entry is not None else None
        if done is None:
            return False
        return max_pixels is None or (done != NO_LIMIT and done <= max_pixels)

    def mark_checked(self, rel: str, max_pixels: int | None) -> None:
        """Record that the file was decoded in full without error at ``max_pixels`` (None: no limit)."""
        entry = self.entries.get(rel)
        if entry is not None:
            entry[3], self.changed = NO_LIMIT if max_pixels is None else max_pixels, True

    def header(self, rel: str) -> tuple[str, tuple[int, int]] | None:
        """(PIL mode, (width, height)) of the unchanged file as last read, or None when not known."""
        entry = self.entries.get(rel)
        if entry is None or entry[4] is None:
            return None
        mode, width, height = entry[4]
        return mode, (width, height)

    def mark_header(self, rel: str, mode: str, size: tuple[int, int]) -> None:
        """Record the file's header as just read: its PIL mode and (width, height)."""
        entry = self.entries.get(rel)
        if entry is not None and entry[4] != [mode, size[0], size[1]]:
            entry[4], self.changed = [mode, size[0], size[1]], True

    def save(self) -> None:
        """Write the entries (only when something changed); a root that cannot be written is passed over."""
        if self.where is None or not self.changed:
            return
        _HELD.pop(self.where, None)  # these entries start from what was held: written now, or not at all
        try:
            atomic_write_json(self.where, {"version": VERSION, "folder": self.key, "files": self.entries})
        except (OSError, StorageWriteError):  # a full or read-only root: the next run redoes the work
            return
        self.changed = False

    def hold(self) -> None:
        """Keep the entries in this process instead of writing them (only when something changed): the checks
        before a run write nothing on the storage root. `save_held` writes them once the run goes on."""
        if self.where is not None and self.changed:
            _HELD[self.where] = (self.key, {rel: list(entry) for rel, entry in self.entries.items()})


def save_held(storage_root: str, path: str) -> None:
    """Write what the checks before a run held for the folder ``path`` on ``storage_root`` (`ListingCache.hold`);
    nothing when nothing is held. A root that cannot be written is passed over, as by `ListingCache.save`."""
    where = cache_path(storage_root, path)
    held = _HELD.pop(where, None)
    if held is None or held[0] != folder_key(path):
        return
    try:
        atomic_write_json(where, {"version": VERSION, "folder": held[0], "files": held[1]})
    except (OSError, StorageWriteError):
        return
