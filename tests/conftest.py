"""Shared fixtures: a storage layout, a local Ray, the session's Ray cluster, the loopback S3 server, a run tree, Prefect servers.

The plain helpers these fixtures use (and test modules import) are in ``tests/support/``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from storage_io import StorageLayout
from tests.support.mlflow_server import MlflowServer
from tests.support.prefect_server import PrefectServer
from tests.support.ray_cluster import SharedRay, check_workers_not_shared, shared_cluster
from tests.support.s3 import S3_TEST_ENV, s3_bucket, unique_bucket_name
from tests.support.system_parts import ENV as SYSTEM_PARTS_ENV
from tests.support.system_parts import PARTS, REQUIRED, missing, required


def pytest_configure(config):
    """Once, in the controller (with pytest-xdist, as `make test` runs, before its workers start): stop at once when
    SYSTEM_PARTS=required and a system part is missing; make the home's Ray token, so two workers' session clusters
    never each generate one."""
    if hasattr(config, "workerinput"):
        return
    absent = missing()
    if absent and required():  # CI: nothing may be skipped for a missing part (before any worker starts)
        lines = "; ".join(part.missing_line() for part in absent)
        raise pytest.UsageError(f"{SYSTEM_PARTS_ENV}={REQUIRED} and {lines}")
    from runner.cluster.ray_head import ensure_token, head_env

    ensure_token(head_env())


@pytest.fixture(autouse=True)
def no_tracking_unless_asked(monkeypatch):
    """A developer's MLFLOW_TRACKING_URI (or one a library wrote into os.environ) must not send every
    test run to an MLflow: the tests that check tracking start their own server and pass its address."""
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory) -> Iterator[MlflowServer]:
    """A real MLflow tracking server on 127.0.0.1 for the module (SQLite backend), stopped afterwards."""
    server = MlflowServer(tmp_path_factory.mktemp("mlflow")).start()
    try:
        yield server
    finally:
        server.stop()


CLUSTER_OPT_IN = "RUN_CLUSTER_TESTS"


@pytest.hookimpl(trylast=True)  # after -m has deselected: only the tests that will run are counted
def pytest_collection_modifyitems(config, items):
    """Tests marked ``cluster`` run only with RUN_CLUSTER_TESTS=1 (`make test-cluster`); a skip otherwise, by design.
    A test marked ``spine`` must be marked ``slow`` too (docs/testing.md, Tiers).

    They need Docker and the image `make image` builds, and take minutes, so neither `make test`
    (CI) nor `make test-fast` runs them. A hook rather than addopts' ``-m "not cluster"``, which the
    ``-m "not slow"`` of `make test-fast` would replace.
    """
    loose = [item.nodeid for item in items if "spine" in item.keywords and "slow" not in item.keywords]
    if loose:  # the spine is the part of the slow tier CI runs: a spine test outside it would be a third tier
        raise pytest.UsageError(f"marked spine but not slow: {loose}")
    skip_for_missing_parts(items)
    if os.environ.get(CLUSTER_OPT_IN) == "1":
        return
    skip = pytest.mark.skip(reason=f"cluster test: opt in with `make test-cluster` ({CLUSTER_OPT_IN}=1), needs Docker")
    for item in items:
        if "cluster" in item.keywords:
            item.add_marker(skip)


def skip_for_missing_parts(items) -> None:
    """A test marked ``needs("<part>")`` (a system program, `tests.support.system_parts`) is skipped with one reason
    naming the part and its install command when the part is absent (with SYSTEM_PARTS=required, as in CI, the
    session has already stopped in `pytest_configure`)."""
    absent = {part.name: part for part in missing()}
    for item in items:
        for marker in item.iter_markers("needs"):
            name = marker.args[0]
            if name not in PARTS:
                raise pytest.UsageError(f"{item.nodeid}: needs({name!r}) names no part of tests/support/system_parts.py")
            if name in absent:
                item.add_marker(pytest.mark.skip(reason=absent[name].missing_line()))


def pytest_unconfigure(config):
    """The session's last line(s), after pytest's own totals: how many tests were skipped for which missing part, and
    what to run. Counted from the skip reports, which reach this process from pytest-xdist's workers too."""
    terminalreporter = config.pluginmanager.get_plugin("terminalreporter")
    if terminalreporter is None or hasattr(config, "workerinput"):
        return
    reasons = {part.missing_line(): part for part in missing()}
    counts: dict[str, int] = {}
    for report in terminalreporter.stats.get("skipped", []):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else ""
        part = reasons.get(reason.removeprefix("Skipped: "))
        if part is not None:
            counts[part.name] = counts.get(part.name, 0) + 1
    for name, count in counts.items():
        terminalreporter.write_line(
            f"{count} test(s) skipped because {name} is not installed: install it with `{PARTS[name].install_command()}` "
            "(or run `make test` as root, which installs it)", yellow=True,
        )


