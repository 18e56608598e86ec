"""Configuration: presets, precedence, and every bad input refused before any work, naming the field."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from pipeline_config import PipelineConfig
from pipeline_config.evaluation import OWN_GATES
from pipeline_config.settings import parse_cli

ROOT = Path(__file__).resolve().parent.parent


def test_defaults_and_smoke_preset():
    default = parse_cli([]).pipeline_config()
    smoke = parse_cli(["--preset", "smoke"]).pipeline_config()
    assert default.train.epochs > smoke.train.epochs
    assert smoke.download.source == "sample"
    assert default.evaluate.min_accuracy is None  # unset: the workload's own gate (`tasks.gate`)
    assert OWN_GATES["idx"] == pytest.approx(0.975)  # MNIST's digits keep theirs
    assert smoke.evaluate.min_accuracy < OWN_GATES["idx"]


def test_precedence_preset_file_env_cli(tmp_path, monkeypatch):
    config_file = tmp_path / "run.yaml"
    config_file.write_text("train:\n  epochs: 5\n  seed: 7\nevaluate:\n  min_accuracy: 0.2\n")
    monkeypatch.setenv("PIPELINE_TRAIN__SEED", "9")
    settings = parse_cli(["--preset", "smoke", "--config-file", str(config_file), "--evaluate.min-accuracy", "0.3"])
    config = settings.pipeline_config()
    assert config.download.source == "sample"  # preset
    assert config.train.epochs == 5  # file over preset
    assert config.train.seed == 9  # env over file
    assert config.evaluate.min_accuracy == 0.3  # flag over everything


def test_help_lists_every_field():
    out = subprocess.run(
        [sys.executable, "-m", "flows.mnist", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    for section, model in PipelineConfig.model_fields.items():
        if hasattr(model.annotation, "model_fields"):
            for field in model.annotation.model_fields:
                assert f"--{section}.{field.replace('_', '-')}" in out.stdout, field
        else:
            assert f"--{section.replace('_', '-')}" in out.stdout


def test_every_field_has_a_description():
    def walk(model):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"
            if hasattr(field.annotation, "model_fields"):
                walk(field.annotation)

    walk(PipelineConfig)


@pytest.mark.parametrize(
    ("data", "field", "hint"),
    [
        ({"train": {"epochs": 0}}, "train.epochs", "greater than or equal to 1"),
        ({"train": {"epochs": -3}}, "train.epochs", "greater than or equal to 1"),
        ({"train": {"num_workers": 4, "global_batch_size": 2}}, "global_batch_size", "raise the batch"),
        ({"train": {"epoch": 3}}, "train.epoch", "Extra inputs are not permitted"),
        ({"surprise": 1}, "surprise", "Extra inputs are not permitted"),
        ({"run_name": "a/b"}, "run_name", "may not contain"),
        ({"run_name": "a\\b"}, "run_name", "may not contain"),
        ({"run_name": "x..y"}, "run_name", "may not contain"),
        ({"ray": {"address": "not an address"}}, "ray.address", "cannot parse Ray address"),
        ({"ray": {"address": "http://host:1"}}, "ray.address", "cannot parse Ray address"),
        ({"ray": {"address": "host:port"}}, "ray.address", "cannot parse Ray address"),
        ({"download": {"source": "mirror"}}, "download", "mirror_url"),
        ({"train": {"strategy": "fsdp"}}, "ema_decay", "fsdp"),
        ({"download": {"mirror_url": "ftp://x/"}}, "download.mirror_url", "http://"),
        ({"transform": {"cpus_per_task": 2.0}, "train": {"data_cpus": 1.0}}, "cpus_per_task", "data_cpus"),
        ({"workload": "MNIST"}, "workload", "lowercase letters, digits and '-'"),
        ({"workload": "my_data"}, "workload", "lowercase letters, digits and '-'"),
        ({"workload": "-x"}, "workload", "starting with a letter or digit"),
        ({"workload": ""}, "workload", "lowercase letters, digits and '-'"),
        ({"workload": "a" * 41}, "workload", "at most 40"),
        ({"workload": "a\nb"}, "workload", "line break"),
    ],
)
def test_bad_values_name_the_field(data, field, hint):
    with pytest.raises(ValidationError) as info:
        PipelineConfig.model_validate(data)
    text = str(info.value)
    assert field.split(".")[-1] in text
    assert hint in text


def test_the_workload_names_runs_artifacts_and_the_registry_and_mnist_keeps_its_names(monkeypatch):
    """The defaults are MNIST's names exactly (deployments, artifacts and champions stay valid); another
    workload's names start with it."""
    from pipeline_config import TunePipelineConfig
    from reporting.artifacts import artifact_keys, tune_keys
    from runner.pipeline_run import default_run_name, run_name_prefix

    mnist = PipelineConfig()
    assert mnist.workload == "mnist" and mnist.registry_name == "mnist-resnet18"
    assert run_name_prefix(mnist) == "mnist" and default_run_name().startswith("mnist-")
    assert run_name_prefix(TunePipelineConfig()) == "tune"  # a search's runs, as they always were
    assert artifact_keys() == {
        "samples": "mnist-sample-digits", "progress": "mnist-training-progress", "curves": "mnist-training-curves",
        "confusion": "mnist-confusion-matrix", "predictions": "mnist-test-predictions", "metrics": "mnist-test-metrics",
        "checkpoint": "mnist-checkpoint", "environment": "mnist-run-environment",
    }
    assert tune_keys() == {"trials": "mnist-tune-trials", "trial_curves": "mnist-tune-curves"}

    other = PipelineConfig(workload="rgb-shapes", model={"name": "training.model.catalog:small_cnn"})
    assert other.registry_name == "rgb-shapes-small-cnn"
    assert run_name_prefix(other) == "rgb-shapes" and run_name_prefix(TunePipelineConfig(workload="rgb-shapes")) == "rgb-shapes-tune"
    assert set(artifact_keys("rgb-shapes").values()) == {key.replace("mnist-", "rgb-shapes-", 1) for key in artifact_keys().values()}

    # Every entry point reads PIPELINE_*; flows.mnist and flows.tune still read the MNIST_* they read before, below it
    from pipeline_config.settings import TrainSettings, TuneSettings, old_prefix_lines

    monkeypatch.setenv("PIPELINE_WORKLOAD", "rgb-shapes")
    monkeypatch.setenv("PIPELINE_TRAIN__EPOCHS", "4")
    monkeypatch.setenv("MNIST_TRAIN__EPOCHS", "6")
    monkeypatch.setenv("MNIST_TRAIN__SEED", "11")
    generic = parse_cli(["--preset", "smoke"], TrainSettings).pipeline_config()
    assert (generic.workload, generic.train.epochs, generic.train.seed, generic.download.source) == ("rgb-shapes", 4, 0, "sample")
    mnist = parse_cli([]).pipeline_config()
    assert (mnist.workload, mnist.train.epochs, mnist.train.seed) == ("rgb-shapes", 4, 11)  # PIPELINE_ over MNIST_
    assert parse_cli([], TuneSettings).pipeline_config().train.seed == 11
    assert old_prefix_lines(TrainSettings) == []  # flows.train never read MNIST_: nothing to say
    assert old_prefix_lines(type(parse_cli([]))) == [
        "MNIST_TRAIN__EPOCHS: read as PIPELINE_TRAIN__EPOCHS (the MNIST_ prefix is deprecated; set PIPELINE_TRAIN__EPOCHS instead)",
        "MNIST_TRAIN__SEED: read as PIPELINE_TRAIN__SEED (the MNIST_ prefix is deprecated; set PIPELINE_TRAIN__SEED instead)",
    ]


