"""Start-up: what a stage that neither trains nor scores imports, and a download whose data is already verified.

Stages that do not train or score (download, to-parquet, promote, cleanup) must not import torch or
Ray Train: checked on the stage modules in fresh interpreters, and on the real stages run in a fresh
Ray worker of a real local Ray against a real Prefect server. The flow modules must not import torch
either: Prefect's Ray task runner ships the flow run's context, the flow included, with every stage,
so each stage's Ray worker imports the flow's module, and with it whatever that imports. The model's
trial before any work runs in a process that ends, so the flow's own process loads no torch. A download whose files are already on
storage and verify touches no network: a real HTTP server on loopback stands in for the official
mirrors and counts every connection and request.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

import dataset.sources.mnist_files as sources
from dataset.sources import raw_on_storage
from pipeline_config.common import MNIST_FILES, SAMPLE_DIR
from pipeline_config.data import DownloadConfig, MirrorChecksums
from storage_io import StorageLayout
from tasks.download import download
from tests.support.cli import ROOT

LIGHT_STAGES = ("tasks.download", "tasks.to_parquet", "tasks.promote", "tasks.cleanup")
HEAVY = ("torch", "torchvision", "ray.train")  # what a stage that does not train or score must not import
FLOWS = ("flows.mnist", "flows.train", "flows.tune")  # imported by every stage's worker: no torch (Ray Train's names are light)
SAMPLE_BYTES = {name: (SAMPLE_DIR / name).read_bytes() for name in MNIST_FILES}
SAMPLE_MD5 = {name: hashlib.md5(data).hexdigest() for name, data in SAMPLE_BYTES.items()}


@pytest.mark.parametrize("module", [*LIGHT_STAGES, *FLOWS])
def test_a_stage_that_neither_trains_nor_scores_imports_no_torch(module):
    heavy = HEAVY if module in LIGHT_STAGES else ("torch", "torchvision")
    code = f"import sys, {module}; print(sorted(m for m in {heavy!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", f"importing {module} imported {out.stdout.strip()}"


def test_the_model_is_tried_in_a_process_that_ends_and_the_flows_process_loads_no_torch(tmp_path):
    """The CLI's checks before any work (`runner.harness.checked_settings`) try ResNet-18 and the small CNN on the
    sample's digits and refuse a function the module lacks, naming model.name with the refusal's own class, and
    the checking process has loaded neither torch nor torchvision afterwards (issue 67: the driver holds no torch)."""
    code = f"""
import json, sys
from pipeline_config.settings import PipelineSettings
from runner.harness import checked_settings
root = {str(tmp_path / "storage")!r}
for name in ("resnet18", "training.model.catalog:small_cnn"):
    checked_settings(["--storage-root", root, "--model.name", name], PipelineSettings)
try:
    checked_settings(["--storage-root", root, "--model.name", "training.model.catalog:no_such_net"], PipelineSettings)
    refused = None
except ValueError as exc:
    refused = [type(exc).__name__, str(exc)]
print(json.dumps({{"refused": refused, "loaded": sorted(m for m in ("torch", "torchvision") if m in sys.modules)}}))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    answer = json.loads(out.stdout.strip().splitlines()[-1])
    assert answer["loaded"] == []
    assert answer["refused"][0] == "ModelNameError"
    assert answer["refused"][1].startswith("model.name 'training.model.catalog:no_such_net': training.model.catalog has no function")


def test_the_copied_official_checksums_are_torchvisions():
    from torchvision.datasets import MNIST

    assert raw_on_storage.OFFICIAL_MIRRORS == tuple(MNIST.mirrors)
    assert raw_on_storage.OFFICIAL_MD5 == dict(MNIST.resources)


class CountingMirror:
    """An HTTP mirror on 127.0.0.1 serving the sample's four files; counts every connection it accepts
    (the reachability probe only connects) and every request."""

    def __init__(self):
        self.connections, self.requests = 0, []
        mirror = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                name = self.path.rsplit("/", 1)[-1]
                mirror.requests.append(name)
                body = SAMPLE_BYTES.get(name)
                if body is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def verify_request(self, request, client_address):
                mirror.connections += 1
                return True

        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_port}/"

    def touched(self) -> int:
        return self.connections + len(self.requests)


@pytest.fixture
def counting_mirror(monkeypatch):
    for var in ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    mirror = CountingMirror()
    thread = threading.Thread(target=mirror.httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    monkeypatch.setattr(sources, "OFFICIAL_MIRRORS", (mirror.url,))  # the loopback server stands in for the official mirrors
    monkeypatch.setattr(sources, "OFFICIAL_MD5", SAMPLE_MD5)
    yield mirror
    mirror.httpd.shutdown()
    mirror.httpd.server_close()
    thread.join(5)


@pytest.mark.parametrize("source", ["official", "auto"])
def test_a_verified_official_copy_is_reused_without_the_network(counting_mirror, tmp_path, source):
    layout = StorageLayout(root=str(tmp_path / "storage"), run_name="t")
    first = download.fn(DownloadConfig(source=source, backoff_s=0.01), layout)
    assert (first.source, first.skipped) == ("official", False)
    assert set(counting_mirror.requests) == set(MNIST_FILES)  # every file fetched (a HEAD-like check may ask twice)
    counting_mirror.connections, counting_mirror.requests = 0, []

    start = time.perf_counter()
    again = download.fn(DownloadConfig(source=source), layout)
    seconds = time.perf_counter() - start

    assert counting_mirror.touched() == 0, f"the second download reached the mirror: {counting_mirror.requests}"
    assert (again.source, again.skipped, again.files, again.directory) == ("official", True, first.files, first.directory)
    print(f"second download (source={source}): {seconds:.3f} s")  # a benchmark row measures it; not asserted here


def test_auto_reuses_the_sample_it_fell_back_to_without_probing_again(counting_mirror, tmp_path):
    layout = StorageLayout(root=str(tmp_path / "storage"), run_name="t")
    with socket.socket() as sock:  # the official mirrors are offline: a loopback port nothing listens on
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}/"
    sources.OFFICIAL_MIRRORS = (closed,)  # monkeypatched by the fixture: restored after the test
    first = download.fn(DownloadConfig(source="auto", connect_timeout_s=1), layout)
    assert (first.source, first.skipped) == ("sample", False)

    sources.OFFICIAL_MIRRORS = (counting_mirror.url,)  # reachable now, and it would be probed
    again = download.fn(DownloadConfig(source="auto"), layout)

    assert counting_mirror.touched() == 0
    assert (again.source, again.skipped, again.files) == ("sample", True, MirrorChecksums().by_file())
    # Asked for the official set, the run fetches it: the sample never stands in for source=official.
    official = download.fn(DownloadConfig(source="official", backoff_s=0.01), layout)
    assert (official.source, official.skipped) == ("official", False) and counting_mirror.requests


