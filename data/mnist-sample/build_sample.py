"""Rebuild the bundled MNIST sample from the 5,000-digit CSV (run once, by hand).

    python data/mnist-sample/build_sample.py /path/to/mnist_5k.csv.gz

Writes the four IDX ``.gz`` files torchvision's ``MNIST`` reader expects, so the sample is
served exactly like any other mirror. Split rule: per class, the first 400 rows in file
order are train, the last 100 are test. gzip headers carry no timestamp, so the output
bytes (and the sha256 values pinned in ``pipeline_config``) are reproducible.
"""

from __future__ import annotations

import gzip
import hashlib
import struct
import sys
from pathlib import Path

import numpy as np

TRAIN_PER_CLASS = 400
TEST_PER_CLASS = 100


def idx_bytes(array: np.ndarray) -> bytes:
    """Encode a uint8 array in the IDX format (magic 0x0800 | ndim, then big-endian dims)."""
    header = struct.pack(">HBB", 0, 0x08, array.ndim)
    header += b"".join(struct.pack(">I", d) for d in array.shape)
    return header + np.ascontiguousarray(array, dtype=np.uint8).tobytes()


def split_rows(labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Row indices of the train and test split, per class and in file order."""
    train, test = [], []
    for digit in range(10):
        rows = np.flatnonzero(labels == digit)
        if len(rows) != TRAIN_PER_CLASS + TEST_PER_CLASS:
            raise ValueError(f"class {digit} has {len(rows)} rows, expected 500")
        train.append(rows[:TRAIN_PER_CLASS])
        test.append(rows[TRAIN_PER_CLASS:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


def main(csv_path: str) -> None:
    table = np.loadtxt(csv_path, delimiter=",", dtype=np.uint8)
    images, labels = table[:, :784].reshape(-1, 28, 28), table[:, 784]
    train, test = split_rows(labels)
    out = Path(__file__).parent
    files = {
        "train-images-idx3-ubyte.gz": images[train],
        "train-labels-idx1-ubyte.gz": labels[train],
        "t10k-images-idx3-ubyte.gz": images[test],
        "t10k-labels-idx1-ubyte.gz": labels[test],
    }
    for name, array in files.items():
        data = gzip.compress(idx_bytes(array), compresslevel=9, mtime=0)
        (out / name).write_bytes(data)
        print(f"{name}  {hashlib.sha256(data).hexdigest()}  rows={len(array)}")


if __name__ == "__main__":
    main(sys.argv[1])
