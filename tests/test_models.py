"""model.name: the three forms build through one factory, bad names are refused before any work, checkpoints record the model."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from pipeline_config import PipelineConfig
from training.checkpoint.files import EXTRA_STATE_FILE, SEEDS_MODEL
from training.checkpoint.model_files import (
    build_resnet18,
    checkpoint_model,
    load_model,
    load_state,
    save_checkpoint_files,
)
from training.model.catalog import ModelSpec, build_model, check_name, small_cnn

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v3_small", "training.model.catalog:small_cnn"])
def test_each_form_builds_for_the_data_channels_and_classes(name):
    model = build_model(name, in_channels=3, num_classes=7)
    assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 7)


def test_resnet18_is_built_the_seeds_way_for_one_channel():
    """Same seed, same weights as the seeds' construction (the MNIST default is unchanged)."""
    from torchvision.models import resnet18

    torch.manual_seed(3)
    seeds = resnet18(num_classes=10)
    seeds.conv1 = torch.nn.Conv2d(1, 64, kernel_size=(7, 7), stride=(2, 2), padding=(3, 3), bias=False)
    torch.manual_seed(3)
    ours = ModelSpec(name="resnet18", in_channels=1, num_classes=10).build()
    assert ours.state_dict().keys() == seeds.state_dict().keys()
    assert all(torch.equal(value, seeds.state_dict()[key]) for key, value in ours.state_dict().items())


def test_a_users_own_function_is_called_with_channels_and_classes(tmp_path, monkeypatch):
    package = tmp_path / "team_models"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "nets.py").write_text(textwrap.dedent("""
        import torch

        calls = []

        def tiny(in_channels, num_classes):
            calls.append((in_channels, num_classes))
            return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.LazyLinear(num_classes))

        def not_a_module(in_channels, num_classes):
            return "a string"
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    model = build_model("team_models.nets:tiny", in_channels=2, num_classes=4)
    import team_models.nets

    assert team_models.nets.calls == [(2, 4)] and model(torch.zeros(3, 2, 8, 8)).shape == (3, 4)
    with pytest.raises(ValueError, match="model.name 'team_models.nets:not_a_module' returned str, not a torch.nn.Module"):
        build_model("team_models.nets:not_a_module", in_channels=1, num_classes=2)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("resnet19", "model.name 'resnet19' is not a torchvision classification model"),
        ("fasterrcnn_resnet50_fpn", "is not a torchvision classification model"),  # a detection model
        ("no_such_package.nets:build", "model.name 'no_such_package.nets:build': cannot import 'no_such_package.nets'"),
        ("training.model.catalog:no_such_function", "training.model.catalog has no function 'no_such_function'"),
    ],
)
def test_a_name_that_resolves_to_no_model_is_refused_naming_the_field(name, message):
    with pytest.raises(ValueError, match=message):
        check_name(name)


def test_the_config_refuses_a_malformed_name_naming_the_field():
    with pytest.raises(ValueError, match="model.name"):
        PipelineConfig.model_validate({"model": {"name": "my model:v2"}})
    assert PipelineConfig().model.name == "resnet18"


def test_the_cli_refuses_an_unknown_model_before_any_work(tmp_path):
    storage = tmp_path / "storage"
    out = subprocess.run(
        [sys.executable, "-m", "flows.mnist", "--storage-root", str(storage), "--model.name", "resnet19"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert "invalid configuration" in out.stderr and "model.name 'resnet19'" in out.stderr
    assert "Traceback" not in out.stderr and not storage.exists()  # nothing started, nothing written


def test_checkpoints_record_the_model_and_load_without_being_told(tmp_path):
    spec = ModelSpec(name="training.model.catalog:small_cnn", in_channels=1, num_classes=10)
    model = spec.build()
    save_checkpoint_files(tmp_path, model, torch.optim.AdamW(model.parameters()), {"epoch": 0, "model": spec.model_dump()})
    assert load_state(tmp_path, EXTRA_STATE_FILE)["model"] == spec.model_dump()
    assert checkpoint_model(tmp_path) == spec
    loaded = load_model(tmp_path)
    assert all(torch.equal(value, model.state_dict()[key]) for key, value in loaded.state_dict().items())
    with pytest.raises(ValueError, match="does not hold a model.name=resnet18 with 1 input channel"):
        load_model(tmp_path, SEEDS_MODEL)  # told the wrong model: refused, not half-loaded


def test_a_checkpoint_from_before_model_name_is_the_seeds_resnet18(tmp_path):
    model = build_resnet18()
    save_checkpoint_files(tmp_path, model, torch.optim.AdamW(model.parameters()), {"epoch": 0})  # no "model" entry
    assert checkpoint_model(tmp_path) == SEEDS_MODEL
    assert load_model(tmp_path).conv1.in_channels == 1


def test_small_cnn_is_small():
    resnet = sum(p.numel() for p in build_resnet18().parameters())
    small = sum(p.numel() for p in small_cnn(1, 10).parameters())
    assert small * 100 < resnet
