"""MNIST-shaped test data: synthetic IDX files and a file:// mirror of a few real digits."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np

from storage_io import sha256_file


def idx_bytes(array: np.ndarray) -> bytes:
    """IDX encoding of a uint8 array (the format the MNIST files use)."""
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + b"".join(struct.pack(">I", d) for d in array.shape)
    return header + np.ascontiguousarray(array, dtype=np.uint8).tobytes()


def synthetic_digits(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(n, 28, 28) uint8 images whose top-left pixel encodes the row index mod 256, and labels."""
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
    images[:, 0, 0] = np.arange(n) % 256
    labels = (np.arange(n) % 10).astype(np.uint8)
    return images, labels


def write_raw(folder: Path, n_train: int = 120, n_test: int = 40) -> dict:
    """Write the four IDX .gz files of a synthetic dataset; return a RawData-compatible dict."""
    folder.mkdir(parents=True, exist_ok=True)
    train_x, train_y = synthetic_digits(n_train, seed=1)
    test_x, test_y = synthetic_digits(n_test, seed=2)
    arrays = {
        "train-images-idx3-ubyte.gz": train_x,
        "train-labels-idx1-ubyte.gz": train_y,
        "t10k-images-idx3-ubyte.gz": test_x,
        "t10k-labels-idx1-ubyte.gz": test_y,
    }
    for name, array in arrays.items():
        (folder / name).write_bytes(gzip.compress(idx_bytes(array), mtime=0))
    files = {name: sha256_file(folder / name) for name in arrays}
    return {"source": "mirror", "url": folder.as_uri() + "/", "directory": str(folder), "files": files, "skipped": False}


def real_digits_mirror(folder: Path, train_per_class: int, test_per_class: int) -> list[str]:
    """A file:// mirror of a few real digits taken from the bundled sample; returns the CLI flags that use it.

    Real digits (not random pixels) so a couple of epochs learn something measurable.
    """
    from pipeline_config.common import SAMPLE_DIR

    def read(name: str) -> np.ndarray:
        data = gzip.decompress((SAMPLE_DIR / name).read_bytes())
        ndim = data[3]
        shape = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
        return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)

    def pick(labels: np.ndarray, per_class: int) -> np.ndarray:
        return np.sort(np.concatenate([np.flatnonzero(labels == c)[:per_class] for c in range(10)]))

    folder.mkdir(parents=True, exist_ok=True)
    train_y, test_y = read("train-labels-idx1-ubyte.gz"), read("t10k-labels-idx1-ubyte.gz")
    train_rows, test_rows = pick(train_y, train_per_class), pick(test_y, test_per_class)
    arrays = {
        "train-images-idx3-ubyte.gz": read("train-images-idx3-ubyte.gz")[train_rows],
        "train-labels-idx1-ubyte.gz": train_y[train_rows],
        "t10k-images-idx3-ubyte.gz": read("t10k-images-idx3-ubyte.gz")[test_rows],
        "t10k-labels-idx1-ubyte.gz": test_y[test_rows],
    }
    flags = ["--download.source", "mirror", "--download.mirror-url", folder.as_uri() + "/"]
    for (name, array), field in zip(arrays.items(), ("train-images", "train-labels", "test-images", "test-labels")):
        (folder / name).write_bytes(gzip.compress(idx_bytes(array), mtime=0))
        flags += [f"--download.mirror-sha256.{field}", sha256_file(folder / name)]
    return flags


def shuffled_labels_mirror(folder: Path) -> list[str]:
    """A file:// mirror of the whole bundled sample with every training label shuffled (a broken
    pipeline's data: nothing to learn); returns the CLI flags that use it."""
    from pipeline_config.common import SAMPLE_DIR

    folder.mkdir(parents=True, exist_ok=True)
    flags = ["--download.source", "mirror", "--download.mirror-url", folder.as_uri() + "/"]
    for name, field in (("train-images-idx3-ubyte.gz", "train-images"), ("train-labels-idx1-ubyte.gz", "train-labels"),
                        ("t10k-images-idx3-ubyte.gz", "test-images"), ("t10k-labels-idx1-ubyte.gz", "test-labels")):
        content = (SAMPLE_DIR / name).read_bytes()
        if name == "train-labels-idx1-ubyte.gz":
            labels = np.frombuffer(gzip.decompress(content), dtype=np.uint8, offset=8)
            content = gzip.compress(idx_bytes(np.random.default_rng(0).permutation(labels)), mtime=0)
        (folder / name).write_bytes(content)
        flags += [f"--download.mirror-sha256.{field}", sha256_file(folder / name)]
    return flags
