"""The pipeline's metrics (`reporting.metrics`) reach Prometheus: named by Prometheus's conventions; recorded from a
driver and from a Ray task, they are served by Ray's own metrics agent on the local Ray's export port (make test);
and a real training run on the session's Ray cluster puts its loss, images per second, stage durations, gate result,
promotion and bytes written into a real Prometheus (Debian's ``prometheus``, on loopback, with a temporary data
folder) that also finds Ray's and the Prefect server's targets up (make test-all)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import httpx
import pytest

from reporting import metrics
from tests.support.cli import CliRun
from tests.support.prefect_server import api_env, free_port
from tests.support.ray_cluster import join_env

LABEL_NAME = re.compile(r"^[a-z_]+$")


def test_every_metric_follows_prometheus_naming_and_has_bounded_labels():
    for name, (kind, description, labels) in metrics.CATALOG.items():
        assert name.startswith("pipeline_") and re.fullmatch(r"[a-z_]+", name), name
        assert kind in ("gauge", "counter", "histogram") and description.endswith("."), name
        assert name.endswith("_total") == (kind == "counter"), name  # counters and only counters end in _total
        if "seconds" in description.lower() and kind == "histogram":
            assert name.endswith("_seconds"), name
        assert all(LABEL_NAME.match(label) for label in labels), name
        assert not {"run", "run_name", "flow_run_id"} & set(labels), name  # no label that grows with every run


def scraped(port: int, name: str, timeout_s: float = 60) -> list[str]:
    """The lines of ``ray_<name>`` samples on Ray's metrics endpoint once there are any."""
    deadline, lines = time.monotonic() + timeout_s, []
    while time.monotonic() < deadline:
        try:
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
            lines = [line for line in text.splitlines() if line.startswith(f"ray_{name}{{")]
        except httpx.HTTPError:
            pass
        if lines:
            return lines
        time.sleep(0.5)
    raise AssertionError(f"ray_{name} not on http://127.0.0.1:{port}/metrics within {timeout_s}s")


def test_metrics_recorded_in_the_driver_and_in_a_task_are_served_by_rays_agent():
    import ray

    assert not metrics.record("pipeline_train_loss", 1.0, workload="x", model="y")  # no Ray: nothing, no error
    port = free_port()
    # The export every second instead of Ray's 10 s: the test's patience, not the product's setting.
    ray.init("local", num_cpus=1, include_dashboard=False, _metrics_export_port=port,
             _system_config={"metrics_report_interval_ms": 1000})
    try:
        metrics.epoch("mnist", "mnist-resnet18", {"epoch": 2, "train_loss": 0.25, "val_accuracy": 0.97, "images_per_s": 812.5})
        metrics.stage("mnist", "train", "completed", 42.0)

        @ray.remote
        def in_a_task() -> bool:
            return metrics.record("pipeline_promotions_total", 1, workload="mnist", model="mnist-resnet18")

        assert ray.get(in_a_task.remote())
        loss = scraped(port, "pipeline_train_loss")
        assert any('workload="mnist"' in line and 'model="mnist-resnet18"' in line and line.endswith(" 0.25") for line in loss)
        assert any(line.endswith(" 3.0") for line in scraped(port, "pipeline_train_epoch"))  # counted from 1
        assert any(line.endswith(" 812.5") for line in scraped(port, "pipeline_train_images_per_second"))
        stage = scraped(port, "pipeline_stage_duration_seconds_count")
        assert any('stage="train"' in line and 'outcome="completed"' in line and line.endswith(" 1.0") for line in stage)
        assert any(line.endswith(" 42.0") for line in scraped(port, "pipeline_stage_last_duration_seconds"))  # the exact seconds
        assert any(line.endswith(" 1.0") for line in scraped(port, "pipeline_promotions_total"))
    finally:
        ray.shutdown()


