"""Names follow the workload: ``python -m flows.train`` with a workload that is not MNIST.

A short CLI run of the generic entry point (the smoke preset on the bundled sample, the small
model) against a real Prefect server: the run's default name, the Prefect flow run's name, every
artifact key and the registry's folder carry the workload's name, and nothing is named mnist.
MNIST's own names (the defaults) are checked without a run in ``test_config.py``.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from prefect import flow
from prefect.logging.handlers import APILogWorker
from prefect.settings import PREFECT_API_URL, temporary_settings

from flows.train import _named_run, flow_run_name
from pipeline_config import PipelineConfig, TunePipelineConfig, registry_model_name
from reporting.reports import artifact_keys, comparison_keys
from tests.support.cli import CliRun
from tests.support.models import SMALL_MODEL, SMALL_MODEL_ARGS

pytestmark = pytest.mark.slow
WORKLOAD = "shapes-demo"


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("workloads")


def test_a_generic_run_names_its_run_artifacts_and_champion_after_the_workload(server, tmp_path):
    root, out = tmp_path / "storage", tmp_path / "summary.json"
    command = [
        sys.executable, "-m", "flows.train", "--preset", "smoke", *SMALL_MODEL_ARGS, "--workload", WORKLOAD,
        "--storage-root", str(root), "--summary-out", str(out),  # no --run-name: the default name is the point
    ]
    run = CliRun(tmp_path, "unnamed", command=command, env={"PREFECT_API_URL": server.api})
    code, seconds = run.finish(900)
    print(f"flows.train smoke run with workload {WORKLOAD}: {seconds:.0f}s")
    assert code == 0, run.output()[-4000:]
    summary = json.loads(out.read_text())

    # The run: its default name starts with the workload, and so does the Prefect flow run's
    run_name = summary["run_name"]
    assert re.fullmatch(rf"{WORKLOAD}-\d{{8}}-\d{{6}}-[0-9a-f]{{6}}", run_name), run_name
    assert (root / "runs" / run_name / "summary.json").is_file()
    assert summary["workload"] == WORKLOAD and summary["module"] == "flows.train" and summary["status"] == "completed"
    assert f"Training pipeline: run {run_name}" in run.output()
    flow_run = server.flow_run(summary["flow_run_id"])
    assert flow_run["name"] == run_name
    assert server.get(f"/flows/{flow_run['flow_id']}")["name"] == "train"

    # The registry: <workload>-<model>, the first model of its name is the champion; nothing under MNIST's names
    model = registry_model_name(WORKLOAD, SMALL_MODEL)
    assert model == f"{WORKLOAD}-small-cnn"
    assert summary["promotion"]["model"] == model and summary["promotion"]["promoted"] is True
    champion = json.loads((root / "models" / model / "champion").read_text())
    assert champion["run_name"] == run_name and champion["version"] == 1
    assert sorted(path.name for path in (root / "models").iterdir()) == [model]
    assert f"--model {model}" in run.output()  # the printed predict command names it

    # Every artifact key starts with the workload: the reports and the model's run comparison
    keys = {artifact["key"] for artifact in server.artifacts(summary["flow_run_id"])}
    assert keys == set(artifact_keys(WORKLOAD).values()) | set(comparison_keys(model).values())
    assert all(key.startswith(f"{WORKLOAD}-") for key in keys)
    assert server.get(f"/artifacts/{WORKLOAD}-test-metrics/latest")["flow_run_id"] == summary["flow_run_id"]


@flow(name="workload-name-probe", flow_run_name=flow_run_name)
def probe(config: PipelineConfig = PipelineConfig()) -> str:
    """A flow named like the pipeline's: what run_flow names the run folder when run_name is unset."""
    return _named_run(config)


def test_a_run_started_without_a_run_name_is_named_after_its_flow_run(server):
    """A deployment's run (no run_name): `flow_run_name` names the Prefect flow run from the workload,
    and the run folder takes that name; a search's is <workload>-tune-..."""
    with temporary_settings({PREFECT_API_URL: server.api}):
        for config, prefix in (
            (PipelineConfig(workload=WORKLOAD), WORKLOAD), (TunePipelineConfig(workload=WORKLOAD), f"{WORKLOAD}-tune"),
            (PipelineConfig(), "mnist"), (PipelineConfig(workload=WORKLOAD, run_name="chosen"), None),
        ):
            state = probe(config, return_state=True)
            folder = state.result()
            flow_run = server.flow_run(str(state.state_details.flow_run_id))
            if prefix is None:  # a run name given: the flow run takes it (run_flow uses it, not _named_run)
                assert flow_run["name"] == "chosen"
                continue
            assert flow_run["name"] == folder, (flow_run["name"], folder)
            assert re.fullmatch(rf"{prefix}-\d{{8}}-\d{{6}}-[0-9a-f]{{6}}", folder), folder
        APILogWorker.drain_all(timeout=5)  # the probe's log lines reach the server before it stops with the module
