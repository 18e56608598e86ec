"""A local folder's files, each listed once: no link followed into the folder itself or a folder around it.

pyarrow's recursive listing (and ``os.walk(followlinks=True)``) follows every directory link: a link
``train/a/loop -> ..`` lists ``train/`` again under ``train/a/loop/``, forty levels deep, until the
path is too long (1,640 images listed for 40, class b's listed under class a). `walk_local` lists the
folder's real tree first, without following any link, then the links in it, sorted by path:

- a link to a folder is **not followed** when its target is a folder listed already (the folder
  itself, one inside it, or one a link before it reached: a loop, or the same files twice), or a
  folder that holds the link or the listed folder (an ancestor: a loop through a folder around it).
  It is named in `Listing.skipped`.
- a link to a folder **outside** the listed one, not listed yet, is followed (a dataset assembled
  from links to other disks is a common layout) and named in `Listing.links_out`, so the caller
  can say so in its listing line; links inside it are treated by the same rules.
- a link to a file reached already (the same device and inode as a file listed) is not listed a
  second time and is named in `Listing.skipped`. A real file (one reached without any link) is
  always listed, hard links included: two names of one file in the folder itself are the user's.
- a link whose target is missing is left out (the image folder's check names those itself).

Folders are told apart by (``st_dev``, ``st_ino``) of their real path, files reached through a link
the same way, so two links to one folder list it once, whatever their names.
"""

from __future__ import annotations

import os
import stat
from typing import NamedTuple


class Listing(NamedTuple):
    """What `walk_local` found under a folder: its files and what it did with the links in it."""

    files: list[str]  # relative paths with '/', sorted, each file once
    links_out: tuple[tuple[str, str], ...] = ()  # (relative path of a link followed out of the folder, its real target)
    skipped: tuple[tuple[str, str], ...] = ()  # (relative path of a link not followed, why)


def _key(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def _holds(outer: str, inner: str) -> bool:
    """Whether the real path ``outer`` is ``inner`` or a folder around it."""
    return inner == outer or inner.startswith(outer.rstrip(os.sep) + os.sep)


class _Walk:
    def __init__(self, top: str):
        self.top = os.path.realpath(top)
        self.dirs: set[tuple[int, int]] = set()  # every folder listed
        self.file_keys: set[tuple[int, int]] = set()  # every file listed, by device and inode
        self.files: list[str] = []
        self.links: list[tuple[str, str, str]] = []  # (relative path, path, real folder that holds it), to look at
        self.links_out: list[tuple[str, str]] = []
        self.skipped: list[tuple[str, str]] = []

    def tree(self, real: str, rel: str, linked: bool = False) -> None:
        """List the real tree at ``real`` under the relative prefix ``rel`` ("" or ending in '/'), following no link;
        the links found are queued (sorted) for `follow`. ``linked``: reached through a link, so a file in it
        listed already (the same device and inode) is not listed again."""
        stack, found = [(real, rel)], []
        while stack:
            where, prefix = stack.pop()
            st = os.stat(where)
            if _key(st) in self.dirs:  # the same folder mounted twice
                continue
            self.dirs.add(_key(st))
            with os.scandir(where) as entries:
                for entry in entries:
                    name = prefix + entry.name
                    if entry.is_symlink():
                        found.append((name, entry.path, where))
                    elif entry.is_dir(follow_symlinks=False):
                        stack.append((entry.path, name + "/"))
                    elif entry.is_file(follow_symlinks=False):
                        if linked and (st.st_dev, entry.inode()) in self.file_keys:
                            self.skipped.append((name, "a file listed already"))
                            continue
                        self.files.append(name)
                        self.file_keys.add((st.st_dev, entry.inode()))
        self.links.extend(sorted(found))

    def follow(self) -> None:
        """Look at every queued link, in order, and at the links inside the folders followed."""
        while self.links:
            rel, path, holder = self.links.pop(0)
            try:
                st = os.stat(path)  # follows the link: its target
            except OSError:  # a link to a missing file: left out
                continue
            if stat.S_ISREG(st.st_mode):
                if _key(st) in self.file_keys:
                    self.skipped.append((rel, "a link to a file listed already"))
                else:
                    self.file_keys.add(_key(st))
                    self.files.append(rel)
            elif stat.S_ISDIR(st.st_mode):
                target = os.path.realpath(path)
                if _holds(target, holder) or _holds(target, self.top):
                    self.skipped.append((rel, f"a link to {target}, a folder that holds it: a loop"))
                elif _key(st) in self.dirs:
                    self.skipped.append((rel, f"a link to {target}, a folder listed already"))
                else:
                    self.links_out.append((rel, target))
                    self.tree(target, rel + "/", linked=True)


def walk_local(top: str, suffix: str = "") -> Listing:
    """Every file under the local folder ``top`` once, with what was done with its links (see the module's
    docstring); files ending in ``suffix`` only. An empty `Listing` when ``top`` is missing or not a folder;
    OSError when a folder in it cannot be read."""
    if not os.path.isdir(top):
        return Listing([])
    walk = _Walk(top)
    walk.tree(walk.top, "")
    walk.follow()
    return Listing(sorted(rel for rel in walk.files if rel.endswith(suffix)), tuple(walk.links_out), tuple(walk.skipped))
