"""Stage 1: the run's data, listed and fingerprinted (`dataset.sources.interface.Source.fetch`).

MNIST's four IDX ``.gz`` files are fetched and verified into ``<root>/raw/<source>/`` (on an S3 root
checked and fetched in a local folder, then uploaded; a re-run whose four files are present and
verified touches no network at all: `dataset.sources.idx_source`). A user's image folder or Parquet folder
is checked and listed where it is, each file's sha256 recorded (`dataset.sources.folder_source`,
`dataset.sources.parquet_source`).
"""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from dataset.sources.interface import RawData, source_for
from pipeline_config import DownloadConfig
from reporting.logs import stage_logger
from storage_io import StorageLayout


# NO_CACHE: the verified files on disk are the cache; a cached result could point at files
# that were deleted since.
@task(name="download", cache_policy=NO_CACHE)
def download(cfg: DownloadConfig, layout: StorageLayout) -> RawData:
    """Fetch and verify the four MNIST IDX files (official, mirror or bundled sample), or list the user's data."""
    return source_for(cfg).fetch(layout, stage_logger(__name__))


def list_folder(cfg: DownloadConfig, log, layout: StorageLayout | None = None) -> RawData:
    """A user's folder (source=folder or parquet) checked and listed where it is, every file's sha256 recorded
    (through the listing cache on ``layout``'s storage root when given); nothing is copied."""
    return source_for(cfg).fetch(layout, log)
