"""model.name as code: what a deployment's run may import, the model tried before any work, scoring's class range.

A run started through a deployment imports a ``module:function`` model only from the modules the
serving process allows (``PIPELINE_MODEL_MODULES``), decided on the name before anything is
imported; the command line trusts its user. Either way the model is built for the data and run
once on a tiny batch before any work: a bad function is refused with exit 2 naming it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from dataset.sources.interface import check_data
from pipeline_config import PipelineConfig
from runner.pipeline_run import PipelineRun, started_by_deployment
from tests.support.images import write_image_folder
from training.inference import confusion_matrix
from training.model.trust import MODULES_ENV, check_allowed, data_for_trial, try_model

ROOT = Path(__file__).resolve().parent.parent

# Functions a team might get wrong, each refused before any work with what it did.
BAD_MODELS = textwrap.dedent("""
    import torch

    def wrong_signature(channels, classes):
        return torch.nn.Linear(1, 1)

    def not_a_module(in_channels, num_classes):
        return [in_channels, num_classes]

    def raises_in_build(in_channels, num_classes):
        raise RuntimeError("no weights for this team")

    class Broken(torch.nn.Module):
        def forward(self, images):
            raise RuntimeError("forward is broken")

    def raises_in_forward(in_channels, num_classes):
        return Broken()

    def too_many_outputs(in_channels, num_classes):
        return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.LazyLinear(num_classes + 2))
""")

REFUSALS = {
    "wrong_signature": "wrong_signature(channels, classes) cannot be called as wrong_signature(in_channels=..., num_classes=...)",
    "not_a_module": "model.name 'bad_models:not_a_module' returned list, not a torch.nn.Module",
    "raises_in_build": "raises_in_build(in_channels=1, num_classes=10) raised RuntimeError: no weights for this team",
    "raises_in_forward": "the model's forward pass on 2 images of 1x28x28 raised RuntimeError: forward is broken",
    "too_many_outputs": "returned a tensor of shape (2, 12), not a tensor of shape (2, 10): one score per class, and the data has 10 classes",
}


def marker_module(tmp_path: Path, name: str = "team_nets") -> Path:
    """A module in ``tmp_path`` whose top level writes a marker file (code that ran at import); the marker's path."""
    marker = tmp_path / f"{name}-was-imported"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(f"""
        from pathlib import Path

        Path({str(marker)!r}).write_text("top-level code ran")

        def build(in_channels, num_classes):
            raise RuntimeError("built")
    """))
    return marker


