"""A gate that fits the workload (issue 61): MNIST keeps its 97.5%, other data is held to its own baseline on
its first run and to its champion after, a number the user sets wins, and the summary names the gate used.

Real parts: a real 10-class set of small grayscale images, 8x8 digits made from the bundled MNIST sample
by cropping and block-averaging (1,257 training and 540 test images, the size of the classic 8x8 digits
set), written as an image folder of PNGs; its pixels in the dataset's Parquet layout for the probe; a real
model registry with a real ResNet-18 champion. The end-to-end test (slow) trains the folder with every
default through ``python -m flows.train`` against the session's real Prefect server and Ray cluster, twice.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from pipeline_config import EvaluateConfig
from pipeline_config.evaluation import OWN_GATES
from runner import console
from runner.summary import RunSummary
from storage_io import StorageLayout
from tasks.baseline import centroid_probe
from tasks.gate import beating, gate_for, lower_bound
from tests.support.cli import ROOT
from tests.support.gate_data import TEST_ROWS, digit_dataset, digits_8x8, write_digit_folder


def test_the_lower_bound_leaves_room_for_the_test_sets_noise():
    assert lower_bound(1.0, 45) == pytest.approx(0.8333, abs=1e-4)  # a perfect score on 45 images: not a 100% gate
    assert lower_bound(0.81, 540) == pytest.approx(0.7539, abs=1e-3)
    assert lower_bound(0.81, 10_000) > lower_bound(0.81, 540) > lower_bound(0.81, 45)  # more images, a tighter gate
    assert lower_bound(0.5, 0) == 0.0 and lower_bound(0.0, 100) == 0.0


def test_the_probe_scores_the_test_split_by_the_nearest_class_mean(tmp_path):
    dataset = digit_dataset(tmp_path / "digits")
    baseline = centroid_probe(dataset)
    probe, majority = baseline.probe, baseline.majority
    train_x, train_y, test_x, test_y = digits_8x8()  # the same classifier written out plainly
    means = np.stack([train_x[train_y == d].reshape(-1, 64).mean(axis=0) for d in range(10)]) / 255
    nearest = (((test_x.reshape(-1, 1, 64) / 255) - means[None]) ** 2).sum(axis=2).argmin(axis=1)
    assert probe == pytest.approx(float((nearest == test_y).mean()))
    assert 0.7 < probe < 0.9  # far above chance, far below what a trained network gets
    assert majority == pytest.approx(np.bincount(test_y).max() / TEST_ROWS)
    assert baseline.test_counts == np.bincount(test_y, minlength=10).tolist() and baseline.probe_classes == 10

    shuffled = centroid_probe(digit_dataset(tmp_path / "shuffled", shuffle_train_labels=True)).probe
    assert shuffled < 0.3  # nothing to learn from shuffled labels: the probe says so


def test_the_gate_is_the_users_then_the_datas_own_then_the_champions_then_the_baseline(tmp_path):
    from tests.support.registry import candidate
    from training.champion import registry

    dataset = digit_dataset(tmp_path / "digits")
    root = str(tmp_path / "root")
    baseline = centroid_probe(dataset)
    probe, majority = baseline.probe, baseline.majority
    beat = beating(majority, TEST_ROWS)  # what a model that learned something must reach (tests/test_gate_verdicts.py)

    first = gate_for(EvaluateConfig(), dataset, root, "digits-resnet18")  # no champion yet: the data's baseline
    assert first.min_accuracy == max(lower_bound(probe, TEST_ROWS), beat) == lower_bound(probe, TEST_ROWS)
    assert first.origin == (f"the data's baseline: a nearest-centroid probe scored {probe:.2%}, less 3 standard errors "
                            f"(above the majority class's {majority:.2%} by a one-sided test at 3 standard errors on "
                            f"{TEST_ROWS} test images: {beat:.2%})")

    layout = StorageLayout.create(root, "setup")
    assert registry.promote(layout, "digits-resnet18", candidate(layout, "first-run", 0.9, dataset.directory)).promoted
    later = gate_for(EvaluateConfig(), dataset, root, "digits-resnet18")  # held to its champion, trained on this data
    assert later.min_accuracy == lower_bound(0.9, TEST_ROWS) and 0.85 < later.min_accuracy < 0.9
    assert later.origin.startswith("its champion digits-resnet18 v1 (90.00%, on this run's data) less 3 standard errors (above")
    assert later.champion.model_dump() == {"version": 1, "accuracy": 0.9, "rescored": False}
    assert gate_for(EvaluateConfig(), dataset, root, None).origin == first.origin  # promotion off: no champion to follow

    mnist = dataset.model_copy(update={"source": "idx"})  # MNIST's digits keep their own 97.5%
    assert gate_for(EvaluateConfig(), mnist, root, "digits-resnet18").min_accuracy == OWN_GATES["idx"] == 0.975
    assert gate_for(EvaluateConfig(), mnist, root, None).origin == "the data's own gate (idx data; evaluate.min_accuracy unset)"

    for data in (dataset, mnist):  # a number the user sets is the gate, whatever the data
        chosen = gate_for(EvaluateConfig(min_accuracy=0.6), data, root, "digits-resnet18")
        assert (chosen.min_accuracy, chosen.origin) == (0.6, "evaluate.min_accuracy, as set")


def test_the_closing_lines_name_the_gate_and_where_it_came_from():
    evaluation = {"accuracy": 0.8444, "min_accuracy": 0.7539, "rows": 540, "gate": "the data's baseline: a nearest-centroid ..."}
    lines = console.summary_lines(RunSummary(run_name="r", evaluation=evaluation), None, 60, None, True)
    assert "  test accuracy  84.44% on 540 images (gate 75.39%: passed)" in lines
    assert "  gate           75.39%: the data's baseline: a nearest-centroid ..." in lines


def test_the_run_form_takes_the_gate_unset_or_set():
    """Deployments expose the configuration as Prefect parameters: the field is optional in the form's schema."""
    from pipeline_config import PipelineConfig

    schema = PipelineConfig.model_json_schema()["$defs"]["EvaluateConfig"]["properties"]["min_accuracy"]
    assert schema["default"] is None and {"type": "null"} in schema["anyOf"] and "description" in schema
    assert PipelineConfig.model_validate({"evaluate": {"min_accuracy": 0.9}}).evaluate.min_accuracy == 0.9
    assert PipelineConfig.model_validate(PipelineConfig().model_dump(mode="json")).evaluate.min_accuracy is None


