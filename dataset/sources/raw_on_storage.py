"""MNIST's raw files already verified on the storage root, found without the network and without torchvision.

A download stage whose source's four files are already under ``<root>/raw/<source>/`` and match
their checksums has nothing to fetch; `verified_on_storage` says so before any probe of the official
mirrors (``download.source: auto``'s reachability check) and before torchvision is imported for the
official list of mirrors and md5s (torchvision imports torch: seconds and hundreds of MB in the
stage's worker). Which copies count, by source:

- ``official``: the official copy, checked against the official md5s;
- ``auto``: the official copy, else the bundled sample's copy (an earlier run that fell back): an
  offline machine re-runs without waiting for the probe's timeout; ``download.source=official``
  fetches the full set;
- ``sample``: the sample's copy, against the sample's sha256s.

``mirror`` is left to `dataset.sources.fetch.sync_files`, which already touches no network when its
folder verifies; ``folder`` and ``parquet`` read the user's data where it is.
"""

from __future__ import annotations

from pathlib import Path

from dataset.sources import mnist_files
from dataset.sources.fetch import verified_files
from dataset.sources.interface import RawData
from pipeline_config.common import MNIST_FILES, SAMPLE_DIR
from pipeline_config.data import DownloadConfig, MirrorChecksums
from storage_io import StorageLayout, local_copy

# torchvision's ``MNIST.mirrors`` and ``MNIST.resources`` as the locked torchvision has them, so the official copy
# is checked without importing torchvision; tests/test_startup.py compares them with torchvision's, so a
# torchvision that changes them fails there. `dataset.sources.mnist_files` still reads torchvision's when it must fetch.
OFFICIAL_MIRRORS = ("https://ossci-datasets.s3.amazonaws.com/mnist/", "http://yann.lecun.com/exdb/mnist/")
OFFICIAL_MD5 = {
    "train-images-idx3-ubyte.gz": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
    "train-labels-idx1-ubyte.gz": "d53e105ee54ea40749a09fcbcd1e9432",
    "t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
    "t10k-labels-idx1-ubyte.gz": "ec29112dd5afa0611ce80d1b7f02629c",
}

# The copies each source may reuse, in order of preference.
REUSABLE = {"official": ("official",), "auto": ("official", "sample"), "sample": ("sample",)}


def expected_checksums(key: str) -> tuple[str, dict[str, str]]:
    """(base URL the files are recorded as coming from, ``algorithm:digest`` of each file) for the
    ``official`` or ``sample`` copy. The official values are what `dataset.sources.mnist_files` would use (what a
    test set there), else torchvision's as copied above."""
    if key == "official":
        md5 = mnist_files.OFFICIAL_MD5 if mnist_files.OFFICIAL_MD5 is not None else OFFICIAL_MD5
        mirrors = mnist_files.OFFICIAL_MIRRORS if mnist_files.OFFICIAL_MIRRORS is not None else OFFICIAL_MIRRORS
        return mirrors[0], {name: f"md5:{md5[name]}" for name in MNIST_FILES}
    return SAMPLE_DIR.as_uri() + "/", {name: f"sha256:{digest}" for name, digest in MirrorChecksums().by_file().items()}


def verified_on_storage(cfg: DownloadConfig, layout: StorageLayout) -> RawData | None:
    """The raw files ``cfg.source`` would use, when a copy of them is on storage and every file matches
    its checksum (``skipped=True``: nothing fetched); None when there is none (the stage then resolves
    the source as usual: probe, fetch, verify)."""
    for key in REUSABLE.get(cfg.source, ()):
        url, expected = expected_checksums(key)
        directory = layout.raw_dir(key)
        with local_copy(directory, names=tuple(MNIST_FILES)) as local:
            files = verified_files(Path(local), expected)
        if files is not None:
            return RawData(source=key, url=url, directory=directory, files=files, skipped=True)
    return None
