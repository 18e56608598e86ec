"""MNIST's four IDX ``.gz`` files as a run's data (``download.source`` auto, official, mirror or sample).

Where the files come from, how they are fetched and verified: `dataset.sources.mnist_files` and `dataset.sources.fetch`;
their conversion to Parquet: `dataset.formats.parquet.convert`. The shape and classes are the format's
(1x28x28 digits 0-9), known before any work. The files are the pipeline's own copy under
``<root>/raw/<source>/``: cleanup may delete them (``cleanup.delete_raw``), and there is no folder
of the user's to watch.
"""

from __future__ import annotations

from dataset.formats.idx import IMAGE_SHAPE
from dataset.formats.parquet import FORMAT_VERSION, MNIST_CLASSES, convert
from dataset.sources import mnist_files
from dataset.sources.fetch import sync_files
from dataset.sources.interface import DataToCome, Defaults, RawData, Source, Written
from dataset.sources.mnist_files import resolve_source, source_key
from dataset.sources.raw_on_storage import verified_on_storage
from pipeline_config import ParquetConfig
from storage_io import StorageLayout, local_copy, sha256_json, storage_writes

# Settings only an image folder's conversion reads: left out of an IDX dataset's fingerprint, so
# MNIST's datasets keep the fingerprint (and folder) they had before these settings existed.
FOLDER_ONLY = {"split_seed"}


class IdxSource(Source):
    """MNIST's IDX files: fetched and verified into the storage root, converted by `dataset.formats.parquet.convert`."""
    predict_input = "<folder of IDX or Parquet digits>"

    kind = "idx"
    defaults = Defaults(measure_stats=False, augment="affine", fill="zeros")  # the seeds' 0.5 / 0.5; shift, rotation, zoom; black edges
    resizable = False
    user_data = False

    def check(self, image_size, storage_root, decode=True) -> DataToCome:
        """The format's: 1x28x28 digits 0-9 (the files themselves are verified by the download stage)."""
        return DataToCome(IMAGE_SHAPE, list(MNIST_CLASSES))

    def fetch(self, layout: StorageLayout | None, log) -> RawData:
        """Fetch and verify the four files (official, mirror or bundled sample) into ``<root>/raw/<source>/``;
        a re-run whose four files are present and verified touches no network at all."""
        cfg = self.cfg
        reused = verified_on_storage(cfg, layout) if layout is not None else None
        if reused is not None:  # verified on storage already: no probe of the mirrors, no torchvision, nothing fetched
            log.info("MNIST files already present and verified, no download, in %s (source=%s, %s)", reused.directory, reused.source, reused.url)
            return reused
        plan = resolve_source(cfg, layout)
        if plan.fell_back:
            log.warning(
                "official MNIST mirrors %s unreachable within %gs; falling back to the bundled 5,000-digit "
                "sample (4,000 train / 1,000 test), so accuracy will differ from full MNIST. "
                "Set download.source=official to fail instead.",
                ", ".join(mnist_files.official_mirrors()), cfg.connect_timeout_s,
            )
        directory = layout.raw_dir(source_key(plan))
        # On an S3 root the files are checked and fetched in a local folder, then uploaded.
        with storage_writes("download"), local_copy(directory, write_back=True) as local:
            files, skipped = sync_files(
                plan.base_url, local, plan.expected, cfg.attempts, cfg.backoff_s, log, cfg.read_timeout_s
            )
        state = "already present and verified, no download" if skipped else "verified"
        log.info("MNIST files %s in %s (source=%s, %s)", state, directory, plan.source, plan.base_url)
        return RawData(source=plan.source, url=plan.base_url, directory=directory, files=files, skipped=skipped)

    def fingerprint(self, raw: RawData, cfg: ParquetConfig, image_size: int | None) -> str:
        return sha256_json({"v": FORMAT_VERSION, "inputs": raw.files, "cfg": cfg.model_dump(exclude=FOLDER_ONLY)})[:16]

    def write(self, raw, cfg, staging, image_size, max_pixels, storage_root) -> Written:
        """The IDX files (copied from an S3 root first) converted by `dataset.formats.parquet.convert`."""
        with local_copy(raw.directory) as raw_dir:
            return Written(convert(raw_dir, staging, cfg))


SOURCE = IdxSource