@pytest.mark.slow
@pytest.mark.timeout(1800)  # two runs of a minute or two each on 2 idle cores; a busy machine takes longer
def test_small_grayscale_digits_train_with_defaults_and_pass_their_own_gate(tmp_path, shared_server, shared_ray):
    """The 8x8 digits folder through ``python -m flows.train`` with every default: the first run is held to the
    data's baseline and passes it, becomes the champion and says so, and sends its promotion event; a second
    run trained for one epoch only is held to that champion, fails below it and says which gate it failed."""
    from reporting import events
    from tests.support.prefect_server import api_env, wait_for
    from tests.support.ray_cluster import join_env

    folder = write_digit_folder(tmp_path / "digits8")
    storage = tmp_path / "storage"
    env = {k: v for k, v in api_env(shared_server.api).items() if not k.startswith(("MNIST_", "PIPELINE_"))} | join_env(shared_ray)

    def train(run: str, *args: str, code: int = 0) -> tuple[subprocess.CompletedProcess, dict]:
        out = subprocess.run(
            [sys.executable, "-m", "flows.train", "--download.source", "folder", "--download.path", str(folder),
             "--storage-root", str(storage), "--run-name", run, *args],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200,
        )
        assert out.returncode == code, out.stdout[-3000:] + out.stderr[-3000:]
        return out, json.loads((storage / "runs" / run / "summary.json").read_text())

    out, summary = train("first")
    evaluation = summary["evaluation"]
    assert summary["config"]["evaluate"]["min_accuracy"] is None and summary["data"]["rows"]["test"] == TEST_ROWS
    assert evaluation["gate"].startswith("the data's baseline: a nearest-centroid probe scored")
    assert 0.5 < evaluation["min_accuracy"] < 0.9 and summary["test_accuracy"] >= evaluation["min_accuracy"]
    assert summary["gate"] == {"min_accuracy": evaluation["min_accuracy"], "from": evaluation["gate"]}
    assert f"  gate           {evaluation['min_accuracy']:.2%}: {evaluation['gate']}" in out.stdout
    assert summary["promotion"]["promoted"] and summary["promotion"]["model"] == "digits8-resnet18"

    def sent(name: str, run: str) -> list[dict]:
        body = {"filter": {"event": {"name": [name]}, "order": "ASC"}, "limit": 50}
        return [e for e in shared_server.post("/events/filter", body)["events"] if e["payload"].get("run") == run]

    (event,) = wait_for(lambda: sent(events.PROMOTED, "first"), 30, "the first run's promotion event")
    assert event["payload"]["model"] == "digits8-resnet18" and event["payload"]["version"] == 1

    out, again = train("second", "--train.epochs", "1", code=1)  # one epoch: far below what the champion scored
    gate = again["evaluation"]["min_accuracy"]
    assert again["evaluation"]["gate"].startswith(
        f"its champion digits8-resnet18 v1 ({summary['test_accuracy']:.2%}, on this run's data) less 3 standard errors")
    assert gate == pytest.approx(lower_bound(summary["test_accuracy"], TEST_ROWS), abs=1e-4) and again["test_accuracy"] < gate
    assert again["stages"]["promote"]["status"] == "failed" and "QualityGateError" in again["stages"]["promote"]["error"]
    assert f"is below the gate {gate:.4f}" in out.stderr and f"; the gate came from: {again['evaluation']['gate']};" in out.stderr
    assert f"  gate           {gate:.2%}: {again['evaluation']['gate']}" in out.stderr  # a failed run's lines go to stderr
    (failed,) = wait_for(lambda: sent(events.GATE_FAILED, "second"), 30, "the second run's gate-failed event")
    assert failed["payload"]["min_accuracy"] == gate and failed["payload"]["gate"] == again["evaluation"]["gate"]
    assert os.listdir(storage / "models" / "digits8-resnet18" ) and not again["promotion"]["promoted"]
