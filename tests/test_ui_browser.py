"""The Prefect UI in a real headless Chromium: schedule, run forms, a run started from the form, its reports.

Everything is real: ``prefect server start`` on 127.0.0.1 (fresh SQLite), ``python -m
deployments.serve`` executing runs on a local Ray, and Debian's Chromium driven by Playwright
(``executable_path``; browser downloads do not work here; `make test` installs it as root, else these tests are
skipped with the command to run: tests/support/system_parts.py). Screenshots go to the test's tmp
folder and are copied to ``test-output/ui/`` (git-ignored) for a person to look at.

The pages are the UI that Prefect opens by default (V2, under ``/v2``; 3.8.8 and the pinned 3.9.1).
"""

from __future__ import annotations

import json
import re
import shutil
import socket
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest

from deployments.serve import tune_preset_parameters
from flows.train import STAGE_CPUS
from pipeline_config import (
    DEFAULT_WORKLOAD,
    ModelConfig,
    PipelineConfig,
    SearchSpace,
    TuneConfig,
    TunePipelineConfig,
    registry_model_name,
)
from reporting.artifacts import KEYS, TUNE_KEYS, comparison_keys
from tests.support.models import SMALL_MODEL
from tests.support.prefect_server import (
    TRAIN_FLOW,
    TUNE_FLOW,
    PrefectServer,
    embedded_png,
    far_cron,
    serve_deployments,
    stop_group,
    wait_for,
)
from tests.support.system_parts import CHROMIUM

# The UI form's run is the spine's served-deployment run; Chromium is a system part (tests/support/system_parts.py).
pytestmark = [pytest.mark.slow, pytest.mark.spine, pytest.mark.needs(CHROMIUM.name)]
ROOT = Path(__file__).resolve().parent.parent

# Without the background-networking flags Chromium's own connections are refused by this
# closed network and slow every page; Playwright gives each launch a fresh --user-data-dir.
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
]
PICTURES = {"samples": "Sample training digits", "curves": "Training curves", "confusion": "Confusion matrix", "predictions": "Test predictions"}
FORM_FIELDS = {  # label -> its description, as the schema gives them
    "Epochs (Optional)": "Passes over the training split (at most; see max_images).",
    "Num Workers (Optional)": "Ray Train workers (data-parallel ranks).",
    "Seed (Optional)": "Seed for weights, shuffling and augmentation.",
    "Source (Optional)": "auto: try the official MNIST mirrors",
    "Min Accuracy (Optional)": "Gate: the flow fails (keeping every artifact) below this test accuracy.",
    "Storage Root (Optional)": "Folder every Ray node can reach",
    "Name (Optional)": ModelConfig.model_fields["name"].description[:40],  # model.name
    "Workload (Optional)": PipelineConfig.model_fields["workload"].description[:40],
}
# The tune deployment's form, label -> the start of its description (from the model, which is
# still moving); the UI labels a nested section by its model's title ("TuneConfig").
TUNE_FORM_FIELDS = {
    "TuneConfig (Optional)": TunePipelineConfig.model_fields["tune"].description[:40],
    "Num Samples (Optional)": TuneConfig.model_fields["num_samples"].description[:40],
    "Scheduler (Optional)": TuneConfig.model_fields["scheduler"].description[:40],
    "Grace Period (Optional)": TuneConfig.model_fields["grace_period"].description[:40],
    "SearchSpace (Optional)": TuneConfig.model_fields["search_space"].description[:40],
}


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ui")


@pytest.fixture(scope="module")
def shots(work) -> Iterator[Path]:
    folder = work / "screenshots"
    folder.mkdir()
    yield folder
    keep = ROOT / "test-output" / "ui"
    shutil.rmtree(keep, ignore_errors=True)
    shutil.copytree(folder, keep)


@pytest.fixture(scope="module")
def served(server, work, shared_ray) -> Iterator[dict]:
    """The four deployments served from ``work`` (the forms' default storage root lands there), from smoke presets.
    Its runs join the session's Ray cluster (``--ray-address``, ``shared_ray``), as a serving process given a
    cluster does (the head a serving process starts for itself: tests/test_deployments.py)."""
    cron = far_cron()
    proc = serve_deployments(server, work, "--cron", cron, "--manual-preset", "smoke", "--tune-preset", "smoke",
                             ray=shared_ray)
    try:
        yield {
            "cron": cron, "log": work / "serve.log", "manual": server.deployment("manual"),
            "nightly": server.deployment("nightly"), "tune": server.deployment("manual", TUNE_FLOW),
            "train": server.deployment("manual", TRAIN_FLOW),
        }
    finally:
        stop_group(proc)


@pytest.fixture(scope="module")
def browser() -> Iterator:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM.location(), args=CHROMIUM_ARGS, headless=True)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    page.set_default_timeout(60_000)
    yield page
    context.close()


