"""MLflow tracking's pieces without a pipeline run: the config, the params, a server that is not there.

The end-to-end proofs (one MLflow run through a worker kill and a Prefect retry, a resumed driver,
the registry alias, nested trial runs, a server stopped mid-run) ride on runs other tests make
anyway: tests/test_fault_tolerance.py and tests/test_tune.py, against a real `mlflow server`.
"""

from __future__ import annotations

import logging

import pytest
from pydantic import ValidationError

from pipeline_config import PipelineConfig
from runner.summary import RunSummary
from runner.tracking import Tracker
from runner.tracking_records import flat_params, tracking_uri
from storage_io import StorageLayout
from tests.support.prefect_server import free_port


def test_tracking_is_off_without_a_uri_and_follows_the_standard_variable(monkeypatch, tmp_path):
    layout = StorageLayout.create(str(tmp_path), "r1")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    off = Tracker(PipelineConfig(), layout, {})
    assert not off.enabled and off.record() is None
    off.sync(RunSummary(run_name="r1"), final=True)  # a no-op: nothing to reach
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    assert tracking_uri(PipelineConfig()) == "http://127.0.0.1:5000"
    assert tracking_uri(PipelineConfig.model_validate({"tracking": {"uri": "https://mlflow.example:443"}})) == "https://mlflow.example:443"


@pytest.mark.parametrize(("uri", "named"), [
    ("http://alice:secret@mlflow:5000", "MLFLOW_TRACKING_PASSWORD"),
    ("file:///tmp/mlruns", "http(s)://host:port"),
    ("mlflow:5000", "http(s)://host:port"),
])
def test_a_tracking_uri_with_credentials_or_without_a_server_is_refused_naming_the_field(uri, named):
    with pytest.raises(ValidationError, match="tracking.uri") as refused:
        PipelineConfig.model_validate({"tracking": {"uri": uri}})
    assert named in str(refused.value)


def test_the_whole_config_becomes_flat_params():
    params = flat_params(PipelineConfig().model_dump(mode="json"))
    assert params["train.epochs"] == "12" and params["model.name"] == "resnet18" and params["run_name"] == "null"
    assert params["download.source"] == "auto" and all(isinstance(v, str) for v in params.values())
    assert "tracking.uri" in params and len(params) > 60


def test_a_server_that_is_not_there_is_warned_about_once_and_listed_as_not_recorded(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # refused at once: no backoff to wait out here
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    tracker = Tracker(PipelineConfig(), StorageLayout.create(str(tmp_path), "r1"), {})
    summary = RunSummary(run_name="r1", evaluation={"accuracy": 0.9})
    with caplog.at_level(logging.WARNING, logger="runner.tracking"):
        tracker.sync_epochs()
        tracker.sync(summary)
        tracker.sync(summary, final=True)
    warnings = [r for r in caplog.records if "goes on without tracking" in r.getMessage()]
    assert len(warnings) == 1 and tracker.given_up
    record = tracker.record()
    assert record["run_id"] is None
    assert record["not_recorded"] == ["artifacts", "epoch metrics", "test metrics", "the MLflow run"]
