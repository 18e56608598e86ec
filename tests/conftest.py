"""Shared fixtures: a storage layout, a local Ray, the loopback S3 server, a run tree, a Prefect server.

The plain helpers these fixtures use (and test modules import) are in ``tests/support/``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from storage_io import StorageLayout
from tests.support.prefect_server import PrefectServer
from tests.support.s3 import S3_TEST_ENV, s3_bucket, unique_bucket_name


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


@pytest.fixture
def run_tree(tmp_path):
    """A run folder with checkpoints, raw files and a dataset: (layout, raw, dataset, trained, evaluation)."""
    from tests.support.runs import build_run_tree  # imports Ray, Prefect and torch: only where the fixture is used

    return build_run_tree(tmp_path)


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


@pytest.fixture
def s3_root(s3_server, monkeypatch, request) -> str:
    """A fresh bucket on the loopback S3 server with the AWS_* environment pointing at it; its root URI."""
    for key, value in S3_TEST_ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server)
    return s3_bucket(s3_server, unique_bucket_name(request)) + "/mnist"


# --- a real Prefect server --------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(work) -> Iterator[PrefectServer]:
    """``prefect server start`` for the module, its PREFECT_HOME in ``work`` (a module-scoped fixture each using module defines)."""
    srv = PrefectServer(work / "prefect-home").start()
    try:
        yield srv
    finally:
        srv.stop()