def test_a_deployment_run_refuses_a_module_that_is_not_allowed_without_importing_it(tmp_path, monkeypatch):
    marker = marker_module(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv(MODULES_ENV, raising=False)
    with pytest.raises(ValueError, match=f"model.name 'team_nets:build': .* only from the modules in {MODULES_ENV} "
                                         r"\(training.model.catalog\), and 'team_nets' is not one of them; nothing was imported"):
        check_allowed("team_nets:build", deployed=True)
    assert not marker.exists() and "team_nets" not in sys.modules  # its top level never ran


@pytest.mark.parametrize("name", ["this:x", "os:system", "builtins:eval", "subprocess:Popen", "training.models_x:small_cnn"])
def test_a_deployment_run_refuses_the_standard_library_and_lookalikes(name, monkeypatch):
    monkeypatch.setenv(MODULES_ENV, "myteam.models")
    with pytest.raises(ValueError, match=f"{MODULES_ENV} \\(training.model.catalog, myteam.models\\)"):
        check_allowed(name, deployed=True)


def test_what_the_operator_allows_and_what_the_cli_may_import(monkeypatch):
    monkeypatch.setenv(MODULES_ENV, " myteam.models , other ")
    for name in ("training.model.catalog:small_cnn", "myteam.models:net", "myteam.models.cnn:net", "other.deep.pkg:f", "resnet18"):
        check_allowed(name, deployed=True)  # allowed: no error
    with pytest.raises(ValueError, match="'myteam' is not one of them"):
        check_allowed("myteam:net", deployed=True)  # a prefix allows what is under it, not its parent
    check_allowed("anything.at_all:f", deployed=False)  # the command line trusts its user
    monkeypatch.setenv(MODULES_ENV, "myteam.models,my team")
    with pytest.raises(ValueError, match=f"{MODULES_ENV}='myteam.models,my team': 'my team' is not a module name"):
        check_allowed("myteam.models:net", deployed=True)


def test_the_flow_refuses_a_deployments_run_naming_the_setting_before_anything_is_imported(tmp_path, monkeypatch):
    """`PipelineRun` in a flow run that a deployment started: refused first, before the data check and any import."""
    from prefect.client.schemas.objects import FlowRun
    from prefect.context import FlowRunContext

    marker = marker_module(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv(MODULES_ENV, raising=False)
    storage = tmp_path / "storage"
    config = PipelineConfig(  # a missing folder: what the code before this check refused first
        storage_root=str(storage), model={"name": "team_nets:build"}, download={"source": "folder", "path": str(tmp_path / "none")},
    )
    deployed = FlowRunContext.model_construct(flow_run=FlowRun(flow_id=uuid.uuid4(), deployment_id=uuid.uuid4()))
    with deployed:
        assert started_by_deployment()
        with pytest.raises(ValueError, match=f"model.name 'team_nets:build': a run started through a deployment .*{MODULES_ENV}"):
            with PipelineRun(config, "flows.train", [], None):
                pytest.fail("got past the checks")
    assert not started_by_deployment()  # outside a deployment's flow run: the command line's
    assert not marker.exists() and not storage.exists()


@pytest.fixture(scope="module")
def bad_models(tmp_path_factory) -> Iterator[Path]:
    """The folder holding ``bad_models.py`` (`BAD_MODELS`), on sys.path for the module's tests."""
    work = tmp_path_factory.mktemp("bad-models")
    (work / "bad_models.py").write_text(BAD_MODELS)
    sys.path.insert(0, str(work))
    try:
        yield work
    finally:
        sys.path.remove(str(work))
        sys.modules.pop("bad_models", None)


@pytest.mark.parametrize("function", list(REFUSALS))
def test_the_cli_refuses_a_bad_model_function_with_exit_2_before_any_work(bad_models, tmp_path, capsys, function):
    """flows.train's main in this process, as `python -m flows.train` runs it: exit 2 naming the function, before Ray."""
    import ray

    from flows import train

    storage = tmp_path / "storage"
    code = train.main(["--storage-root", str(storage), "--model.name", f"bad_models:{function}"])
    stderr = capsys.readouterr().err
    assert code == 2, stderr
    assert "invalid configuration" in stderr and f"model.name 'bad_models:{function}'" in stderr
    assert REFUSALS[function] in stderr
    assert not ray.is_initialized() and not storage.exists()  # nothing started, nothing written


def test_the_command_refuses_a_model_from_pythonpath_with_too_many_outputs(bad_models, tmp_path):
    storage = tmp_path / "storage"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(bad_models), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run(
        [sys.executable, "-m", "flows.train", "--storage-root", str(storage), "--model.name", "bad_models:too_many_outputs"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert REFUSALS["too_many_outputs"] in out.stderr
    assert "Traceback" not in out.stderr and not storage.exists()


def test_a_function_is_never_called_with_arguments_it_does_not_take():
    """os:system and friends (trusted on the command line) are refused from their signature, never called."""
    with pytest.raises(ValueError, match=r"model.name 'os:system': system\(command\) cannot be called as system\(in_channels"):
        try_model("os:system", (1, 28, 28), 10)
    with pytest.raises(ValueError, match="model.name 'builtins:eval': eval.* cannot be called"):
        try_model("builtins:eval", (1, 28, 28), 10)


def test_a_local_folder_is_tried_with_its_channels_size_and_classes(tmp_path, monkeypatch):
    images = write_image_folder(tmp_path / "shapes", {"train": 2, "test": 1})
    config = PipelineConfig(download={"source": "folder", "path": str(images)}, transform={"image_size": 16})
    checked = check_data(config.download, config.transform.image_size)
    assert data_for_trial(config, checked) == ((3, 16, 16), 3) == data_for_trial(config)  # what the check found, or asked anew
    assert data_for_trial(PipelineConfig(), None) == ((1, 28, 28), 10)  # the IDX sources: MNIST's digits
    (tmp_path / "shape_nets.py").write_text(BAD_MODELS)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=r"on 2 images of 3x16x16 returned a tensor of shape \(2, 5\), not .* \(2, 3\)"):
        try_model("shape_nets:too_many_outputs", (3, 16, 16), 3)


def test_the_trial_builds_a_good_model_and_leaves_torchs_random_state_alone():
    torch.manual_seed(5)
    before = torch.get_rng_state()
    try_model("training.model.catalog:small_cnn", (3, 20, 20), 4)
    assert torch.equal(torch.get_rng_state(), before)


def test_scoring_refuses_a_prediction_outside_the_classes():
    labels, preds = np.array([0, 1, 2, 1]), np.array([0, 1, 11, 1])  # a model with more outputs than classes
    with pytest.raises(ValueError, match=r"1 prediction\(s\) outside the 10 classes \(0-9\), e.g. 11"):
        confusion_matrix(labels, preds, num_classes=10)
    assert confusion_matrix(labels, np.array([0, 1, 2, 0]), 3).tolist() == [[1, 0, 0], [1, 1, 0], [0, 0, 1]]


def test_a_module_whose_top_level_raises_is_refused_naming_the_field(tmp_path, monkeypatch):
    (tmp_path / "broken_top.py").write_text("raise RuntimeError('half-installed package')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match="model.name 'broken_top:build': importing 'broken_top' raised RuntimeError: half-installed"):
        try_model("broken_top:build", (1, 28, 28), 10)
