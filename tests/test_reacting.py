"""Training that reacts (issue 48): nothing new to train on, and the domain events a run sends.

Real parts: the bundled sample converted to real Parquet, a champion promoted into a real registry,
the real CLI against a real ``prefect server start`` on 127.0.0.1 (its events read back over the
REST API). A run with nothing new to train on ends before Ray starts, so these tests train nothing.
"""

from __future__ import annotations

import json
import subprocess
import sys

from pipeline_config import DownloadConfig, ParquetConfig, PipelineConfig, load_preset
from reporting import events
from storage_io import StorageLayout
from tasks.download import download
from tasks.to_parquet import to_parquet
from tests.support.cli import ROOT
from tests.support.prefect_server import api_env, wait_for
from tests.support.registry import candidate
from training import registry, unchanged

MODEL = "mnist-resnet18"


def nightly(root: str, **changes) -> PipelineConfig:
    """The nightly preset's configuration on ``root`` with the bundled sample (no mirror is probed)."""
    values = load_preset("nightly") | {"storage_root": root}
    values["download"] = {"source": "sample"}
    for section, fields in changes.items():
        values[section] = values.get(section, {}) | fields
    return PipelineConfig.model_validate(values)


def champion_of(config: PipelineConfig, layout: StorageLayout, run: str = "champion-run") -> str:
    """Convert the sample as a run of ``config`` would, and make a model trained on it with ``config`` the champion."""
    raw = download.fn(config.download, layout)
    dataset = to_parquet.fn(raw, config.parquet, layout, config.transform.image_size, config.workload)
    promoted = candidate(layout, run, 0.97, dataset.directory).model_copy(update={"config": config.model_dump(mode="json")})
    assert registry.promote(layout, MODEL, promoted).promoted
    return dataset.directory


def test_the_verdict_compares_data_model_and_recipe_with_the_champions(tmp_path):
    root = str(tmp_path / "root")
    layout = StorageLayout.create(root, "check")
    config = nightly(root)
    as_json = config.model_dump(mode="json")
    first = unchanged.compare(root, MODEL, layout.dataset_dir("x", "mnist"), True, as_json)
    assert not first.unchanged and first.reason == f"{MODEL} has no champion yet" and first.same_data is None

    dataset_dir = champion_of(config, layout)
    same = unchanged.compare(root, MODEL, dataset_dir, True, as_json)
    assert same.unchanged and same.reason == f"data, model and recipe are those of {MODEL} v1 (run champion-run)"
    assert same.payload() | {"reason": None} == {
        "dataset": dataset_dir.rsplit("/", 1)[-1], "changed_since_champion": False, "champion_version": 1, "nothing_new": True,
        "reason": None,
    }
    # How a run is carried out is not what it learns: more workers, more retries, still nothing new.
    operational = nightly(root, train={"num_workers": 1, "max_failures": 5, "hang_timeout_s": 30}).model_dump(mode="json")
    assert unchanged.compare(root, MODEL, dataset_dir, True, operational).unchanged
    recipe = nightly(root, train={"epochs": 3, "learning_rate": 0.01}, transform={"augment": "none"}).model_dump(mode="json")
    verdict = unchanged.compare(root, MODEL, dataset_dir, True, recipe)
    assert not verdict.unchanged and verdict.reason == f"transform.augment, train.epochs, train.learning_rate differ from {MODEL} v1's"
    model = nightly(root, model={"weights": "/somewhere/else.pt"}).model_dump(mode="json")
    assert unchanged.compare(root, MODEL, dataset_dir, True, model).reason == f"model.weights differ from {MODEL} v1's"
    other = unchanged.compare(root, MODEL, layout.dataset_dir("other", "mnist"), True, as_json)
    assert not other.unchanged and other.same_data is False and other.payload()["changed_since_champion"] is True
    gone = unchanged.compare(root, MODEL, dataset_dir, False, as_json)
    assert not gone.unchanged and "is gone or does not verify" in gone.reason


