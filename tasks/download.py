"""Stage 1: the four MNIST IDX ``.gz`` files, verified, in ``<root>/raw/<source>/``; or, with
``download.source=folder``, the user's labelled image folder checked and listed where it is.

The sources, the mirrors' probe, the retries and the checks are in `dataset.sources`. On an S3
root the files are checked and fetched in a local folder, then uploaded; a re-run whose four
files are present and verified touches no network at all.
"""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from dataset import folder, sources
from dataset.fetch import sync_files
from dataset.sources import RawData, resolve_source, source_key
from pipeline_config import DownloadConfig
from reporting.logs import stage_logger
from storage_io import StorageLayout, local_copy, storage_writes


# NO_CACHE: the verified files on disk are the cache; a cached result could point at files
# that were deleted since.
@task(name="download", cache_policy=NO_CACHE)
def download(cfg: DownloadConfig, layout: StorageLayout) -> RawData:
    """Fetch and verify the four MNIST IDX files (official, mirror or bundled sample)."""
    log = stage_logger(__name__)
    if cfg.source == "folder":
        return list_folder(cfg, log, layout)
    plan = resolve_source(cfg, layout)
    if plan.fell_back:
        log.warning(
            "official MNIST mirrors %s unreachable within %gs; falling back to the bundled 5,000-digit "
            "sample (4,000 train / 1,000 test), so accuracy will differ from full MNIST. "
            "Set download.source=official to fail instead.",
            ", ".join(sources.official_mirrors()), cfg.connect_timeout_s,
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


def list_folder(cfg: DownloadConfig, log, layout: StorageLayout | None = None) -> RawData:
    """source=folder: check the layout and record every image's sha256 (the dataset's fingerprint
    changes when the data does). Nothing is copied: the folder is read where it is, and never deleted.

    ``layout``: its storage root keeps the listing cache (`dataset.listing`): an image whose size and
    mtime are unchanged since an earlier run reuses its sha256, so an unchanged folder is listed, not
    read. An edit that keeps both size and mtime is not noticed. None: every image is hashed."""
    assert cfg.path is not None  # DownloadConfig refuses source=folder without a path
    found = folder.check_folder(cfg.path)
    cache = folder.listing_cache(found, layout.root if layout is not None else None)
    files = folder.folder_files(found, cache)
    cache.save()
    counts = {split: len(rows) for split, rows in found.files.items()}
    log.info("Image folder %s: %d classes (%s), images %s", cfg.path, len(found.classes), ", ".join(found.classes), counts)
    return RawData(source="folder", url=cfg.path, directory=cfg.path, files=files, skipped=False)