@pytest.fixture
def layout(tmp_path) -> StorageLayout:
    return StorageLayout.create(str(tmp_path / "storage"), "test-run")


@pytest.fixture(scope="module")
def local_ray():
    """A real local Ray (2 CPUs) for the module, shut down afterwards."""
    import ray

    from runner.cluster.ray_head import LOCAL_RAY_SYSTEM_CONFIG  # as a run's own local Ray

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


@pytest.fixture(scope="session")
def shared_server(tmp_path_factory) -> Iterator[PrefectServer]:
    """One ``prefect server start`` for the whole session, for runs that are not about the Prefect server.

    A CLI run without ``PREFECT_API_URL`` starts (and stops) a temporary server of its own, about
    5 s of each run on the 2-core CI machine; runs that only need *a* Prefect API (fault tolerance,
    concurrent runs, the e2e flow, promotion) point ``PREFECT_API_URL`` at this one instead
    (``tests.support.prefect_server.api_env``), as deployments and ``make run`` with a server up
    do. The tests about the temporary server itself (first start, stopping, the tune search
    killed whole) keep their own. Its flow runs and artifacts outlive their test: a test reads
    its own flow run by id, and a "latest" artifact only right after its own run wrote it.
    """
    srv = PrefectServer(tmp_path_factory.mktemp("shared-prefect") / "prefect-home").start()
    try:
        yield srv
    finally:
        srv.stop()



# --- one Ray cluster for the session ----------------------------------------------------------


@pytest.fixture(scope="session")
def shared_ray(tmp_path_factory) -> Iterator[SharedRay]:
    """One ``ray start --head`` for the whole session, which the end-to-end runs that are not about the CLI's
    own local Ray join, as the runs of a deployment join its cluster (tests/support/ray_cluster.py).

    A run joins it through ``tests.support.ray_cluster.join_env`` (CLI runs) or
    ``serve_deployments(..., ray=shared_ray)`` (``deployments.serve --ray-address``). The tests about the local Ray a CLI run starts and stops (the default
    smoke run, Ctrl-C, SIGKILL, the first start) keep theirs. Checked once when it starts: two
    drivers in a row get disjoint worker processes, working in the head's empty folder; checked when
    the session ends: no run wrote into that folder.
    """
    with shared_cluster(tmp_path_factory.mktemp("shared-ray")) as cluster:
        check_workers_not_shared(cluster)
        yield cluster
        stray = cluster.stray_files()
    assert not stray, f"Ray workers wrote into their working folder {cluster.cwd} instead of a storage root: {stray}"


# Every way Python code reads a tensor's value back to the host: on a GPU each one waits for the device.
HOST_READS = ("item", "tolist", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__")


@pytest.fixture
def host_reads(monkeypatch) -> dict[str, int]:
    """How many times each of `HOST_READS` was called on a tensor while the test ran (what the training loop must
    not do per step)."""
    import torch  # here: most tests never load torch in this process

    counts: dict[str, int] = {}

    def counting(name, method):
        def read(self, *args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return method(self, *args, **kwargs)
        return read

    for name in HOST_READS:
        monkeypatch.setattr(torch.Tensor, name, counting(name, getattr(torch.Tensor, name)))
    return counts
