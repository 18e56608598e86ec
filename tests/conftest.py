"""Shared fixtures: tiny synthetic MNIST-shaped IDX files and a local Ray for data tests."""

from __future__ import annotations

import gzip
import uuid
import struct
from pathlib import Path

import numpy as np
import pytest

from tasks.common.storage import StorageLayout, sha256_file


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


@pytest.fixture
def layout(tmp_path) -> StorageLayout:
    return StorageLayout.create(str(tmp_path / "storage"), "test-run")


@pytest.fixture(scope="module")
def local_ray():
    """A real local Ray (2 CPUs) for the module, shut down afterwards."""
    import ray

    from flows.runtime import LOCAL_RAY_SYSTEM_CONFIG  # as a run's own local Ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, _system_config=LOCAL_RAY_SYSTEM_CONFIG)
    try:
        yield ray
    finally:
        ray.shutdown()


def real_digits_mirror(folder: Path, train_per_class: int, test_per_class: int) -> list[str]:
    """A file:// mirror of a few real digits taken from the bundled sample; returns the CLI flags that use it.

    Real digits (not random pixels) so a couple of epochs learn something measurable.
    """
    import gzip as _gzip

    from pipeline_config.model import SAMPLE_DIR

    def read(name: str) -> np.ndarray:
        data = _gzip.decompress((SAMPLE_DIR / name).read_bytes())
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
        (folder / name).write_bytes(_gzip.compress(idx_bytes(array), mtime=0))
        flags += [f"--download.mirror-sha256.{field}", sha256_file(folder / name)]
    return flags


# --- S3-compatible object storage on loopback -------------------------------------------------


@pytest.fixture(scope="session")
def s3_server():
    """moto's standalone S3 server on 127.0.0.1 (a real HTTP server speaking the S3 API); its endpoint URL."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


S3_TEST_ENV = {"AWS_ACCESS_KEY_ID": "test-key", "AWS_SECRET_ACCESS_KEY": "test-secret", "AWS_REGION": "us-east-1"}


def s3_bucket(endpoint: str, name: str) -> str:
    """Create bucket ``name`` on the test server; return its ``s3://`` root."""
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                          aws_access_key_id="test-key", aws_secret_access_key="test-secret")
    client.create_bucket(Bucket=name)
    return f"s3://{name}"


@pytest.fixture
def s3_root(s3_server, monkeypatch, request) -> str:
    """A fresh bucket on the loopback S3 server with the AWS_* environment pointing at it; its root URI."""
    for key, value in S3_TEST_ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server)
    return s3_bucket(s3_server, unique_bucket_name(request)) + "/mnist"


def unique_bucket_name(request) -> str:
    """A valid S3 bucket name from the test's name, unique within the session."""
    stem = "".join(c if c.isalnum() else "-" for c in request.node.name.lower())[:40].strip("-")
    return f"t-{stem}-{uuid.uuid4().hex[:8]}"