def query(prometheus: str, expr: str) -> list[dict]:
    response = httpx.get(f"{prometheus}/api/v1/query", params={"query": expr}, timeout=10)
    response.raise_for_status()
    return response.json()["data"]["result"]


@pytest.mark.slow
@pytest.mark.needs("prometheus")
def test_a_runs_metrics_reach_a_real_prometheus(tmp_path, shared_ray, shared_server):
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - job_name: ray\n    static_configs: [{{targets: ['127.0.0.1:{shared_ray.metrics_port}']}}]\n"
        f"  - job_name: prefect\n    metrics_path: /api/metrics\n    static_configs: [{{targets: ['127.0.0.1:{shared_server.port}']}}]\n"
    )
    log = tmp_path / "prometheus.log"
    with log.open("wb") as out:
        server = subprocess.Popen(
            ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}"], stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    prometheus = f"http://127.0.0.1:{port}"
    try:
        run = CliRun(tmp_path, "watched", "--train.epochs", "2", "--evaluate.min-accuracy", "0",
                     env=api_env(shared_server.api, **join_env(shared_ray)))
        code, _ = run.finish(600)
        assert code == 0, run.output()[-3000:]
        time.sleep(3)  # the last stages' figures: a scrape after the run's driver flushed them at its exit

        def series(expr: str) -> list[dict]:
            deadline = time.monotonic() + 60
            while not (found := query(prometheus, expr)) and time.monotonic() < deadline:
                assert server.poll() is None, log.read_text()[-3000:]
                time.sleep(1)
            return found

        labels = 'workload="mnist"'
        loss = series(f"max_over_time(ray_pipeline_train_loss{{{labels}}}[10m])")
        assert loss and 0 < float(loss[0]["value"][1]) < 10, loss
        assert series(f"max_over_time(ray_pipeline_train_images_per_second{{{labels}}}[10m]) > 0")
        assert series(f"max_over_time(ray_pipeline_train_epoch{{{labels}}}[10m]) == 2")
        stages = {r["metric"]["stage"] for r in series(f'ray_pipeline_stage_duration_seconds_count{{{labels},outcome="completed"}}')}
        assert {"download", "to-parquet", "transform", "train", "evaluate", "promote", "cleanup"} <= stages, stages
        assert series(f'ray_pipeline_gate_results_total{{{labels},result="passed"}} >= 1')
        assert series(f"ray_pipeline_promotions_total{{{labels}}} >= 1")
        written = {r["metric"]["stage"]: float(r["value"][1]) for r in series(f"ray_pipeline_storage_bytes_written_total{{{labels}}}")}
        assert written.get("to-parquet", 0) > 0 and written.get("train", 0) > 0 and written.get("promote", 0) > 0, written
        assert series(f'ray_pipeline_runs_total{{{labels},status="completed"}} >= 1')
        up = {r["metric"]["job"]: r["value"][1] for r in series("up")}
        assert up == {"ray": "1", "prefect": "1"}, up
        assert series('count({job="prefect"}) > 10'), "the Prefect server's own metrics"
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)


def test_a_chosen_metrics_port_makes_the_local_ray_report_every_two_seconds_and_only_then():
    from pipeline_config import RayConfig
    from runner.cluster.ray_init import METRICS_REPORT_MS, ray_init_args

    _, chosen = ray_init_args(RayConfig(metrics_export_port=18080), api_url="")
    assert chosen["_metrics_export_port"] == 18080
    assert chosen["_system_config"]["metrics_report_interval_ms"] == METRICS_REPORT_MS == 2000
    _, plain = ray_init_args(RayConfig(), api_url="")
    assert "_metrics_export_port" not in plain and "metrics_report_interval_ms" not in plain["_system_config"]
    _, joined = ray_init_args(RayConfig(address="127.0.0.1:6379", metrics_export_port=18080), api_url="")
    assert "_metrics_export_port" not in joined  # a cluster given by address exports on its own nodes' ports