def test_the_cli_names_each_old_prefix_variable_it_still_reads(tmp_path):
    """flows.mnist still reads MNIST_<FIELD> and says, before anything else, what to set instead (issue 68)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MNIST_", "PIPELINE_"))}
    out = subprocess.run(
        [sys.executable, "-m", "flows.mnist", "--storage-root", str(tmp_path / "root")],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env=env | {"MNIST_TRAIN__EPOCHS": "none"},
    )
    assert out.returncode == 2, out.stderr
    first, *rest = out.stderr.splitlines()
    assert first == "MNIST_TRAIN__EPOCHS: read as PIPELINE_TRAIN__EPOCHS (the MNIST_ prefix is deprecated; set PIPELINE_TRAIN__EPOCHS instead)"
    assert "train.epochs" in "\n".join(rest) and not (tmp_path / "root").exists()  # the value itself refused, naming the field


def test_cli_refuses_a_bad_workload_naming_the_field_before_any_work(tmp_path):
    root = tmp_path / "root"
    out = subprocess.run(
        [sys.executable, "-m", "flows.train", "--storage-root", str(root), "--workload", "My Data"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 2, out.stderr
    assert "workload" in out.stderr and "lowercase letters" in out.stderr
    assert not root.exists()  # nothing created


def test_good_ray_addresses():
    for address in ("auto", "127.0.0.1:6379", "ray://head:10001", None):
        assert PipelineConfig.model_validate({"ray": {"address": address}}).ray.address == address


def test_unwritable_storage_root_is_refused_and_nothing_created(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):  # root ignores permission bits; use a path under a file instead
            target = tmp_path / "a-file"
            target.write_text("x")
            bad = target / "storage"
            match = "is not a folder"
        else:
            bad = locked / "storage"
            match = "not writable"
        with pytest.raises(ValidationError, match=match):
            PipelineConfig.model_validate({"storage_root": str(bad)})
        assert not bad.exists()
    finally:
        locked.chmod(0o700)


def test_cli_rejects_bad_input_before_any_work(tmp_path):
    root = tmp_path / "root"
    out = subprocess.run(
        [sys.executable, "-m", "flows.mnist", "--storage-root", str(root), "--train.epochs", "0"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode != 0
    assert "epochs" in out.stderr
    assert not root.exists()  # nothing created


def test_cli_rejects_unknown_flag(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "flows.mnist", "--storage-root", str(tmp_path / "r"), "--train.epoch", "3"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode != 0
    assert "train.epoch" in out.stderr
    assert not (tmp_path / "r").exists()


def test_elastic_worker_range_is_checked_and_passed_to_ray_train():
    from training.trainer import worker_range

    config = parse_cli(["--train.num-workers", "4", "--train.min-workers", "2"]).pipeline_config()
    assert worker_range(config.train) == (2, 4)
    assert worker_range(parse_cli(["--train.num-workers", "3"]).pipeline_config().train) == 3
    with pytest.raises(ValueError, match="train.min_workers"):
        parse_cli(["--train.num-workers", "2", "--train.min-workers", "3"]).pipeline_config()


def test_predict_finds_the_workloads_champion_by_default_and_refuses_a_bad_workload(tmp_path, capsys):
    from pydantic_settings import CliApp

    from flows.predict import main
    from pipeline_config.predict import PredictSettings

    def model(*args: str) -> str:
        return CliApp.run(PredictSettings, cli_args=["--input", str(tmp_path), *args]).model_name()

    assert model() == "mnist-resnet18"  # MNIST's champion, as before
    assert model("--workload", "shapes") == "shapes-resnet18"
    assert model("--workload", "shapes", "--model", "shapes-small-cnn") == "shapes-small-cnn"
    root = tmp_path / "root"
    assert main(["--input", str(tmp_path), "--storage-root", str(root), "--workload", "Shapes"]) == 2
    assert "workload" in capsys.readouterr().err and not root.exists()
