"""Every ``download.source`` a run may name, with the module that reads it: the one line a new source adds.

`SOURCES` is the registry. Each entry names the module whose ``SOURCE`` class (a `dataset.sources.interface.Source`)
reads the data, what the choice means (the ``download.source`` field's description, the UI form's help) and, for a
source that reads the user's data where it is, what ``download.path`` must hold. The ``download.source`` choices,
the check that a path source has ``download.path`` (and that no other source sets it), and which module a
run imports for its data all come from here; nothing else names a source (docs/extending.md).

The modules are named, not imported: the configuration loads without the data code.
"""

from __future__ import annotations

from typing import Literal, NamedTuple


class Registered(NamedTuple):
    """One ``download.source`` choice."""

    module: str  # imported when a run first asks for it; its ``SOURCE`` class reads the data
    about: str  # what the choice means, in the field's description
    path: str | None = None  # what download.path holds for this source; None: it reads no download.path


SOURCES = {
    "auto": Registered("dataset.sources.idx_source", "try the official MNIST mirrors (short connect timeout) and fall back to the "
                       "bundled 5,000-digit sample with a warning"),
    "official": Registered("dataset.sources.idx_source", "MNIST's official mirrors; fail if unreachable"),
    "mirror": Registered("dataset.sources.idx_source", "MNIST's four files from download.mirror_url"),
    "sample": Registered("dataset.sources.idx_source", "the bundled 5,000-digit MNIST sample"),
    "folder": Registered(
        "dataset.sources.folder_source",
        "your own labelled images in download.path (train/<class>/*.png|jpg, test/<class>/..., optional val/<class>/...)",
        "a folder or s3:// prefix holding train/<class>/ and test/<class>/",
    ),
    "parquet": Registered(
        "dataset.sources.parquet_source",
        "Parquet files in download.path whose split is in the file or folder name (data/train-00000-of-00001.parquet, "
        "train/0000.parquet, test.parquet), with an image and a label column (download.image_column, download.label_column)",
        "a folder or s3:// prefix holding train and test Parquet files",
    ),
}

# download.source's choices, in the registry's order (the UI form's list).
SourceChoice = Literal[tuple(SOURCES)]  # type: ignore[valid-type]
# The sources that read the user's data where it is, named by download.path.
PATH_SOURCES = tuple(name for name, entry in SOURCES.items() if entry.path)


def described() -> str:
    """The ``download.source`` field's description: each choice and what it means."""
    return "; ".join(f"{name}: {entry.about}" for name, entry in SOURCES.items()) + "."
