"""The pipeline's own metrics for Prometheus, recorded with Ray's metrics API (``ray.util.metrics``).

A metric recorded in any process connected to Ray (the flow's process, a stage's task, a worker) goes to the Ray
agent of its node, which serves every metric of the node in Prometheus's format on the node's metrics export port
(`pipeline_config.RayConfig.metrics_export_port`; Ray lists every node's in its scrape-targets file,
``/tmp/ray/prom_metrics_service_discovery.json``). Ray names each ``ray_<name>`` and adds its own labels (the node,
the session, the reporting process's ``WorkerId``): sum them away in a query (``sum without (WorkerId) (...)``), as
deployments/grafana/pipeline.json does.

The pipeline records them from the flow's process, where a run's facts are known: the stage durations and outcomes
around each stage (`runner.stages.StageRecorder`), rank 0's epoch rows as they land in ``history.jsonl``
(`runner.watchers.EpochWatcher`), the training attempts, the gate and the promotion after their stages
(`flows.stages`), the run's end. Labels are low-cardinality: the workload, the registry's model name, the stage, an
outcome; never a run name (one series per run would grow without bound). Without Ray connected, or if Ray refuses a
value, nothing is recorded and nothing fails: metrics are news, as events are.

`CATALOG` is every metric, its kind, help text and labels: docs/operations.md's table and the dashboard's queries are
checked against it (tests/test_dashboards.py); its names and a real Prometheus: tests/test_metrics.py.
"""

from __future__ import annotations

import logging
from functools import cache
from typing import Any

logger = logging.getLogger(__name__)

MODEL = ("workload", "model")  # the run's workload and its registry model name (promote.model_name, else <workload>-<model>)
STAGE_BUCKETS = [1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0]
EXPORTED_PREFIX = "ray_"  # what Ray puts in front of every name it exports

# name: (kind, help, labels)
CATALOG: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "pipeline_train_loss": ("gauge", "Training loss of the last finished epoch, as rank 0 records it in history.jsonl.", MODEL),
    "pipeline_val_accuracy": ("gauge", "Validation accuracy (0..1) after the last finished epoch, from rank 0's row.", MODEL),
    "pipeline_train_images_per_second": (
        "gauge", "Training images per second of rank 0 over the last finished epoch (times the workers: the group's).", MODEL),
    "pipeline_train_epoch": ("gauge", "The last finished epoch, counted from 1.", MODEL),
    "pipeline_train_restarts_total": (
        "counter", "Training attempts after a run's first: Ray Train restarts of the worker group and Prefect retries of "
                   "the training stage, each resuming from the latest checkpoint.", MODEL),
    "pipeline_stage_duration_seconds": (
        "histogram", "Seconds a stage ran in the flow, by outcome: completed, failed, interrupted, cancelled (Ray "
                     "exports the histogram's _sum from its buckets' midpoints: the exact seconds are the gauge's).",
        ("workload", "stage", "outcome")),
    "pipeline_stage_last_duration_seconds": ("gauge", "Seconds the stage ran the last time it ran.", ("workload", "stage")),
    "pipeline_gate_results_total": ("counter", "Runs held to their accuracy gate, by result: passed, failed.", (*MODEL, "result")),
    "pipeline_test_accuracy": ("gauge", "Test accuracy (0..1) of the last evaluated run.", MODEL),
    "pipeline_promotions_total": ("counter", "New champions the registry promoted.", MODEL),
    "pipeline_storage_bytes_written_total": (
        "counter", "Bytes a stage left on storage: the growth of the run's folder over the stage and the folders it "
                   "created (a converted dataset, fetched files, a promoted version); a checkpoint replaced within "
                   "the stage counts once.", ("workload", "stage")),
    "pipeline_runs_total": ("counter", "Runs that ended, by status: completed, failed, interrupted, cancelled.", ("workload", "status")),
}


@cache
def _instrument(name: str) -> Any:
    """The Ray metric ``name`` of `CATALOG`, made once per process (Ray refuses two of one name with other labels)."""
    from ray.util import metrics  # Ray: only where something is recorded

    kind, description, labels = CATALOG[name]
    if kind == "gauge":
        return metrics.Gauge(name, description=description, tag_keys=labels)
    if kind == "counter":
        return metrics.Counter(name, description=description, tag_keys=labels)
    return metrics.Histogram(name, description=description, boundaries=STAGE_BUCKETS, tag_keys=labels)


def record(name: str, value: float, **labels: str) -> bool:
    """Set a gauge, add to a counter or observe a histogram's value; False when nothing was recorded (no Ray here)."""
    import ray  # Ray: only where something is recorded

    if not ray.is_initialized():
        return False
    try:
        instrument = _instrument(name)
        tags = {key: str(labels[key]) for key in CATALOG[name][2]}
        if CATALOG[name][0] == "gauge":
            instrument.set(float(value), tags=tags)
        elif CATALOG[name][0] == "counter":
            if value > 0:
                instrument.inc(float(value), tags=tags)
        else:
            instrument.observe(float(value), tags=tags)
    except Exception as exc:  # noqa: BLE001 - a metric never fails a run
        logger.debug("metric %s not recorded: %s", name, exc)
        return False
    return True


def epoch(workload: str, model: str, row: dict[str, Any]) -> None:
    """Rank 0's row of one finished epoch (``history.jsonl``: epoch counted from 0, train_loss, val_accuracy, images_per_s)."""
    for name, key in (("pipeline_train_loss", "train_loss"), ("pipeline_val_accuracy", "val_accuracy"),
                      ("pipeline_train_images_per_second", "images_per_s")):
        if isinstance(row.get(key), (int, float)):
            record(name, row[key], workload=workload, model=model)
    record("pipeline_train_epoch", int(row["epoch"]) + 1, workload=workload, model=model)


def stage(workload: str, name: str, outcome: str, seconds: float) -> None:
    record("pipeline_stage_duration_seconds", seconds, workload=workload, stage=name, outcome=outcome)
    record("pipeline_stage_last_duration_seconds", seconds, workload=workload, stage=name)


def gate(workload: str, model: str, passed: bool, accuracy: float) -> None:
    record("pipeline_gate_results_total", 1, workload=workload, model=model, result="passed" if passed else "failed")
    record("pipeline_test_accuracy", accuracy, workload=workload, model=model)


def run_ended(workload: str, status: str) -> None:
    record("pipeline_runs_total", 1, workload=workload, status=status)