def test_a_damaged_registry_is_a_change_not_an_error(tmp_path):
    root = str(tmp_path / "root")
    layout = StorageLayout.create(root, "check")
    champion_of(nightly(root), layout)
    (tmp_path / "root" / "models" / MODEL / "champion").write_text("{not json")
    verdict = unchanged.compare(root, MODEL, layout.dataset_dir("x"), True, nightly(root).model_dump(mode="json"))
    assert not verdict.unchanged and verdict.reason.startswith(f"the registry of {MODEL} is damaged")


def server_events(server, prefix: str = "pipeline.") -> list[dict]:
    """Every event the server holds whose name starts with ``prefix``, oldest first."""
    body = {"filter": {"event": {"prefix": [prefix]}, "order": "ASC"}, "limit": 50}
    return server.post("/events/filter", body)["events"]


def test_the_nightly_preset_ends_a_run_with_nothing_new_before_ray_starts(tmp_path, shared_server):
    root = str(tmp_path / "root")
    layout = StorageLayout.create(root, "setup")
    dataset_dir = champion_of(nightly(root), layout)
    before = {event["id"] for event in server_events(shared_server)}
    summary_out = tmp_path / "summary.json"
    command = [sys.executable, "-m", "flows.mnist", "--preset", "nightly", "--download.source", "sample",
               "--storage-root", root, "--run-name", "night-2", "--summary-out", str(summary_out)]
    done = subprocess.run(command, cwd=ROOT, env=api_env(shared_server.api), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    why = f"data, model and recipe are those of {MODEL} v1 (run champion-run)"
    assert any(line.startswith("Run night-2: nothing new to train on, ended after") for line in lines), done.stdout
    assert f"  why            {why}" in lines and "  to train anyway  --no-promote.skip-unchanged (promote.skip_unchanged: false in a deployment's form)" in lines
    assert "Ray:" not in done.stdout  # no cluster was started for it

    summary = json.loads(summary_out.read_text())
    assert summary["status"] == "completed" and summary["nothing_new"] == why and summary["stages"] == {}
    assert summary["data"]["dataset_dir"] == dataset_dir and summary["data"]["conversion_skipped"] is True
    assert (tmp_path / "root" / "runs" / "night-2" / "summary.json").is_file()
    assert not (tmp_path / "root" / "runs" / "night-2" / "checkpoints").exists()

    run = shared_server.flow_run(summary["flow_run_id"])
    assert run["state_type"] == "COMPLETED" and run["state"]["message"] == f"nothing new to train on: {why}"

    def arrived() -> list[dict] | None:
        new = [event for event in server_events(shared_server) if event["id"] not in before]
        return new if {e["event"] for e in new} >= {events.DATA_CHECKED, events.NOTHING_NEW} else None

    sent = wait_for(arrived, 30, "the data-checked and nothing-new events")
    checked = next(event for event in sent if event["event"] == events.DATA_CHECKED)
    assert checked["resource"]["prefect.resource.id"] == f"pipeline.model.{MODEL}"
    assert checked["resource"]["pipeline.workload"] == "mnist" and checked["resource"]["pipeline.model"] == "resnet18"
    assert checked["payload"]["changed_since_champion"] is False and checked["payload"]["run"] == "night-2"
    related = {item["prefect.resource.id"] for item in checked["related"]}
    assert f"prefect.flow-run.{summary['flow_run_id']}" in related


def test_only_the_nightly_preset_skips_by_default_and_the_flag_is_in_the_help():
    done = subprocess.run([sys.executable, "-m", "flows.mnist", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "--promote.skip-unchanged, --no-promote.skip-unchanged" in done.stdout
    assert load_preset("nightly")["promote"]["skip_unchanged"] is True
    assert not any(load_preset(name).get("promote", {}).get("skip_unchanged") for name in ("default", "smoke"))
