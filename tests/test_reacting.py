"""Training that reacts (issue 48): nothing new to train on, and the domain events a run sends.

Real parts: the bundled sample converted to real Parquet, a champion promoted into a real registry,
the real CLI against a real ``prefect server start`` on 127.0.0.1 (its events read back over the
REST API). A run with nothing new to train on ends before Ray starts, so these tests train nothing.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from dataset.formats import watching
from flows.watch import look
from pipeline_config import PipelineConfig, load_preset, registry_model_name
from reporting import events
from storage_io import StorageLayout
from tasks.download import download
from tasks.to_parquet import to_parquet
from tests.support.cli import ROOT
from tests.support.images import write_image_folder
from tests.support.models import SMALL_MODEL
from tests.support.prefect_server import (
    TRAIN_FLOW,
    api_env,
    far_cron,
    log_tail,
    serve_deployments,
    stop_group,
    wait_for,
)
from tests.support.registry import candidate
from training.champion import registry, unchanged

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
    assert f"  why            {why}" in lines and "  to train anyway --no-promote.skip-unchanged (promote.skip_unchanged: false in a deployment's form)" in lines
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


def test_a_look_at_a_folder_reports_added_removed_and_changed_images_once(tmp_path):
    folder = write_image_folder(tmp_path / "shapes", {"train": 3, "test": 2})
    root = str(tmp_path / "root")
    first = watching.look(root, str(folder))
    assert (first.files, first.added, first.removed, first.modified) == (15, 15, 0, 0) and first.any
    assert not watching.look(root, str(folder)).any  # nothing changed since the last look
    (folder / "train" / "notes.txt").write_text("not an image")
    (folder / "train" / "red_square" / ".hidden.png").write_bytes(b"x")
    assert not watching.look(root, str(folder)).any  # neither counts
    gone = next((folder / "test" / "red_square").iterdir())
    gone.unlink()
    grown = next((folder / "train" / "green_disc").iterdir())
    grown.write_bytes(grown.read_bytes() + b"\0")
    added = add_images(folder, 1, seed=3)
    change = watching.look(root, str(folder))
    assert (change.files, change.added, change.removed, change.modified) == (17, 3, 1, 1)
    assert set(change.examples) >= {str(p.relative_to(folder)) for p in added}
    assert not watching.look(root, str(folder)).any
    Path(watching.state_path(root, str(folder))).write_text("{damaged")
    assert watching.look(root, str(folder)).added == 17  # a kept listing that cannot be read: all is new again


def test_the_watch_command_needs_the_servers_api_and_a_folder(tmp_path):
    env = {k: v for k, v in api_env("http://127.0.0.1:9/api").items() if k != "PREFECT_API_URL"}
    done = subprocess.run([sys.executable, "-m", "flows.watch", "--path", str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "PREFECT_API_URL is not set" in done.stderr
    with pytest.raises(ValueError, match=f"path {tmp_path / 'missing'}: no such folder"):
        look(str(tmp_path / "missing"), "shapes", str(tmp_path / "root"))


def test_an_upload_step_sends_the_data_event_with_one_command(tmp_path, shared_server):
    folder = write_image_folder(tmp_path / "uploads", {"train": 2, "test": 1})
    command = [sys.executable, "-m", "flows.watch", "--path", str(folder), "--storage-root", str(tmp_path / "root")]
    done = subprocess.run(command, cwd=ROOT, env=api_env(shared_server.api), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{folder}: 9 added, 0 removed, 0 changed of 9 images; sent {events.DATA_LANDED}" in done.stdout + done.stderr

    def arrived() -> list[dict]:
        return [e for e in server_events(shared_server, events.DATA_LANDED) if e["payload"]["path"] == str(folder)]

    (event,) = wait_for(arrived, 30, f"the {events.DATA_LANDED} event")
    assert event["resource"]["prefect.resource.id"] == f"pipeline.folder.{folder}" and event["payload"]["workload"] == "uploads"
    again = subprocess.run(command, cwd=ROOT, env=api_env(shared_server.api), capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and f"{folder}: no change (9 images)" in again.stdout + again.stderr


def test_serve_refuses_a_watch_config_without_a_folder_naming_the_file(tmp_path):
    config = tmp_path / "mnist.yaml"
    config.write_text("train:\n  epochs: 2\n")
    done = subprocess.run([sys.executable, "-m", "deployments.serve", "--watch", str(config)], cwd=ROOT,
                          env=api_env("http://127.0.0.1:9/api"), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert f"--watch {config}: set download.source: folder and download.path, the folder to watch" in done.stderr


# --- the loop runs itself: a watched folder, a training run, a promotion, a scoring run --------------------


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("reacting")


def add_images(folder: Path, count: int, seed: int) -> list[Path]:
    """``count`` more training images per class, drawn as the folder's own were."""
    import numpy as np
    from PIL import Image

    from tests.support.images import draw

    rng, added = np.random.default_rng(seed), []
    for class_dir in sorted(p for p in (folder / "train").iterdir() if p.is_dir()):
        for n in range(count):
            path = class_dir / f"new-{seed}-{n:03d}.png"
            Image.fromarray(draw(class_dir.name, rng)).save(path)
            added.append(path)
    return added


