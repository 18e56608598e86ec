"""Deployments against a real Prefect server on 127.0.0.1: served, scheduled, run like the UI's Run button.

The fast checks (no server) compare prefect.yaml with the nightly preset and check the
parameter schemas (training flow and tune flow) against the known UI form bugs. The ``slow``
ones start ``prefect server start`` with a fresh SQLite database, serve the four deployments
(``mnist-resnet18/nightly``, ``mnist-resnet18/manual``, ``mnist-resnet18-tune/manual`` and the
generic flow's ``train/manual``) with
``python -m deployments.serve``, start runs through the REST API with the body the UI's run form
posts, and let the served process execute them on a real local Ray.

The server, serve-process and UI-body helpers are in ``tests/support/prefect_server.py``
(shared with ``test_ui_browser.py`` and ``test_stopping.py``); the ``server`` fixture is in
``tests/conftest.py``.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
import yaml

from deployments.serve import (
    NIGHTLY_CRON,
    NIGHTLY_PRESET,
    NIGHTLY_TIMEZONE,
    build_deployments,
    parse_args,
    preset_parameters,
    tune_preset_parameters,
)
from flows.mnist import mnist_pipeline
from flows.train import train_pipeline
from flows.tune import TUNE_STAGE_CPUS, mnist_tune
from pipeline_config import (
    DEFAULT_WORKLOAD,
    ModelConfig,
    PipelineConfig,
    TuneConfig,
    TunePipelineConfig,
    registry_model_name,
)
from pipeline_config.settings import load_preset
from reporting.artifacts import artifact_keys, comparison_keys, tune_keys
from tests.support.images import CLASSES as SHAPE_CLASSES
from tests.support.images import write_image_folder
from tests.support.models import SMALL_MODEL, pause_env, wait_for_pause
from tests.support.prefect_server import (
    FINAL,
    PREFECT,
    RUN_TIMEOUT_S,
    TRAIN_FLOW,
    TUNE_FLOW,
    PrefectServer,
    clean_env,
    embedded_png,
    far_cron,
    log_tail,
    serve_deployments,
    smoke_config,
    stop_group,
    tune_smoke_config,
    ui_run_body,
    wait_for,
)
from training.worker.faults import paused, release_pauses

ROOT = Path(__file__).resolve().parent.parent
MNIST_ENTRYPOINT, TUNE_ENTRYPOINT = "flows/mnist.py:mnist_pipeline", "flows/tune.py:mnist_tune"
TRAIN_ENTRYPOINT = "flows/train.py:train_pipeline"


# --------------------------------------------------------------------------- fast: config checks


def _schema() -> dict:
    return mnist_pipeline.parameters.model_dump_for_openapi()


def _tune_schema() -> dict:
    return mnist_tune.parameters.model_dump_for_openapi()


def _train_schema() -> dict:
    return train_pipeline.parameters.model_dump_for_openapi()


def assert_workload_and_model_fields(schema: dict) -> None:
    """The form has ``workload`` (a described string, default mnist) and the model section with ``model.name``."""
    definitions = schema["definitions"]
    config = definitions[schema["properties"]["config"]["$ref"].rsplit("/", 1)[-1]]["properties"]
    workload = config["workload"]
    assert workload["type"] == "string" and workload["default"] == DEFAULT_WORKLOAD
    assert workload["description"] == PipelineConfig.model_fields["workload"].description
    assert config["model"]["$ref"] == "#/definitions/ModelConfig" and config["model"]["description"]
    name = definitions["ModelConfig"]["properties"]["name"]
    assert name["type"] == "string" and name["default"] == "resnet18"
    assert name["description"] == ModelConfig.model_fields["name"].description
    model_name = definitions["PromoteConfig"]["properties"]["model_name"]  # unset: <workload>-<model>
    assert "<workload>-<model.name>" in model_name["description"]


def assert_tune_section(schema: dict) -> None:
    """The tune flow's form has a ``tune`` section with typed, described fields and the search space's ranges."""
    definitions = schema["definitions"]
    assert schema["properties"]["config"]["$ref"] == "#/definitions/TunePipelineConfig"
    tune = definitions["TunePipelineConfig"]["properties"]["tune"]
    assert tune["$ref"] == "#/definitions/TuneConfig" and tune["description"]
    assert set(definitions["TunePipelineConfig"]["properties"]) > {"tune", "train", "download", "storage_root"}
    fields = definitions["TuneConfig"]["properties"]
    assert fields["num_samples"]["type"] == "integer" and fields["num_samples"]["minimum"] == 1
    assert fields["num_samples"]["description"] == TuneConfig.model_fields["num_samples"].description
    assert fields["scheduler"]["enum"] == ["asha", "none"] and fields["scheduler"]["description"]
    assert {"val_loss", "val_accuracy"} <= set(fields["metric"]["enum"])
    assert fields["search_space"]["$ref"] == "#/definitions/SearchSpace"
    space = definitions["SearchSpace"]["properties"]
    assert space["learning_rate"]["$ref"] == "#/definitions/Range"
    assert "log-uniformly" in space["learning_rate"]["description"]
    assert space["global_batch_size"]["type"] == "array" and space["global_batch_size"]["items"]["type"] == "integer"
    bounds = definitions["Range"]
    assert bounds["required"] == ["low", "high"]
    assert {name: prop["type"] for name, prop in bounds["properties"].items()} == {"low": "number", "high": "number"}


def test_prefect_yaml_declares_the_nightly_schedule_and_preset():
    spec = yaml.safe_load((ROOT / "deployments" / "prefect.yaml").read_text())
    # Both flows have a deployment named "manual": a deployment is its flow (entrypoint) and its name.
    by_key = {(d["entrypoint"], d["name"]): d for d in spec["deployments"]}
    assert len(by_key) == len(spec["deployments"])
    assert set(by_key) == {
        (MNIST_ENTRYPOINT, "nightly"), (MNIST_ENTRYPOINT, "manual"), (TUNE_ENTRYPOINT, "manual"), (TRAIN_ENTRYPOINT, "manual"),
    }
    nightly, manual = by_key[MNIST_ENTRYPOINT, "nightly"], by_key[MNIST_ENTRYPOINT, "manual"]
    tune, train = by_key[TUNE_ENTRYPOINT, "manual"], by_key[TRAIN_ENTRYPOINT, "manual"]
    assert nightly["schedules"] == [{"cron": NIGHTLY_CRON, "timezone": NIGHTLY_TIMEZONE, "active": True}]
    assert manual["schedules"] == [] and tune["schedules"] == [] and train["schedules"] == []
    assert tune["parameters"] == {} and "tune" in tune["tags"]
    assert train["parameters"] == {} and "mnist" not in train["tags"]  # the generic flow: any workload
    assert {d["work_pool"]["name"] for d in by_key.values()} == {"mnist-process"}
    assert all(d["enforce_parameter_schema"] is True for d in by_key.values())
    # the same nightly values as the preset `python -m deployments.serve` uses
    assert PipelineConfig.model_validate(nightly["parameters"]["config"]) == PipelineConfig.model_validate(
        load_preset(NIGHTLY_PRESET)
    )
    assert PipelineConfig.model_validate(nightly["parameters"]["config"]).cleanup.keep_checkpoints == 1


def test_parameter_schema_is_the_same_from_the_entrypoint_as_from_the_flow():
    """prefect#14835: a model imported from another module must give the same form on every path.

    `prefect deploy` builds the schema from the entrypoint, serve from the imported flow; at
    3.8.8 both resolve `PipelineConfig` from pipeline_config/model.py to the full nested model.
    """
    from prefect.utilities.callables import parameter_schema_from_entrypoint

    assert parameter_schema_from_entrypoint("flows/mnist.py:mnist_pipeline").model_dump_for_openapi() == _schema()
    assert parameter_schema_from_entrypoint("flows.mnist.mnist_pipeline").model_dump_for_openapi() == _schema()
    assert _schema()["properties"]["config"]["$ref"] == "#/definitions/PipelineConfig"


def test_generic_flow_schema_has_the_workload_and_model_fields_on_every_path():
    """flows.train's form (`prefect deploy` from the file, serve from the module) is the pipeline's, with
    workload and model.name; the MNIST flow's and the search's forms show them too."""
    from prefect.utilities.callables import parameter_schema_from_entrypoint

    assert parameter_schema_from_entrypoint(TRAIN_ENTRYPOINT).model_dump_for_openapi() == _train_schema()
    assert parameter_schema_from_entrypoint("flows.train.train_pipeline").model_dump_for_openapi() == _train_schema()
    assert _train_schema() == _schema()  # the same parameters as flows.mnist: MNIST is its defaults
    for schema in (_train_schema(), _schema(), _tune_schema()):
        assert_workload_and_model_fields(schema)
    assert train_pipeline.name == TRAIN_FLOW and mnist_pipeline.name == "mnist-resnet18" and mnist_tune.name == TUNE_FLOW


def test_tune_parameter_schema_from_the_entrypoint_has_the_typed_described_tune_section():
    """`prefect deploy` (file entrypoint) and serve (module path) give the tune flow one form, with its tune section."""
    from prefect.utilities.callables import parameter_schema_from_entrypoint

    assert parameter_schema_from_entrypoint(TUNE_ENTRYPOINT).model_dump_for_openapi() == _tune_schema()
    assert parameter_schema_from_entrypoint("flows.tune.mnist_tune").model_dump_for_openapi() == _tune_schema()
    assert_tune_section(parameter_schema_from_entrypoint(TUNE_ENTRYPOINT).model_dump_for_openapi())


def test_build_deployments_adds_the_manual_tune_search_with_the_tune_preset():
    nightly, manual, tune, train = build_deployments(manual_preset="smoke", tune_preset="smoke")
    assert [(d.flow_name, d.name) for d in (nightly, manual, tune, train)] == [
        ("mnist-resnet18", "nightly"), ("mnist-resnet18", "manual"), (TUNE_FLOW, "manual"), (TRAIN_FLOW, "manual"),
    ]
    assert train.entrypoint == "flows.train.train_pipeline" and train.enforce_parameter_schema is True
    assert train.schedules == [] and train.parameters == preset_parameters("smoke")  # the manual form's preset
    assert tune.entrypoint == "flows.tune.mnist_tune" and tune.enforce_parameter_schema is True
    assert tune.schedules == [] and "tune" in tune.tags
    assert tune.parameters == tune_preset_parameters("smoke")
    config = TunePipelineConfig.model_validate(tune.parameters["config"])
    assert config == TunePipelineConfig.model_validate(load_preset("smoke", flow="tune"))
    # tune-smoke.yaml over smoke.yaml: the search's own values and the pipeline smoke values under them
    assert (config.tune.num_samples, config.tune.epochs) == (4, 2)
    assert (config.train.num_workers, config.download.source) == (1, "sample")
    assert manual.parameters == preset_parameters("smoke")  # the training flow's form is unchanged
    assert parse_args([]).tune_preset == "default" and parse_args(["--tune-preset", "smoke"]).tune_preset == "smoke"
    assert parse_args([]).limit == 1  # runs, searches included, one at a time
    with pytest.raises(SystemExit):
        parse_args(["--tune-preset", "no-such-preset"])


@pytest.mark.parametrize("schema", [_schema, _tune_schema, _train_schema], ids=["mnist", "tune", "train"])
def test_parameter_schema_avoids_the_known_form_bugs(schema):
    """No free-form dicts (prefect#17798), no unions of models (#18084); typed, described, with choices."""
    definitions = schema()["definitions"]
    assert set(definitions) >= {"TrainConfig", "DownloadConfig", "MirrorChecksums"}
    assert "PipelineConfig" in definitions or "TunePipelineConfig" in definitions
    for model, spec in definitions.items():
        assert spec.get("additionalProperties") is False, model  # unknown keys refused, no dict fields
        for field, prop in spec["properties"].items():
            assert prop.get("description"), f"{model}.{field} has no description for the form"
            assert prop.get("type") != "object" or "properties" in prop, f"{model}.{field} is a free-form dict"
            for option in prop.get("anyOf", []):
                assert "$ref" not in option, f"{model}.{field} is a union of models"
    assert definitions["DownloadConfig"]["properties"]["source"]["enum"] == ["auto", "official", "mirror", "sample", "folder", "parquet"]
    assert definitions["TrainConfig"]["properties"]["epochs"]["minimum"] == 1


# --------------------------------------------------------------------------- slow: real server


class _Webhook(BaseHTTPRequestHandler):
    received: list = []

    def do_POST(self):  # noqa: N802 - http.server's naming
        type(self).received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def webhook() -> Iterator[str]:
    """A real HTTP server on 127.0.0.1 standing in for a chat webhook; yields its URL."""
    _Webhook.received = []
    server = HTTPServer(("127.0.0.1", 0), _Webhook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/failure"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("deployments")


# The cancel test's run: the only run here that reaches the pause the serve process is started with
# (2 epochs, pause at the first step of the second; every other run trains 1 epoch or none).
CANCELLED_RUN, CANCELLED_EPOCHS = "api-cancel", 2
PAUSE = pause_env(epoch=CANCELLED_EPOCHS - 1, step=0)


def release_other_pauses(storage: Path, stop: threading.Event) -> None:
    """Let any other run (or tune trial) that reaches the serve process's pause go on at once, so a
    multi-epoch run added here later is not held for training.worker.faults.PAUSE_MAX_S."""
    while not stop.wait(0.5):
        for faults in [*storage.glob("runs/*/faults"), *storage.glob("runs/*/trials/*/faults")]:
            held = [m for m in paused(str(faults)) if not Path(m.removesuffix(".fired") + ".release").exists()]
            if held and faults.relative_to(storage / "runs").parts[0] != CANCELLED_RUN:
                release_pauses(str(faults))


@pytest.fixture(scope="module")
def served(server, work, webhook, shared_ray) -> Iterator[dict]:
    """The four deployments served from one process: nightly on a real (far-off) schedule, search form from tune smoke.
    Its runs join the session's Ray cluster (``--ray-address``, ``shared_ray``), as a serving process given a
    cluster does; the head a serving process starts for itself is
    `test_the_serving_process_starts_one_ray_cluster_for_its_runs_and_stops_it_with_itself`'s.

    Its environment carries the test-only pause (``PAUSE``): its flow-run processes hand it to their
    Ray workers, so the cancel test's run holds still in training until it is cancelled."""
    cron = far_cron()
    proc = serve_deployments(
        server, work, "--cron", cron, "--tune-preset", "smoke", ray=shared_ray, PIPELINE_FAILURE_WEBHOOK_URL=webhook, **PAUSE
    )
    stop = threading.Event()
    releaser = threading.Thread(target=release_other_pauses, args=(work / "storage", stop), daemon=True)
    releaser.start()
    try:
        yield {"cron": cron, "log": work / "serve.log"}
    finally:
        stop.set()
        stop_group(proc)
        releaser.join(5)


def _answers(address: str) -> bool:
    host, port = address.split(":")
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
        return True
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.spine
def test_the_serving_process_starts_one_ray_cluster_for_its_runs_and_stops_it_with_itself(shared_server, tmp_path):
    """`deployments.serve` starts a Ray head on 127.0.0.1 before serving, which a driver can join; SIGTERM to the
    serving process (an operator's stop, systemd) stops it and everything it started. (That its runs join it and
    leave it running: the UI form's run, tests/test_ui_browser.py.)"""
    proc = serve_deployments(shared_server, tmp_path, "--cron", far_cron())
    try:
        log = (tmp_path / "serve.log").read_text()
        (address,) = re.findall(r"every run joins the local cluster at (127\.0\.0\.1:\d+)", log)
        joined = subprocess.run(
            [sys.executable, "-c", f"import ray; ray.init(address='{address}'); print(int(ray.cluster_resources()['CPU']))"],
            env=clean_env(RAY_AUTH_MODE="token"), capture_output=True, text=True, timeout=120, check=False,
        )
        assert joined.returncode == 0 and int(joined.stdout.split()[-1]) == os.cpu_count(), joined.stderr[-2000:]
        port = address.split(":")[1]
        assert any(f"--port={port}" in " ".join(cmd) for cmd in _command_lines())  # the `ray start` it started
    finally:
        stop_group(proc)
    assert proc.returncode == 0, log_tail(tmp_path / "serve.log")  # a graceful stop, not the SIGKILL that follows a hang
    wait_for(lambda: not _answers(address), 60, f"the Ray head at {address} to stop with the serving process")
    assert not [cmd for cmd in _command_lines() if f"--port={port}" in " ".join(cmd) or f"{address}" in " ".join(cmd)]


def _command_lines() -> list[list[str]]:
    """Every process's command line, read from /proc."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            found.append([part.decode(errors="replace") for part in Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0") if part])
        except OSError:
            continue
    return found


@pytest.mark.slow
@pytest.mark.spine
def test_served_deployments_have_schedule_presets_and_the_typed_form(server, served):
    nightly, manual = server.deployment("nightly"), server.deployment("manual")
    assert [s["schedule"]["cron"] for s in nightly["schedules"]] == [served["cron"]]
    assert nightly["schedules"][0]["active"] and not nightly["paused"]
    assert nightly["schedules"][0]["schedule"]["timezone"] == NIGHTLY_TIMEZONE
    assert manual["schedules"] == []
    assert nightly["parameters"] == preset_parameters(NIGHTLY_PRESET)
    assert manual["parameters"] == preset_parameters("default")
    for deployment in (nightly, manual):
        assert deployment["entrypoint"] == "flows.mnist.mnist_pipeline"
        assert deployment["enforce_parameter_schema"] is True
        assert deployment["parameter_openapi_schema"] == _schema()  # what the UI renders the form from


@pytest.mark.slow
@pytest.mark.spine
def test_served_tune_deployment_has_no_schedule_the_tune_preset_and_the_tune_form(server, served):
    tune = server.deployment("manual", TUNE_FLOW)
    assert tune["id"] != server.deployment("manual")["id"]  # the same name, another flow
    assert tune["schedules"] == [] and not tune["paused"]
    assert tune["parameters"] == tune_preset_parameters("smoke") != tune_preset_parameters("default")
    assert tune["entrypoint"] == "flows.tune.mnist_tune"
    assert tune["enforce_parameter_schema"] is True
    assert tune["parameter_openapi_schema"] == _tune_schema()
    assert_tune_section(tune["parameter_openapi_schema"])


@pytest.mark.slow
@pytest.mark.spine
def test_served_generic_deployment_has_no_schedule_and_the_form_with_workload_and_model(server, served):
    train = server.deployment("manual", TRAIN_FLOW)
    assert train["id"] not in {server.deployment("manual")["id"], server.deployment("manual", TUNE_FLOW)["id"]}
    assert train["schedules"] == [] and train["parameters"] == preset_parameters("default")
    assert train["entrypoint"] == "flows.train.train_pipeline" and train["enforce_parameter_schema"] is True
    assert train["parameter_openapi_schema"] == _train_schema()
    assert_workload_and_model_fields(train["parameter_openapi_schema"])


@pytest.mark.slow
@pytest.mark.spine
def test_invalid_parameters_are_refused_naming_the_field(server, served, work):
    deployment = server.deployment("manual")
    # Runs of the manual deployment only: the scheduler adds the nightly's upcoming runs at any moment.
    manual_runs = {"deployments": {"id": {"any_": [deployment["id"]]}}}
    before = len(server.post("/flow_runs/filter", manual_runs))
    for section, field, value, reason in (
        ("train", "epochs", 0, "less than the minimum of 1"),
        ("download", "source", "ftp", "is not one of"),
    ):
        config = smoke_config(work / "storage", "refused")
        config[section][field] = value
        response = server.request(
            "POST", f"/deployments/{deployment['id']}/create_flow_run",
            json=ui_run_body(deployment, {"config": config}, "refused"),
        )
        assert response.status_code == 409, response.text
        assert f"config.{section}.{field}" in response.json()["detail"] and reason in response.json()["detail"]
    assert len(server.post("/flow_runs/filter", manual_runs)) == before  # nothing was created


@pytest.mark.slow
@pytest.mark.spine
def test_invalid_tune_parameters_are_refused_naming_the_field(server, served, work):
    deployment = server.deployment("manual", TUNE_FLOW)
    tune_runs = {"deployments": {"id": {"any_": [deployment["id"]]}}}
    before = len(server.post("/flow_runs/filter", tune_runs))
    for field, value, reason in (
        ("num_samples", 0, "less than the minimum of 1"),
        ("scheduler", "hyperband", "is not one of ['asha', 'none']"),
        ("search_space.learning_rate", {"low": 0.001}, "'high' is a required property"),
    ):
        config = tune_smoke_config(work / "storage", "tune-refused")
        *path, last = field.split(".")
        section = config["tune"]
        for part in path:
            section = section[part]
        section[last] = value
        response = server.request(
            "POST", f"/deployments/{deployment['id']}/create_flow_run",
            json=ui_run_body(deployment, {"config": config}, "tune-refused"),
        )
        assert response.status_code == 409, response.text
        detail = response.json()["detail"]
        assert f"'config.tune.{field}'" in detail and reason in detail, detail
    assert len(server.post("/flow_runs/filter", tune_runs)) == before  # nothing was created


@pytest.mark.slow
def test_contradicting_tune_mode_passes_the_api_but_the_run_fails_before_any_work(server, served, work):
    """tune.mode "max" with tune.metric "val_loss" is a cross-field rule (a pydantic validator), which the
    JSON schema the API enforces cannot express: the API creates the run, and the run fails on its
    parameters, naming the field, before the flow body writes anything. Pins today's behaviour."""
    deployment = server.deployment("manual", TUNE_FLOW)
    config = tune_smoke_config(work / "storage", "tune-mode", mode="max", metric="val_loss")
    response = server.request(
        "POST", f"/deployments/{deployment['id']}/create_flow_run",
        json=ui_run_body(deployment, {"config": config}, "tune-mode"),
    )
    assert response.status_code == 201, response.text  # not refused: the schema has no cross-field rules
    run = server.wait_final(response.json()["id"], served["log"], timeout_s=300)
    assert run["state_type"] == "FAILED"
    message = run["state"]["message"]
    assert "config.tune" in message and "mode=max contradicts metric=val_loss" in message, message
    assert server.task_runs(run["id"]) == []  # no stage started
    assert not (work / "storage" / "runs" / "tune-mode").exists()


@pytest.mark.slow
def test_failed_run_logs_the_summary_and_posts_it_to_the_webhook(server, served, webhook, work):
    deployment = server.deployment("manual")
    config = smoke_config(work / "storage", "api-fail")
    config["download"].update(source="mirror", mirror_url=(work / "no-such-mirror").as_uri() + "/", attempts=1)
    created = server.post(f"/deployments/{deployment['id']}/create_flow_run", ui_run_body(deployment, {"config": config}, "api-fail"))
    run = server.wait_final(created["id"], served["log"])
    assert run["state_type"] == "FAILED"
    posted = wait_for(lambda: [p for p in _Webhook.received if p.get("flow_run_id") == run["id"]], 30, "the webhook POST")
    assert len(posted) == 1
    text = posted[0]["text"]
    assert posted[0]["stage"] == "download" and posted[0]["run_name"] == "api-fail"
    assert "failed in stage 'download'" in text and "no-such-mirror" in text
    assert f"--run-name api-fail --storage-root {work / 'storage'}" in text
    logged = wait_for(lambda: [log for log in server.logs(run["id"]) if log["message"] == text], 30, "the summary in the run log")
    assert logged[0]["level"] >= 40  # logged as an error, visible in the run's log tab


@pytest.mark.slow
def test_cancel_from_the_ui_ends_cancelled_and_the_summary_says_cancelled(server, served, work):
    """Cancel on a running served run (the UI's Cancel button sets CANCELLING): Cancelled, not failed.

    The run pauses at the first step of its second epoch (the serve process's test-only pause, after
    the first epoch's checkpoint is committed), so the cancel surely lands in training however fast it trains."""
    deployment = server.deployment("manual")
    config = smoke_config(work / "storage", CANCELLED_RUN, epochs=CANCELLED_EPOCHS)
    body = ui_run_body(deployment, {"config": config}, CANCELLED_RUN)
    created = server.post(f"/deployments/{deployment['id']}/create_flow_run", body)
    run_dir = work / "storage" / "runs" / CANCELLED_RUN

    def running() -> bool:
        return server.flow_run(created["id"])["state_type"] not in FINAL

    try:
        wait_for_pause(work / "storage", CANCELLED_RUN, RUN_TIMEOUT_S, alive=running)
    except pytest.fail.Exception as exc:
        pytest.fail(f"{exc}\n{log_tail(served['log'])}")
    assert server.flow_run(created["id"])["state_type"] == "RUNNING"
    cancelled_at = time.monotonic()
    server.post(f"/flow_runs/{created['id']}/set_state", {"state": {"type": "CANCELLING", "name": "Cancelling"}, "force": True})
    run = server.wait_final(created["id"], served["log"], timeout_s=90)
    print(f"Cancel to Cancelled: {time.monotonic() - cancelled_at:.1f}s")
    assert run["state_type"] == "CANCELLED", run["state"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "cancelled" and summary["stopped"]["stage"] == "train", summary.get("stopped")
    assert summary["stages"]["train"]["status"] == "cancelled"
    kept = summary["stopped"]["checkpoint_kept"]
    # the checkpoint of the epoch before the pause stays to resume from
    assert kept["epoch"] == CANCELLED_EPOCHS - 2 and not kept.get("mid_epoch") and Path(kept["path"]).is_dir(), kept


SHAPES = "shapes"  # the second workload: the tests' own RGB image folder (tests/support/images.py), not MNIST


@pytest.fixture(scope="module")
def shapes_images(work) -> Path:
    return write_image_folder(work / "shapes-images", {"train": 40, "test": 15})


def shapes_config(config: dict, images: Path) -> dict:
    """``config`` turned to the second workload: its name, its image folder, batches its 114 training images fill."""
    config["workload"] = SHAPES
    config["download"].update(source="folder", path=str(images))
    config["train"]["global_batch_size"] = 16
    return config


@pytest.fixture(scope="module")
def tune_run(server, served, work, shapes_images) -> dict:
    """One search started like the UI's Run button, on the second workload (RGB shapes from an image
    folder): the tune smoke preset cut to 2 trials of 3 epochs (the CLI's slow test runs the whole
    preset on MNIST; this one is about the deployment path and another workload), with
    ``tune.train_best``: the best recipe then trains, is evaluated and becomes the workload's champion
    in the same flow run."""
    deployment = server.deployment("manual", TUNE_FLOW)
    config = tune_smoke_config(work / "storage", "api-tune", num_samples=2, epochs=3, train_best=True)
    config = shapes_config(config, shapes_images)
    config["tune"]["search_space"]["global_batch_size"] = [16, 32]
    started = time.monotonic()
    body = ui_run_body(deployment, {"config": config}, "api-tune")
    created = server.post(f"/deployments/{deployment['id']}/create_flow_run", body)
    run = server.wait_final(created["id"], served["log"])
    return {"run": run, "seconds": time.monotonic() - started, "config": config}


@pytest.mark.slow
def test_the_generic_deployment_trains_the_second_workload_from_its_image_folder(server, served, work, shapes_images):
    """`train/manual` (flows.train) started like the UI's Run button with another workload: RGB shapes
    from an image folder, 3 classes, the small model, its train section sent as JSON input. Every
    name it publishes is the workload's."""
    deployment = server.deployment("manual", TRAIN_FLOW)
    config = shapes_config(smoke_config(work / "storage", "api-shapes", epochs=3), shapes_images)
    # The train section goes the way the form sends a field switched to JSON input
    # ({"__prefect_kind": "json", "value": "..."}, prefect#17798): the server must hydrate it.
    sent = {**config, "train": {"__prefect_kind": "json", "value": json.dumps(config["train"])}}
    created = server.post(f"/deployments/{deployment['id']}/create_flow_run", ui_run_body(deployment, {"config": sent}, "api-shapes"))
    run = server.wait_final(created["id"], served["log"])
    assert run["state_type"] == "COMPLETED", run["state"]["message"]
    assert run["parameters"]["config"] == config  # the JSON-kind section hydrated
    summary = json.loads((work / "storage" / "runs" / "api-shapes" / "summary.json").read_text())
    print(f"shapes run via train/manual: test accuracy {summary['test_accuracy']:.2%}")
    assert summary["workload"] == SHAPES and summary["data_source"] == "folder" and summary["status"] == "completed"
    assert summary["evaluation"]["classes"] == list(SHAPE_CLASSES) and summary["evaluation"]["rows"] == 45
    assert summary["test_accuracy"] >= summary["evaluation"]["min_accuracy"]
    model = registry_model_name(SHAPES, SMALL_MODEL)
    assert summary["promotion"]["model"] == model
    card = json.loads((work / "storage" / "models" / model / "champion").read_text())
    assert card["version"] >= 1  # this run's model or the search's: the workload's own champion
    keys = {artifact["key"] for artifact in server.artifacts(run["id"])}
    assert keys == set(artifact_keys(SHAPES).values()) | set(comparison_keys(model).values())
    rows = json.loads(next(a for a in server.artifacts(run["id"]) if a["key"] == artifact_keys(SHAPES)["metrics"])["data"])
    assert [row["class"] for row in rows] == ["all", *SHAPE_CLASSES]


@pytest.mark.slow
@pytest.mark.spine
def test_ui_style_tune_run_completes_with_the_best_config_and_the_trial_reports(server, tune_run, work, shapes_images):
    run = tune_run["run"]
    print(f"API-triggered tune smoke run: {tune_run['seconds']:.0f}s")
    assert run["state_type"] == "COMPLETED", run["state"]["message"]
    assert run["parameters"]["config"] == tune_run["config"]
    task_runs = server.task_runs(run["id"])
    assert {t["name"].rsplit("-", 1)[0] for t in task_runs} == set(TUNE_STAGE_CPUS) | {"train", "evaluate", "promote", "cleanup"}
    assert all(t["state_type"] == "COMPLETED" for t in task_runs)

    summary = json.loads((work / "storage" / "runs" / "api-tune" / "summary.json").read_text())
    assert summary["status"] == "completed"
    tuning = summary["tuning"]
    assert tuning["trials"] == 2 and tuning["errored"] == 0
    best_file = Path(tuning["best_trial"]["config_file"])
    assert best_file.is_file() and best_file.parent == work / "storage" / "runs" / "api-tune"
    best_values = yaml.safe_load(best_file.read_text())  # the recipe `python -m flows.mnist --config-file` trains
    assert best_values["train"] and PipelineConfig.model_validate(best_values)
    assert best_values["model"] == {"name": SMALL_MODEL}  # the model the trials trained
    assert best_values["workload"] == SHAPES and best_values["download"]["path"] == str(shapes_images)
    # train_best: the best trial's recipe trained in the run folder itself, evaluated, and passed the gate.
    assert [summary["stages"][name]["status"] for name in ("train", "evaluate", "promote", "cleanup")] == ["completed"] * 4
    assert summary["test_accuracy"] >= summary["evaluation"]["min_accuracy"]
    print(f"shapes search via the tune deployment: best trial's recipe, test accuracy {summary['test_accuracy']:.2%}")
    assert summary["evaluation"]["classes"] == list(SHAPE_CLASSES) and len(summary["evaluation"]["confusion"]) == 3
    assert summary["data"]["dataset_dir"].startswith(str(work / "storage" / "datasets" / f"{SHAPES}-"))
    run_dir = work / "storage" / "runs" / "api-tune"
    assert len((run_dir / "history.jsonl").read_text().splitlines()) == summary["config"]["train"]["epochs"]
    assert summary["best_checkpoint"].startswith(str(run_dir / "checkpoint_epoch-"))

    artifacts = {a["key"]: a for a in server.artifacts(run["id"])}
    assert set(artifacts) <= set(tune_keys(SHAPES).values()) | set(artifact_keys(SHAPES).values()) | set(
        comparison_keys(registry_model_name(SHAPES, SMALL_MODEL)).values()
    )  # the workload's names, none of MNIST's
    trials = artifacts[tune_keys(SHAPES)["trials"]]
    assert trials["type"] == "table"
    rows = json.loads(trials["data"])
    assert len(rows) == 2 and sum(row["trial"].endswith("(best)") for row in rows) == 1
    assert tuning["best_trial"]["trial_id"] + " (best)" in {row["trial"] for row in rows}
    curves = artifacts[tune_keys(SHAPES)["trial_curves"]]
    assert curves["type"] == "markdown" and "data:image/png;base64," in curves["data"]
    assert embedded_png(curves["data"]).width > 100


@pytest.mark.slow
def test_prefect_yaml_deploys_the_four_deployments_to_a_process_work_pool(tmp_path):
    """`prefect deploy` with deployments/prefect.yaml, as docs/operations.md says, against its own fresh server."""
    srv = PrefectServer(tmp_path / "prefect-home").start()
    try:
        env = clean_env(PREFECT_HOME=str(srv.home), PREFECT_API_URL=srv.api)
        for command in (
            [PREFECT, "work-pool", "create", "mnist-process", "--type", "process"],
            [PREFECT, "deploy", "--prefect-file", "deployments/prefect.yaml", "--all"],
        ):
            out = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
            assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        nightly, manual = srv.deployment("nightly"), srv.deployment("manual")
        tune, train = srv.deployment("manual", TUNE_FLOW), srv.deployment("manual", TRAIN_FLOW)
    finally:
        srv.stop()
    assert [s["schedule"]["cron"] for s in nightly["schedules"]] == [NIGHTLY_CRON] and nightly["schedules"][0]["active"]
    assert manual["schedules"] == [] and tune["schedules"] == [] and train["schedules"] == []
    assert train["entrypoint"] == TRAIN_ENTRYPOINT and train["parameter_openapi_schema"] == _train_schema()
    for deployment in (nightly, manual, tune, train):
        assert deployment["work_pool_name"] == "mnist-process"
        assert deployment["enforce_parameter_schema"] is True
        assert deployment["pull_steps"] == [{"prefect.deployments.steps.set_working_directory": {"directory": str(ROOT)}}]
    for deployment in (nightly, manual):
        assert deployment["parameter_openapi_schema"] == _schema()
    assert tune["entrypoint"] == TUNE_ENTRYPOINT and tune["parameters"] == {}
    assert tune["parameter_openapi_schema"] == _tune_schema()  # built from the file entrypoint
    assert PipelineConfig.model_validate(nightly["parameters"]["config"]) == PipelineConfig.model_validate(load_preset(NIGHTLY_PRESET))


def test_a_bad_ray_address_for_the_served_runs_is_refused_before_anything_starts(capsys):
    """`--ray-address` gets the checks a run's ray.address gets: exit 2 naming the option; no Ray head, no serving."""
    from deployments import serve

    assert serve.main(["--ray-address", "bad addr!"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("invalid configuration:\n--ray-address: ") and "cannot parse Ray address 'bad addr!'" in err
