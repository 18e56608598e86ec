"""Where a run's data comes from: the `Source` protocol, and the functions every stage asks instead of a source's kind.

A source is one module with one `Source` subclass (``SOURCE``), registered by one line of
`pipeline_config.sources.SOURCES` (docs/extending.md, "A source of your own"). It answers four questions, and
a fifth with a default:

- `Source.check`: what the data is before any work: its images' shape and its classes, or a ValueError naming the
  field or the file (the checks before any work, the model's trial, ``transform.image_size: auto``, the cluster check);
- `Source.fetch`: the data listed, fetched when it is not the user's, and checksummed (the download stage's `RawData`);
- `Source.fingerprint`: the key of a conversion, the data's checksums and every setting that changes the output;
- `Source.write`: the data's train/val/test splits written in a staging folder (the conversion stage). Staging,
  the manifest, publishing and the stage's line are `dataset.sources.writer`'s, the same for every source;
- `Source.read_inputs`: the images to score with a model trained on its data (``flows.predict``, ``flows.score``):
  by default Parquet, IDX or image files, whatever the source (`dataset.inputs.read`).

What is not a question is a class attribute: whether the data is the user's (never copied, changed or deleted,
and watched for new data), whether its images may be resized, its transform defaults, the ``download`` fields
later stages read. The functions below turn those into what cleanup may delete (`RawData.deletable`), what a
watcher watches (`watched`), what a search's best config names (`best_config_data`) and the listing cache the
checks held (`keep_checks`). A source's module is imported when a run first asks for it (`source_for`).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Literal, NamedTuple

import pydantic

from dataset.formats.listing import save_held
from pipeline_config import DownloadConfig
from pipeline_config.sources import SOURCES
from storage_io import StorageLayout, is_remote

if TYPE_CHECKING:  # annotations only
    import pyarrow as pa

    from pipeline_config import ParquetConfig


class Defaults(NamedTuple):
    """What the transform makes of ``transform.mean``/``std`` unset and ``transform.augment: auto``."""

    measure_stats: bool  # True: the training split's own per-channel mean and std; False: 0.5 / 0.5
    augment: str  # the choice ``auto`` stands for (`dataset.tensors.augment.CHOICES`)
    fill: str = "border"  # what an augmentation shows where it uncovers the border: "border" (its edge pixels), "zeros"


# What a download stage's data is called: a source's name, ``auto`` made concrete (`pipeline_config.sources.SOURCES`).
SourceName = Literal[tuple(name for name in SOURCES if name != "auto")]  # type: ignore[valid-type]


class DataToCome(NamedTuple):
    """What a source's `Source.check` found before any work: the images' (channels, height, width) as the run
    converts them (None where not known before the conversion: an ``s3://`` folder's) and the class names."""

    shape: tuple[int | None, int | None, int | None]
    classes: list[str]

    @property
    def known(self) -> bool:
        """Whether the whole shape is known before any work (the model is then tried on it before the run starts)."""
        return all(side is not None for side in self.shape)

    def for_trial(self, image_size: int | None = None) -> tuple[tuple[int, int, int], int] | None:
        """((channels, height, width), number of classes) for the model's trial, when the shape is known; ``image_size``:
        the square size the images are resized to (None: as checked)."""
        if not self.known:
            return None
        channels, height, width = (int(side) for side in self.shape)
        return ((channels, image_size, image_size) if image_size else (channels, height, width)), len(self.classes)


class Written(NamedTuple):
    """What `Source.write` wrote in the staging folder, for its manifest and the stage's line."""

    rows: dict[str, int]  # rows per split
    shape: tuple[int, int, int] | None = None  # (channels, height, width); None: MNIST's, the manifest's default
    classes: list[str] | None = None  # None: MNIST's digits
    detail: str = ""  # what the stage's line adds after the rows (the image size, where validation came from)


class RawData(pydantic.BaseModel):
    """The verified raw files of one data source, as the next stages consume them."""

    source: SourceName = pydantic.Field(description="Where the files came from.")
    url: str = pydantic.Field(description="Base URL the files were fetched from (or would be, when skipped).")
    directory: str = pydantic.Field(description="Absolute folder holding the four files (source=folder or parquet: the user's folder).")
    files: dict[str, str] = pydantic.Field(description="File name (source=folder or parquet: path under the folder) -> sha256 of the file.")
    skipped: bool = pydantic.Field(description="True when all four files were already present and verified (source=folder: never, every image is listed and hashed).")
    options: dict[str, str] = pydantic.Field(
        default={}, description="The download settings the conversion reads besides the path (source=parquet: image_column, label_column).")
    notes: list[str] = pydantic.Field(
        default=[], description="What the listing passed over (hidden entries, links), said by the conversion's line whether it converts or reuses.")

    def terminal_detail(self) -> str:
        """What the download stage's closing terminal line adds after its name and seconds."""
        return f": {self.source} data{' (verified on storage, reused)' if self.skipped else ''}"

    def deletable(self) -> list[str]:
        """What cleanup's ``delete_raw`` may delete of this data: the IDX files' folder under the storage root; nothing
        of a user's folder, which is read where it is (`Source.user_data`)."""
        return [] if source_class(self.source).user_data else [self.directory]


class Source:
    """One kind of data a run trains on, built from the run's ``download`` section (`source_for`), or from the
    download stage's `RawData` in later stages (`source_of`), whose ``options`` stand for the section's fields.

    Class attributes:
        kind: what `dataset.formats.parquet.ParquetDataset.source` records (``idx``, ``folder``, ``parquet``):
            it picks the transform's defaults (`defaults_for`) in every later stage.
        defaults: the normalization and augmentation defaults of this kind of data.
        resizable: the images may be resized (``transform.image_size``); MNIST's IDX digits are not.
        user_data: the data is the user's, read where it is (``download.path``): never copied, changed or deleted,
            and the watcher watches it.
        options: the ``download`` fields besides ``path`` that later stages read (`RawData.options`), and that a
            search's best config names so the winner trains on the same data.
        title: what the data is called in the stages' log lines (``Image folder: 2 hidden entries skipped``).
        predict_input: what ``flows.predict --input`` takes for data like this, in the closing lines' hint.
    """

    kind: ClassVar[str]
    title: ClassVar[str] = "Data"
    defaults: ClassVar[Defaults] = Defaults(measure_stats=True, augment="shifts")
    resizable: ClassVar[bool] = True
    user_data: ClassVar[bool] = True
    options: ClassVar[tuple[str, ...]] = ()
    predict_input: ClassVar[str] = "<folder of images, IDX or Parquet files>"

    def __init__(self, cfg: DownloadConfig):
        self.cfg = cfg

    def check(self, image_size: int | None, storage_root: str | None, decode: bool = True) -> DataToCome:
        """Before any work: the data's shape (at ``image_size``, None: the images' own) and classes; a ValueError naming
        the field or the file of data that cannot be used. ``decode``: every image read in full, as the checks before
        any work do (else as much as the shape needs, from the listing cache on ``storage_root`` when it has them).
        What the check learns of a user's files is held in this process (`keep_checks` writes it), never written here."""
        raise NotImplementedError

    def fetch(self, layout: StorageLayout | None, log) -> RawData:
        """The download stage: list (and fetch, when the data is not the user's) and checksum the data."""
        raise NotImplementedError

    def fingerprint(self, raw: RawData, cfg: ParquetConfig, image_size: int | None) -> str:
        """Content key of a conversion: the data's checksums plus every setting that changes the output."""
        raise NotImplementedError

    def write(self, raw: RawData, cfg: ParquetConfig, staging: Path, image_size: int | None, max_pixels: int | None,
              storage_root: str | None) -> Written:
        """The conversion: every split of ``raw`` in `dataset.formats.parquet`'s layout under ``staging`` (a local folder
        that `dataset.sources.writer.convert` publishes whole with its manifest). ``image_size``: the square size the
        images are resized to (None: their own); ``max_pixels``: checked again as images are decoded (None: not again)."""
        raise NotImplementedError

    def read_inputs(self, folder: str, shape: tuple[int, int, int], classes: list[str], image_size: int | None) -> pa.Table:
        """``flows.predict`` and ``flows.score``: the images in ``folder`` to score with a model trained on this source's
        data, at the model card's ``shape``, ``classes`` and ``image_size``, as one table of the dataset schema (row_id,
        image, label: -1 where there is none); a ValueError naming the file. By default what any model scores: Parquet,
        IDX or PNG/JPEG files (`dataset.inputs.read.read_folder`), Parquet images read from this run's
        ``download.image_column`` and ``label_column``. A source whose own files should be scored too reads them here."""
        from dataset.inputs.read import read_folder  # PIL, pyarrow.parquet: only a command that scores loads them

        return read_folder(folder, shape, classes, image_size, (self.cfg.image_column, self.cfg.label_column))


def source_class(name: str) -> type[Source]:
    """The `Source` class of ``download.source`` (or a `RawData.source`) ``name``; ValueError naming it when unknown."""
    entry = SOURCES.get(name)
    if entry is None:
        raise ValueError(f"download.source {name!r}: not one of {', '.join(SOURCES)}")
    return importlib.import_module(entry.module).SOURCE


def predict_input(name: str | None) -> str:
    """What ``flows.predict --input`` takes for data of the ``download.source`` ``name`` (any input when unknown)."""
    return source_class(name).predict_input if name in SOURCES else Source.predict_input


def source_for(cfg: DownloadConfig) -> Source:
    """The source the ``download`` section names."""
    return source_class(cfg.source)(cfg)


def source_of(raw: RawData) -> Source:
    """The source of the download stage's ``raw``: its folder and options (`RawData.options`) stand for the
    ``download`` section; a source that reads no ``download.path`` (MNIST's) reads only ``raw`` itself."""
    cls = source_class(raw.source)
    reads_path = SOURCES[raw.source].path is not None
    return cls(DownloadConfig(source=raw.source, path=raw.directory, **raw.options) if reads_path else DownloadConfig())


def check_data(cfg: DownloadConfig, image_size: int | None = None, storage_root: str | None = None) -> DataToCome:
    """Before any work: the run's data checked in full (`Source.check` with every image decoded); what it found."""
    return source_for(cfg).check(image_size, storage_root)


def keep_checks(cfg: DownloadConfig, storage_root: str | None) -> None:
    """Once the run is past every check before its work: write what `check_data` learned of a user's local files
    (the listing cache it held, `dataset.formats.listing`) to ``storage_root``; nothing for other data."""
    if storage_root and cfg.path and not is_remote(cfg.path):
        save_held(storage_root, cfg.path)


def known_before_work(cfg: DownloadConfig) -> bool:
    """Whether the data's shape is known before any work: not for an ``s3://`` folder, whose images are first read by
    the conversion (the model is then tried on the converted dataset)."""
    return not is_remote(cfg.path or "")


def watched(cfg: DownloadConfig) -> str | None:
    """The path a watcher looks at for new data (`dataset.formats.watching`): the user's folder; None: nothing to watch."""
    return cfg.path if source_class(cfg.source).user_data else None


def best_config_data(cfg: DownloadConfig) -> dict | None:
    """The ``download`` values a search's best config names, so the winner trains on the same data (None: the defaults')."""
    cls = source_class(cfg.source)
    if not cls.user_data:
        return None
    return {"source": cfg.source, "path": cfg.path, **{name: getattr(cfg, name) for name in cls.options}}


def defaults_for(kind: str) -> Defaults:
    """The transform's defaults for a dataset converted from ``kind`` (`dataset.formats.parquet.ParquetDataset.source`)."""
    for module in dict.fromkeys(entry.module for entry in SOURCES.values()):
        cls = importlib.import_module(module).SOURCE
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
