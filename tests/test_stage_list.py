"""Stages carry their own concerns (issue 61): a flow's stage list is a plain list of stage calls, each stage
declares its CPUs and publishes its own reports and events, and the harness (``runner/``) names no stage.

Real parts: the project's own source read with ``ast`` (what the flows call, what the runner names), the
real stage objects the flows run; in the slow tier a real search on Ray against a real Prefect server.
"""

from __future__ import annotations

import ast
import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest

from flows import mnist, train, tune
from flows.stages import CLEANUP, DOWNLOAD, EVALUATE, PROMOTE, TO_PARQUET, TRAIN, TRANSFORM, data_stages
from pipeline_config import TunePipelineConfig
from runner.stages import Stage

ROOT = Path(__file__).resolve().parent.parent
STAGE_NAMES = {"download", "to-parquet", "transform", "train", "evaluate", "promote", "cleanup", "tune"}


def body_nodes(function) -> list[ast.AST]:
    """Every node of ``function``'s body, in order."""
    (definition,) = ast.parse(inspect.getsource(function)).body
    return [node for statement in definition.body for node in ast.walk(statement)]


def calls_in(function) -> list[str]:
    """The names every call in ``function``'s body calls (``run``, ``trial_spec``, ``config.model_dump``: ``model_dump``);
    not its decorator's or its defaults'."""
    names = []
    for node in body_nodes(function):
        if isinstance(node, ast.Call):
            func = node.func
            names.append(func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else "?")
    return names


def stage_arguments(function) -> list[str]:
    """The first argument of each ``run(...)`` call, in order (``data_stages(...)``: its three): the stages it runs."""
    found = []
    for node in body_nodes(function):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "run":
            found.append(node.args[0].id)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "data_stages":
            found += stage_arguments(data_stages)
    return found


def test_the_flow_bodies_are_their_stage_lists():
    """Each flow's body is one run context and its stage calls (issue 68): no callbacks, nothing else called."""
    # model_dump: what the model card records; nothing_new and ended: promote.skip_unchanged, before Ray starts
    assert set(calls_in(train.train_pipeline.fn)) == {
        "PipelineRun", "resume_module", "nothing_new", "ended", "data_stages", "run", "model_dump",
    }
    assert stage_arguments(train.train_pipeline.fn) == ["DOWNLOAD", "TO_PARQUET", "TRANSFORM", "TRAIN", "EVALUATE", "PROMOTE", "CLEANUP"]
    # The search's list adds only the winner's recipe, worked out from the search's output; its data stages are the same.
    assert set(calls_in(tune.mnist_tune.fn)) == {
        "PipelineRun", "stage_plan", "data_stages", "run", "model_dump", "trial_train_config", "trial_spec",
    }
    assert stage_arguments(tune.mnist_tune.fn) == ["DOWNLOAD", "TO_PARQUET", "TRANSFORM", "TUNE", "TRAIN", "EVALUATE", "PROMOTE", "CLEANUP"]
    assert calls_in(mnist.mnist_pipeline.fn) == ["fn"]  # MNIST's flow runs the training flow's body, under its own name


def test_each_stage_declares_its_cpus_and_the_flows_plans_are_their_stage_lists():
    assert train.STAGES == [DOWNLOAD, TO_PARQUET, TRANSFORM, TRAIN, EVALUATE, PROMOTE, CLEANUP]
    assert all(isinstance(stage, Stage) for stage in train.STAGES)
    assert {stage.name: stage.cpus for stage in train.STAGES} == train.STAGE_CPUS == {
        "download": 1, "to-parquet": 1, "transform": 0, "train": 0, "evaluate": 0, "promote": 0, "cleanup": 0,
    }
    searched = tune.stage_plan(TunePipelineConfig())
    assert [s.name for s in searched] == ["download", "to-parquet", "transform", "tune"] and tune.TUNE.cpus == 0
    best = tune.stage_plan(TunePipelineConfig.model_validate({"tune": {"train_best": True}}))
    assert best[4:] == [TRAIN, EVALUATE, PROMOTE, CLEANUP]  # the training flow's own stages, so the same events