def test_a_damaged_copy_is_not_reused(tmp_path):
    layout = StorageLayout(root=str(tmp_path / "storage"), run_name="t")
    cfg = DownloadConfig(source="sample")
    assert raw_on_storage.verified_on_storage(cfg, layout) is None  # nothing there yet
    download.fn(cfg, layout)
    assert raw_on_storage.verified_on_storage(cfg, layout) is not None
    damaged = Path(layout.raw_dir("sample")) / MNIST_FILES[0]
    damaged.write_bytes(damaged.read_bytes()[:-10])  # truncated
    assert raw_on_storage.verified_on_storage(cfg, layout) is None
    assert download.fn(cfg, layout).skipped is False  # fetched again and verified
    assert raw_on_storage.verified_on_storage(cfg, layout) is not None


def _light_stages_in_this_worker(layout, trained, evaluation, api_url: str) -> dict:
    """Run in a fresh Ray worker: the real download, conversion, promotion and cleanup; then what the worker imported."""
    os.environ["PREFECT_API_URL"] = api_url
    from dataset.tensors.spec import TransformSpec
    from pipeline_config import CleanupConfig, EvaluateConfig, ParquetConfig, PromoteConfig, TransformConfig
    from tasks.cleanup import cleanup
    from tasks.promote import promote
    from tasks.to_parquet import to_parquet

    raw = download.fn(DownloadConfig(source="sample"), layout)
    dataset = to_parquet.fn(raw, ParquetConfig(), layout)
    spec = TransformSpec(dataset=dataset, config=TransformConfig(), checks={}, manifest=dataset.directory)
    outcome = promote.fn(evaluation, trained, spec, PromoteConfig(), EvaluateConfig(min_accuracy=0.0), layout, raw_dir=raw.directory)
    report = cleanup.fn(CleanupConfig(), raw, dataset, trained, evaluation, layout)
    return {"imported": sorted(m for m in HEAVY if m in sys.modules), "promoted": outcome.promotion.promoted,
            "version": outcome.promotion.version, "cleanup": type(report).__name__, "pid": os.getpid()}


@pytest.mark.slow
def test_the_light_stages_run_in_a_ray_worker_without_torch(local_ray, shared_server, tmp_path):
    import torch

    from tasks.manifests import Evaluation
    from training.checkpoint.model_files import save_checkpoint_files
    from training.manifests import CheckpointInfo, TrainedModel
    from training.model.catalog import ModelSpec

    layout = StorageLayout.create(str(tmp_path / "storage"), "startup")
    spec = ModelSpec(name="training.model.catalog:small_cnn", in_channels=1, num_classes=10)
    checkpoint = Path(layout.run_dir) / "checkpoint_000000"
    checkpoint.mkdir(parents=True)
    model = spec.build()
    save_checkpoint_files(checkpoint, model, torch.optim.SGD(model.parameters(), lr=0.1), {"epoch": 0, "model": spec.model_dump()})
    trained = TrainedModel(run_dir=layout.run_dir, model=spec, best_checkpoint=str(checkpoint), best_val_accuracy=0.5,
                           checkpoints=[CheckpointInfo(path=str(checkpoint), epoch=0, val_accuracy=0.5)], history=[],
                           num_workers=1, cpus_per_worker=1.0)
    metrics = Path(layout.run_dir) / "evaluation" / "metrics.json"
    metrics.parent.mkdir(parents=True)
    confusion = [[50 if i == j else 5 for j in range(10)] for i in range(10)]  # 50% right
    evaluation = Evaluation(checkpoint=str(checkpoint), accuracy=0.5, precision=[0.5] * 10, recall=[0.5] * 10, confusion=confusion, rows=1000,
                            metrics_path=str(metrics), predictions_path=str(metrics.parent / "predictions.parquet"),
                            passed_gate=True, classes=[str(i) for i in range(10)])

    # A runtime env of its own: Ray starts a worker for it, one no earlier task (with torch) has used.
    fresh = {"env_vars": {"STARTUP_TEST_WORKER": uuid.uuid4().hex}}
    task = local_ray.remote(num_cpus=1, max_retries=0, runtime_env=fresh)(_light_stages_in_this_worker)
    seen = local_ray.get(task.remote(layout, trained, evaluation, shared_server.api), timeout=300)

    assert seen["pid"] != os.getpid()
    assert (seen["promoted"], seen["version"], seen["cleanup"]) == (True, 1, "CleanupReport")
    assert seen["imported"] == [], f"the light stages imported {seen['imported']} in their Ray worker"