def flow_runs_of(server, deployment: dict) -> list[dict]:
    return server.post("/flow_runs/filter", {"flow_runs": {"deployment_id": {"any_": [deployment["id"]]}}, "sort": "START_TIME_ASC"})


@pytest.mark.slow
@pytest.mark.spine
def test_new_images_are_trained_promoted_and_scored_with_no_manual_step(server, work, shared_ray):
    """`deployments.serve --watch --score` against ``prefect server start`` (its event, trigger and action
    services on): the watcher's data event, one training run for a burst of two changes, the promotion
    event, and a scoring run whose predictions name the new champion's version."""
    folder = write_image_folder(work / "shapes", {"train": 24, "test": 10})
    config = work / "shapes.yaml"
    config.write_text(yaml.safe_dump({
        "workload": "shapes", "storage_root": str(work / "storage"),
        "download": {"source": "folder", "path": str(folder)}, "model": {"name": SMALL_MODEL},
        "train": {"num_workers": 1, "epochs": 2, "global_batch_size": 16}, "evaluate": {"min_accuracy": 0.0, "tta": False},
    }))
    debounce_s = 15  # the second change lands within one look (2 s) of being written; training starts when the window ends
    proc = serve_deployments(server, work, "--cron", far_cron(), "--watch", str(config), "--watch-every", "2",
                             "--debounce", str(debounce_s), "--score", str(folder / "test"), ray=shared_ray)
    try:
        on_data = wait_for(lambda: server.deployment("on-data", TRAIN_FLOW), 60, "train/on-data")
        scoring = wait_for(lambda: server.deployment("on-promotion", "score"), 60, "score/on-promotion")
        first = wait_for(lambda: landed(server), 120, f"the first {events.DATA_LANDED}\n{log_tail(work / 'serve.log')}")[0]
        assert first["payload"]["added"] == 3 * 34 and first["resource"]["prefect.resource.id"] == f"pipeline.folder.{folder}"
        add_images(folder, 2, seed=7)  # a second change within the trigger's window
        second = wait_for(lambda: landed(server)[1:], 60, f"the second {events.DATA_LANDED}")[0]
        assert second["payload"]["added"] == 6 and second["payload"]["files"] == 3 * 36
        assert _at(second) - _at(first) < debounce_s

        promoted = wait_for(lambda: server_events(server, events.PROMOTED), 600, f"{events.PROMOTED}\n{log_tail(work / 'serve.log')}")
        model = registry_model_name("shapes", SMALL_MODEL)
        assert promoted[0]["payload"]["model"] == model and promoted[0]["payload"]["version"] == 1
        written = wait_for(lambda: server_events(server, events.PREDICTIONS_WRITTEN), 300, f"{events.PREDICTIONS_WRITTEN}\n{log_tail(work / 'serve.log')}")
        runs = flow_runs_of(server, on_data)
        assert len(runs) == 1, [run["name"] for run in runs]  # the burst started one training run
        training = server.flow_run(runs[0]["id"])
        assert training["state_type"] == "COMPLETED"
        assert _at(first) < _time(training["start_time"]) < _at(promoted[0]) < _at(written[0])
        summary = json.loads((work / "storage" / "runs" / training["name"] / "summary.json").read_text())
        assert summary["data"]["rows"]["train"] + summary["data"]["rows"]["val"] == 3 * (24 + 2)  # it saw both changes
        score_runs = flow_runs_of(server, scoring)
        assert len(score_runs) == 1 and score_runs[0]["parameters"]["version"] == 1

        latest = json.loads((work / "storage" / "predictions" / model / "latest.json").read_text())
        assert latest["version"] == 1 and latest["path"] == f"predictions/{model}/v1/test.parquet" and latest["rows"] == 30
        table = pq.read_table(work / "storage" / latest["path"])
        assert table.schema.metadata[b"version"] == b"1" and table.num_rows == 30
    finally:
        stop_group(proc)


def landed(server) -> list[dict]:
    return server_events(server, events.DATA_LANDED)


def _time(text: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def _at(event: dict) -> float:
    return _time(event["occurred"])