def open_run_form(page, server: PrefectServer, deployment: dict, ready: str = "Epochs (Optional)"):
    """The deployment's Run > Custom run form, once the field labelled ``ready`` shows."""
    page.goto(f"{server.url}/v2/deployments/deployment/{deployment['id']}/run", wait_until="networkidle")
    page.get_by_label(ready, exact=True).wait_for()


def field_group(page, label: str):
    """The form group (label, description, input) of a field."""
    return page.get_by_text(label, exact=True).locator("xpath=ancestor::div[contains(@class, 'group')][1]")


def test_nightly_deployment_page_shows_its_active_schedule(page, server, served, shots):
    page.goto(f"{server.url}/v2/deployments/deployment/{served['nightly']['id']}", wait_until="networkidle")
    hour = int(served["cron"].split()[1])
    shown = f"At {hour % 12 or 12:02d}:00 {'AM' if hour < 12 else 'PM'}"  # how the UI words a daily cron
    page.get_by_text(shown).wait_for()
    page.screenshot(path=shots / "nightly-deployment.png", full_page=True)
    assert page.get_by_role("switch").first.get_attribute("aria-checked") == "true"  # the schedule is active


def test_run_form_is_typed_described_and_refuses_invalid_values(page, server, served, shots):
    # Runs of the manual deployment only: the scheduler adds the nightly's upcoming runs at any moment.
    manual_runs = {"deployments": {"id": {"any_": [served["manual"]["id"]]}}}
    runs_before = len(server.post("/flow_runs/filter", manual_runs))
    open_run_form(page, server, served["manual"])
    page.screenshot(path=shots / "run-form.png", full_page=True)
    for label, description in FORM_FIELDS.items():
        assert description in field_group(page, label).inner_text(), label
    epochs = page.get_by_label("Epochs (Optional)", exact=True)
    assert epochs.get_attribute("type") == "number" and epochs.get_attribute("min") == "1"
    assert epochs.input_value() == "1"  # the smoke values the manual deployment was served with
    assert "sample" in field_group(page, "Source (Optional)").inner_text()  # a choice (enum), not free text
    assert page.get_by_label("Name (Optional)", exact=True).input_value() == "resnet18"  # model.name, the served default

    epochs.fill("0")
    page.get_by_role("button", name="Submit").click()
    page.wait_for_timeout(1000)
    page.screenshot(path=shots / "run-form-refused.png")
    refused = epochs.evaluate("e => [e.validity.rangeUnderflow, e.validationMessage]")
    assert refused[0] is True and "1" in refused[1], refused
    assert page.url.endswith("/run")  # still on the form
    assert len(server.post("/flow_runs/filter", manual_runs)) == runs_before  # nothing was started


def test_generic_run_form_shows_the_workload_and_the_model(page, server, served, shots):
    """The generic flow's form (train/manual, no run): the pipeline's fields, workload and model.name among them."""
    train_runs = {"deployments": {"id": {"any_": [served["train"]["id"]]}}}
    open_run_form(page, server, served["train"], ready="Workload (Optional)")
    page.screenshot(path=shots / "train-run-form.png", full_page=True)
    for label, description in FORM_FIELDS.items():
        assert description in field_group(page, label).inner_text(), label
    assert page.get_by_label("Workload (Optional)", exact=True).input_value() == DEFAULT_WORKLOAD  # the served default
    assert page.get_by_label("Name (Optional)", exact=True).input_value() == "resnet18"  # model.name
    assert page.get_by_label("Epochs (Optional)", exact=True).input_value() == "1"  # served with --manual-preset smoke
    assert server.post("/flow_runs/filter", train_runs) == []  # looking at the form starts nothing


def test_tune_run_form_shows_the_typed_described_tune_section(page, server, served, shots):
    """The search's form (no run): the tune section with its fields' descriptions and the tune smoke values."""
    tune_runs = {"deployments": {"id": {"any_": [served["tune"]["id"]]}}}
    open_run_form(page, server, served["tune"], ready="Num Samples (Optional)")  # two "Epochs": train's and tune's
    page.screenshot(path=shots / "tune-run-form.png", full_page=True)
    for label, description in TUNE_FORM_FIELDS.items():
        assert description in field_group(page, label).inner_text(), label
    num_samples = page.get_by_label("Num Samples (Optional)", exact=True)
    assert num_samples.get_attribute("type") == "number" and num_samples.get_attribute("min") == "1"
    smoke = tune_preset_parameters("smoke")["config"]["tune"]  # the preset the deployment was served with
    assert num_samples.input_value() == str(smoke["num_samples"]) != str(TuneConfig().num_samples)
    assert page.get_by_label("Epochs (Optional)", exact=True).count() == 2  # train.epochs and tune.epochs
    assert "asha" in field_group(page, "Scheduler (Optional)").inner_text()  # a choice (enum), not free text
    # The search space: one Low and one High per range field, the learning rate's first (found by its description).
    page.get_by_text(SearchSpace.model_fields["learning_rate"].description[:40], exact=False).wait_for()
    lows, highs = page.get_by_label("Low", exact=True), page.get_by_label("High", exact=True)
    ranges = [name for name, field in SearchSpace.model_fields.items() if field.annotation.__name__ == "Range"]
    assert ranges[0] == "learning_rate" and lows.count() == highs.count() == len(ranges)
    learning_rate = smoke["search_space"]["learning_rate"]
    assert (float(lows.first.input_value()), float(highs.first.input_value())) == (learning_rate["low"], learning_rate["high"])
    assert server.post("/flow_runs/filter", tune_runs) == []  # looking at the form starts nothing


