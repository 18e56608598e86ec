"""Where a run's data comes from: the `Source` interface, and which module implements each ``download.source``.

A source is one module of `dataset.sources` with one `Source` subclass, named in `MODULES`:

- ``auto``, ``official``, ``mirror``, ``sample``: MNIST's IDX files (`dataset.sources.idx_source`);
- ``folder``: a labelled image folder, local or ``s3://`` (`dataset.sources.folder_source`);
- ``parquet``: a folder of Parquet files with an image and a label column (`dataset.sources.parquet_source`).

Every stage asks the source, never which source a run has: before any work, the images' shape and the
classes (`Source.check`, `Source.data_to_come`); in the download stage, the data listed and
fingerprinted (`Source.fetch`, its listing cache included); in the conversion, the dataset's fingerprint
and the Parquet dataset itself (`Source.fingerprint`, `Source.convert`); in cleanup, what may be deleted
(`Source.deletable`: never a user's data); in the watcher, what is watched (`Source.watched`); in the
transform, the normalization and augmentation defaults (`Source.defaults`, by the dataset's ``source``).

A source's module is imported when a run first asks for it (`source_for`), by its name in `MODULES`:
adding a source is one module and one line here (docs/extending.md).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, NamedTuple

import pydantic

from pipeline_config import DownloadConfig
from storage_io import StorageLayout, is_remote

if TYPE_CHECKING:  # annotations only
    from dataset.formats.parquet import ParquetDataset
    from pipeline_config import ParquetConfig

# download.source -> the module whose ``SOURCE`` class reads it.
MODULES = {
    "auto": "dataset.sources.idx_source",
    "official": "dataset.sources.idx_source",
    "mirror": "dataset.sources.idx_source",
    "sample": "dataset.sources.idx_source",
    "folder": "dataset.sources.folder_source",
    "parquet": "dataset.sources.parquet_source",
}


class Defaults(NamedTuple):
    """What the transform makes of ``transform.mean``/``std`` unset and ``transform.augment: auto``."""

    measure_stats: bool  # True: the training split's own per-channel mean and std; False: 0.5 / 0.5
    augment: str  # the choice ``auto`` stands for (`dataset.tensors.augment.CHOICES`)


SourceName = Literal["official", "mirror", "sample", "folder", "parquet"]


class RawData(pydantic.BaseModel):
    """The verified raw files of one data source, as the next stages consume them."""

    source: SourceName = pydantic.Field(description="Where the files came from.")
    url: str = pydantic.Field(description="Base URL the files were fetched from (or would be, when skipped).")
    directory: str = pydantic.Field(description="Absolute folder holding the four files (source=folder or parquet: the user's folder).")
    files: dict[str, str] = pydantic.Field(description="File name (source=folder or parquet: path under the folder) -> sha256 of the file.")
    skipped: bool = pydantic.Field(description="True when all four files were already present and verified (source=folder: never, every image is listed and hashed).")
    options: dict[str, str] = pydantic.Field(
        default={}, description="The download settings the conversion reads besides the path (source=parquet: image_column, label_column).")

    def terminal_detail(self) -> str:
        """What the download stage's closing terminal line adds after its name and seconds."""
        return f": {self.source} data{' (verified on storage, reused)' if self.skipped else ''}"

    def deletable(self) -> list[str]:
        """What cleanup's ``delete_raw`` may delete of this data (`dataset.sources.interface.Source.deletable`): the IDX
        files' folder under the storage root; nothing of a user's folder, which is read where it is."""
        return source_of(self).deletable(self)