def stage_names_used(tree: ast.AST) -> set[str]:
    """Stage names a module acts on: compared with (``name == "train"``), looked up (``outputs["to-parquet"]``,
    ``plan.get("train")``, ``.index("train")``) or listed (``("download", "train")``). A config section of the
    same name read from a config (``getattr(config, "tune", None)``, ``"tune" in config``) is the config's shape."""
    def named(node: ast.AST | None) -> set[str]:
        return {node.value} & STAGE_NAMES if isinstance(node, ast.Constant) and isinstance(node.value, str) else set()

    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Eq, ast.NotEq)) for op in node.ops):
            found |= named(node.left).union(*(named(c) for c in node.comparators))
        elif isinstance(node, ast.Subscript):
            found |= named(node.slice)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in {"get", "index", "pop"}:
            found |= set().union(*(named(arg) for arg in node.args))
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            found |= set().union(*(named(e) for e in node.elts))
        elif isinstance(node, ast.Dict):
            found |= set().union(*(named(k) for k in node.keys))
    return found


def test_the_runner_names_no_stage():
    """No stage acted on by name in runner/, and no stage's module imported there: what a stage does is its own."""
    for path in sorted((ROOT / "runner").rglob("*.py")):
        tree = ast.parse(path.read_text())
        named = stage_names_used(tree)
        assert not named, f"{path.name} acts on the stage(s) {sorted(named)} by name"
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
        assert not {m for m in imported if m.startswith(("tasks.", "flows."))}, f"{path.name} imports a stage or a flow"
    # What the check catches: the recorder as it was before the stages carried their own concerns.
    before = 'if name == "train":\n    pass\nraw = self.outputs.get("to-parquet")\nplan = {"download": 1}'
    assert stage_names_used(ast.parse(before)) == {"train", "to-parquet", "download"}


@pytest.mark.slow
def test_a_champion_the_search_makes_sends_the_promoted_event(tmp_path, shared_server, shared_ray):
    """A real search with ``tune.train_best`` (``python -m flows.tune``, two one-epoch trials of the small model on
    the tests' image folder of coloured shapes) against the session's Prefect server, joining the session's Ray cluster (its workers know
    the API only by the URL the run hands them): its winner, trained, evaluated and promoted by the training flow's
    own stages in Ray workers, becomes the champion and the server gets ``pipeline.model.promoted`` for it, sent
    from the flow's process with the flow run related."""
    from reporting import events
    from tests.support.images import write_image_folder
    from tests.support.models import SMALL_MODEL
    from tests.support.prefect_server import api_env, wait_for
    from tests.support.ray_cluster import join_env

    folder = write_image_folder(tmp_path / "shapes", {"train": 40, "test": 15})
    storage = tmp_path / "storage"
    env = {k: v for k, v in api_env(shared_server.api).items() if not k.startswith(("MNIST_", "PIPELINE_"))} | join_env(shared_ray)
    out = subprocess.run(
        [sys.executable, "-m", "flows.tune", "--download.source", "folder", "--download.path", str(folder),
         "--storage-root", str(storage), "--run-name", "searched", "--model.name", SMALL_MODEL, "--tune.num-samples", "2",
         "--tune.epochs", "1", "--tune.train-best", "--train.epochs", "2", "--train.num-workers", "1",
         "--evaluate.min-accuracy", "0"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = json.loads((storage / "runs" / "searched" / "summary.json").read_text())
    assert summary["promotion"]["promoted"] and summary["evaluation"]["gate"] == "evaluate.min_accuracy, as set"
    model = summary["promotion"]["model"]

    def promoted() -> list[dict]:
        body = {"filter": {"event": {"name": [events.PROMOTED]}, "order": "ASC"}, "limit": 50}
        return [e for e in shared_server.post("/events/filter", body)["events"] if e["payload"].get("run") == "searched"]

    (event,) = wait_for(promoted, 30, "the search's promotion event")
    assert event["resource"]["prefect.resource.id"] == f"pipeline.model.{model}" and event["payload"]["version"] == 1
    related = {r["prefect.resource.id"] for r in event["related"]}
    assert f"prefect.flow-run.{summary['flow_run_id']}" in related  # sent by the flow run itself