@pytest.fixture(scope="module")
def form_run(browser, server, served, shots) -> dict:
    """A run started from the form with changed parameters (run name, seed, and model.name: the small
    model, since these tests are about the UI, not the network), waited for to the end."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    page.set_default_timeout(60_000)
    try:
        open_run_form(page, server, served["manual"])
        run_name = field_group(page, "Run Name (Optional)")
        run_name.get_by_role("tab", name="str").click()  # the field is str | None: pick str, then type
        run_name.get_by_role("tabpanel").locator("textarea").fill("ui-run")
        page.get_by_label("Seed (Optional)", exact=True).fill("5")
        page.get_by_label("Name (Optional)", exact=True).fill(SMALL_MODEL)
        page.screenshot(path=shots / "run-form-filled.png")
        page.get_by_role("button", name="Submit").click()
        page.wait_for_url(re.compile(r"/deployments/deployment/[^/?]+\?tab=Runs"))
    finally:
        context.close()

    def created() -> dict | None:
        runs = server.post("/flow_runs/filter", {"deployments": {"id": {"any_": [served["manual"]["id"]]}}})
        return next((r for r in runs if r["parameters"]["config"].get("run_name") == "ui-run"), None)

    run = wait_for(created, 30, "the flow run the form created")
    return server.wait_final(run["id"], served["log"])


def test_run_from_the_form_completes_with_the_changed_parameters_every_stage_and_artifact(form_run, server, work, shared_ray):
    assert form_run["state_type"] == "COMPLETED", form_run["state"]["message"]
    config = form_run["parameters"]["config"]
    assert config["run_name"] == "ui-run" and config["train"]["seed"] == 5 and config["model"]["name"] == SMALL_MODEL
    assert config["train"]["epochs"] == 1 and config["download"]["source"] == "sample"
    task_runs = server.task_runs(form_run["id"])
    assert {t["name"].rsplit("-", 1)[0] for t in task_runs} == set(STAGE_CPUS)
    assert {t["state_type"] for t in task_runs} == {"COMPLETED"}

    # What the run published, as the API gives it (the browser tests below look at the same artifacts)
    artifacts = {a["key"]: a for a in server.artifacts(form_run["id"])}
    assert set(KEYS.values()) <= set(artifacts) and not set(TUNE_KEYS.values()) & set(artifacts)
    progress = artifacts[KEYS["progress"]]
    assert progress["type"] == "progress" and progress["data"] == 100  # moved by the Ray Train controller's callback
    assert "epoch 1/1" in progress["description"]
    train_run = next(t for t in task_runs if t["name"].startswith("train-"))
    updated = datetime.fromisoformat(progress["updated"])
    assert datetime.fromisoformat(train_run["start_time"]) < updated < datetime.fromisoformat(train_run["end_time"])  # live
    for key in ("samples", "curves", "confusion", "predictions"):
        assert artifacts[KEYS[key]]["type"] == "markdown" and embedded_png(artifacts[KEYS[key]]["data"]).width > 100
    rows = json.loads(artifacts[KEYS["metrics"]]["data"])
    assert rows[0]["class"] == "all" and rows[0]["support"] == 1000 and len(rows) == 11
    # The run joined the serving process's Ray cluster, the session's (no local Ray of its own), and left it running
    (cluster,) = re.findall(r"every run joins the cluster at (127\.0\.0\.1:\d+)", (work / "serve.log").read_text())
    assert cluster == shared_ray.address
    assert any(f"Ray: joining the cluster at {cluster}" in line["message"] for line in server.logs(form_run["id"]))
    host, port = cluster.split(":")
    socket.create_connection((host, int(port)), timeout=5).close()  # its GCS still answers after the run
    (summary_file,) = work.glob("**/runs/ui-run/summary.json")  # the form's storage root, under the serve folder
    summary = json.loads(summary_file.read_text())
    assert summary["config"]["train"]["seed"] == 5 and summary["status"] == "completed"
    assert summary["best_checkpoint"] in artifacts[KEYS["checkpoint"]]["data"]
    assert rows[0]["accuracy"] == round(summary["test_accuracy"], 4)
    # The model's run comparison: this run's row (newest first) and the picture, under keys stable across runs
    comparison = comparison_keys(registry_model_name(DEFAULT_WORKLOAD, SMALL_MODEL))  # mnist-small-cnn
    runs = json.loads(artifacts[comparison["table"]]["data"])
    assert runs[0]["run"] == "ui-run" and runs[0]["test_accuracy"] == round(summary["test_accuracy"], 4)
    assert runs[0]["promoted"].startswith("v") == summary["promotion"]["promoted"]
    assert embedded_png(artifacts[comparison["picture"]]["data"]).width > 100
    # Stable keys: the latest version of each key is this run's, readable by key for the Artifacts page
    for key in KEYS.values():
        assert server.get(f"/artifacts/{key}/latest")["flow_run_id"] == form_run["id"], key


def test_flow_run_artifacts_tab_lists_every_report(page, server, form_run, shots):
    page.goto(f"{server.url}/v2/runs/flow-run/{form_run['id']}?tab=Artifacts", wait_until="networkidle")
    grid = page.get_by_test_id("flow-run-artifacts-grid")
    grid.wait_for()
    for key in KEYS.values():
        grid.get_by_role("heading", name=key, exact=True).wait_for()
    page.screenshot(path=shots / "flow-run-artifacts.png", full_page=True)


def test_report_pictures_render_in_the_browser(page, server, form_run, shots):
    artifacts = {a["key"]: a for a in server.artifacts(form_run["id"])}
    for name, title in PICTURES.items():
        artifact = artifacts[KEYS[name]]
        page.goto(f"{server.url}/v2/artifacts/artifact/{artifact['id']}", wait_until="networkidle")
        image = page.get_by_role("img", name=title)
        image.wait_for()
        page.wait_for_function("e => e.complete", arg=image.element_handle())
        width, height, src = image.evaluate("e => [e.naturalWidth, e.naturalHeight, e.getAttribute('src').slice(0, 22)]")
        page.screenshot(path=shots / f"artifact-{KEYS[name]}.png", full_page=True)
        assert src == "data:image/png;base64," and width > 100 and height > 100, (name, width, height, src)


def test_run_comparison_table_and_picture_show_in_the_browser(page, server, form_run, shots):
    """The model's run-comparison artifacts (stable keys) as the UI shows them: this run's row, the picture."""
    artifacts = {a["key"]: a for a in server.artifacts(form_run["id"])}
    model = registry_model_name(DEFAULT_WORKLOAD, SMALL_MODEL)  # mnist-small-cnn: the form run trains the small model
    keys = comparison_keys(model)
    page.goto(f"{server.url}/v2/artifacts/artifact/{artifacts[keys['table']]['id']}", wait_until="networkidle")
    table = page.get_by_role("table")
    table.get_by_role("cell", name="ui-run", exact=True).wait_for()
    headers = [h.strip() for h in table.locator("th").all_inner_texts()]
    assert headers == ["date", "run", "test_accuracy", "promoted", "val_loss", "epochs", "train_images_per_s", "wall_s", "data"]
    page.screenshot(path=shots / "artifact-run-comparison.png", full_page=True)
    page.goto(f"{server.url}/v2/artifacts/artifact/{artifacts[keys['picture']]['id']}", wait_until="networkidle")
    image = page.get_by_role("img", name=f"{model}: test accuracy over runs")
    image.wait_for()
    page.wait_for_function("e => e.complete", arg=image.element_handle())
    width, height = image.evaluate("e => [e.naturalWidth, e.naturalHeight]")
    page.screenshot(path=shots / "artifact-accuracy-over-runs.png", full_page=True)
    assert width > 100 and height > 100


def test_progress_and_metrics_show_in_the_browser(page, server, form_run, shots):
    artifacts = {a["key"]: a for a in server.artifacts(form_run["id"])}
    page.goto(f"{server.url}/v2/artifacts/artifact/{artifacts[KEYS['progress']]['id']}", wait_until="networkidle")
    page.get_by_text("Progress: 100%").wait_for()
    page.screenshot(path=shots / "artifact-progress.png")
    page.goto(f"{server.url}/v2/artifacts/artifact/{artifacts[KEYS['metrics']]['id']}", wait_until="networkidle")
    table = page.get_by_role("table")
    table.get_by_role("cell", name="all", exact=True).wait_for()
    headers = [h.strip() for h in table.locator("th").all_inner_texts()]
    assert headers == ["class", "support", "correct", "precision", "recall", "accuracy", "gate"]
    assert table.get_by_text("gate passed: ").count() == 1  # the verdict on the "all" row (smoke gate 50%)
    page.screenshot(path=shots / "artifact-metrics.png")