class Source:
    """One kind of data a run trains on. Built from the run's ``download`` section (`source_for`), or from
    the download stage's `RawData` in later stages (`source_of`), whose ``options`` carry what they need.

    Class attributes:
        kind: what `dataset.formats.parquet.ParquetDataset.source` records (``idx``, ``folder``, ``parquet``):
            it picks the transform's defaults (`defaults_for`) in every later stage.
        defaults: the normalization and augmentation defaults of this kind of data.
        resizable: the images may be resized (``transform.image_size``); MNIST's IDX digits are not.
        user_data: the data is the user's, read where it is: never copied, changed or deleted.
        title: what the data is called in the stages' log lines (``Image folder: 2 hidden entries skipped``).
        predict_input: what ``flows.predict --input`` takes for data like this, in the closing lines' hint.
    """

    kind: ClassVar[str]
    title: ClassVar[str] = "Data"
    defaults: ClassVar[Defaults] = Defaults(measure_stats=True, augment="shifts")
    resizable: ClassVar[bool] = True
    user_data: ClassVar[bool] = True
    predict_input: ClassVar[str] = "<folder of images, IDX or Parquet files>"

    def __init__(self, cfg: DownloadConfig):
        self.cfg = cfg

    @classmethod
    def from_raw(cls, raw: RawData) -> Source:
        """The source that listed ``raw``: its path and its options (`RawData.options`) as the ``download`` section."""
        return cls(DownloadConfig(source=raw.source, path=raw.directory, **raw.options))

    # Before any work.
    def check(self, image_size: int | None, storage_root: str | None) -> Any:
        """Refuse data that cannot be used (ValueError naming the field or the file), before any work; what the
        check found (passed to `data_for_trial`), or None. What it learns is held in this process, not written."""
        return None

    def keep_checks(self, storage_root: str | None) -> None:
        """Once the run is past every check: write what `check` learned (a listing cache) on ``storage_root``."""

    def data_for_trial(self, checked: Any, image_size: int | None, storage_root: str | None) -> tuple[tuple[int, int, int], int] | None:
        """((channels, height, width), number of classes) known before any work (None: known after the
        conversion only); ``checked``: what `check` returned."""
        raise NotImplementedError

    def shape_known_before_work(self) -> bool:
        """Whether `data_for_trial` knows the shape before any work: not for an ``s3://`` folder, whose images
        are first read by the conversion (the model is then tried on the converted dataset)."""
        return not is_remote(self.cfg.path or "")

    def data_to_come(self, image_size: int | None, storage_root: str | None) -> tuple[tuple[int | None, ...], list[str]]:
        """((channels, height, width), classes) of the data the run will convert, read before any work; None
        where not known yet (an ``s3://`` folder's channels). Checks as much as it reads (ValueError naming the path)."""
        raise NotImplementedError

    def watched(self) -> str | None:
        """The path a watcher looks at for new data (`dataset.formats.watching`), or None: nothing to watch."""
        return self.cfg.path if self.user_data else None

    def best_config_data(self) -> dict | None:
        """The ``download`` values a search's best config names, so the winner trains on the same data (None: the defaults')."""
        return None

    # The download stage.
    def fetch(self, layout: StorageLayout | None, log) -> RawData:
        """List (and fetch, when the data is not the user's) and fingerprint the data: the stage's `RawData`."""
        raise NotImplementedError

    # The conversion stage (built with `source_of`, from the download stage's RawData).
    def fingerprint(self, raw: RawData, cfg: ParquetConfig, image_size: int | None) -> str:
        """Content key of a conversion: the data's checksums plus every setting that changes the output."""
        raise NotImplementedError

    def conversion_notes(self, raw: RawData) -> list[str]:
        """What the conversion's terminal line says about the data whether it is converted or reused (files passed over)."""
        return []

    def convert(
        self, raw: RawData, cfg: ParquetConfig, final: str, fingerprint: str, logger, image_size: int | None,
        max_pixels: int | None, storage_root: str | None,
    ) -> ParquetDataset:
        """Write the dataset (`dataset.formats.parquet`'s layout and manifest) into ``final``, published whole."""
        raise NotImplementedError

    # Cleanup.
    def deletable(self, raw: RawData) -> list[str]:
        """What cleanup's ``delete_raw`` may delete of this data: never the user's own."""
        return [] if self.user_data else [raw.directory]


def source_class(name: str) -> type[Source]:
    """The `Source` class of ``download.source`` (or a `RawData.source`) ``name``; ValueError naming it when unknown."""
    module = MODULES.get(name)
    if module is None:
        raise ValueError(f"download.source {name!r}: not one of {', '.join(MODULES)}")
    return importlib.import_module(module).SOURCE


def predict_input(name: str | None) -> str:
    """What ``flows.predict --input`` takes for data of the ``download.source`` ``name`` (any input when unknown)."""
    return source_class(name).predict_input if name in MODULES else Source.predict_input


def source_for(cfg: DownloadConfig) -> Source:
    """The source the ``download`` section names."""
    return source_class(cfg.source)(cfg)


def source_of(raw: RawData) -> Source:
    """The source of the download stage's ``raw``: its options (`RawData.options`) stand for the ``download`` section."""
    return source_class(raw.source).from_raw(raw)


def defaults_for(kind: str) -> Defaults:
    """The transform's defaults for a dataset converted from ``kind`` (`dataset.formats.parquet.ParquetDataset.source`)."""
    for name in dict.fromkeys(MODULES.values()):
        cls = importlib.import_module(name).SOURCE
        if cls.kind == kind:
            return cls.defaults
    raise ValueError(f"a dataset converted from {kind!r}: no source of that kind")


def describe(path: str) -> str:
    """``path`` for messages: as given (an s3:// URI) or absolute."""
    return path if is_remote(path) else str(Path(path).expanduser().absolute())


def check_reachable(path: str, field: str, error: type[ValueError] = ValueError) -> None:
    """An ``s3://`` path's bucket answers (nothing for a local one); ``error`` with the storage root check's
    message (`StorageLayout.check_reachable`: ``cannot reach the S3 endpoint ...``), naming ``field``."""
    if not is_remote(path):
        return
    try:
        StorageLayout.create(path, "download-path-check").check_reachable()
    except ValueError as exc:
        raise error(str(exc).replace(f"storage_root {path.rstrip('/')}", f"{field} {path}", 1)) from None
