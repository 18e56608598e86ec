"""Names follow the data: an image folder's run is named after its folder, a champion of other images is
refused before any work, and flows.predict names what it cannot find and the flag that is wrong.

Fast: configs, a registry written without training (a few-byte model.pt: the preflight reads cards only),
and the CLIs' mains in this process, which must refuse before Ray starts.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from pipeline_config import DownloadConfig, PipelineConfig
from pipeline_config.settings import TrainSettings, parse_cli
from runner import console
from runner.summary import RunSummary
from storage_io import StorageLayout, atomic_write_bytes, join
from tests.support.images import CLASSES, SIZE, write_image_folder
from tests.support.registry import light_candidate, make_dataset
from training.champion import registry, registry_files
from training.checkpoint.files import MODEL_FILE


def folder_config(path: Path | str, **fields) -> PipelineConfig:
    return PipelineConfig(download={"source": "folder", "path": str(path)}, **fields)


def test_a_folder_without_a_workload_is_named_after_the_folder(tmp_path, monkeypatch):
    assert folder_config(tmp_path / "My Shapes_2").workload == "my-shapes-2"
    assert folder_config(tmp_path / "My Shapes_2").registry_name == "my-shapes-2-resnet18"
    assert folder_config("s3://bucket/data/Flowers/").workload == "flowers"
    # The Prefect form starts from the defaults and sends workload mnist with the folder: still the folder's name
    form = PipelineConfig().model_dump(mode="json") | {"download": {"source": "folder", "path": str(tmp_path / "pets")}}
    assert PipelineConfig.model_validate(form).workload == "pets"
    assert PipelineConfig.model_validate(form | {"workload": None}).workload == "pets"
    settings = parse_cli(["--download.source", "folder", "--download.path", str(tmp_path / "pets")], TrainSettings)
    assert settings.pipeline_config().workload == "pets"
    config_file = tmp_path / "pets.yaml"
    config_file.write_text(f"download:\n  source: folder\n  path: {tmp_path / 'pets'}\n")
    assert parse_cli(["--config-file", str(config_file)], TrainSettings).pipeline_config().workload == "pets"

    # a workload of its own is kept, from a field, a flag or the environment
    assert folder_config(tmp_path / "pets", workload="flowers").workload == "flowers"
    assert parse_cli(["--workload", "flowers", "--config-file", str(config_file)], TrainSettings).pipeline_config().workload == "flowers"
    monkeypatch.setenv("PIPELINE_WORKLOAD", "cats")
    assert parse_cli(["--config-file", str(config_file)], TrainSettings).pipeline_config().workload == "cats"
    monkeypatch.delenv("PIPELINE_WORKLOAD")
    # MNIST's sources keep MNIST's names
    assert PipelineConfig().workload == "mnist" and PipelineConfig(download=DownloadConfig(source="sample")).workload == "mnist"
    assert parse_cli(["--preset", "smoke"], TrainSettings).pipeline_config().registry_name == "mnist-resnet18"


def test_a_folder_name_that_cannot_name_a_workload_is_refused_naming_the_flag(tmp_path, capsys):
    with pytest.raises(ValidationError, match="its folder's name cannot name the workload .* set --workload"):
        folder_config(tmp_path / "日本")
    assert folder_config(tmp_path / "日本", workload="nihon").workload == "nihon"
    from flows import train

    storage = tmp_path / "storage"
    code = train.main(["--storage-root", str(storage), "--download.source", "folder", "--download.path", str(tmp_path / "___")])
    assert code == 2 and "set --workload <name>" in capsys.readouterr().err and not storage.exists()


def test_the_first_lines_say_how_a_folder_workload_was_named(tmp_path):
    from flows.preflight import workload_line

    assert workload_line(folder_config(tmp_path / "shapes")) == "workload shapes (from the folder's name; set --workload to change)"
    assert workload_line(folder_config(tmp_path / "shapes", workload="rgb")) == "workload rgb (set by workload)"


# --------------------------------------------------------------------------- a champion of other images


def files_under(root: Path) -> list[str]:
    return sorted(str(path.relative_to(root)) for path in root.rglob("*"))


def rgb_candidate(layout: StorageLayout, run: str, dataset: str) -> registry.Candidate:
    """A candidate trained on the tests' 3-class RGB images (the card records their shape and classes)."""
    checkpoint = join(layout.runs_dir, run, "checkpoint_000000")
    atomic_write_bytes(join(checkpoint, MODEL_FILE), f"weights of {run}".encode())
    return registry.Candidate(
        run_name=run, checkpoint=checkpoint, accuracy=0.9, passed_gate=True, data_hash=registry_files.data_hash(dataset),
        dataset_dir=dataset, data_spec={"image": {"channels": 3, "height": SIZE, "width": SIZE}, "classes": list(CLASSES)},
    )


def test_a_champion_of_other_images_is_refused_before_any_work(tmp_path, capsys):
    import ray

    from flows import train

    layout = StorageLayout.create(str(tmp_path / "storage"), "unused")
    assert registry.promote(layout, "shapes-resnet18", light_candidate(layout, "digits", 0.9, make_dataset(layout, "mnist-a"))).promoted
    images = write_image_folder(tmp_path / "shapes", {"train": 2, "test": 1})
    before = files_under(tmp_path / "storage")

    code = train.main(["--storage-root", layout.root, "--download.source", "folder", "--download.path", str(images)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "shapes-resnet18 champion v1" in err and "trained on 1x28x28 images of 10 classes" in err
    assert f"this run's data is 3x{SIZE}x{SIZE} images of 3 classes (blue_cross, green_disc, red_square)" in err
    assert "Set --workload to a name of this data's own (it is shapes" in err and "or set promote.model_name" in err
    assert files_under(tmp_path / "storage") == before and not ray.is_initialized()  # nothing written, Ray never started

    # MNIST's digits against a champion of RGB shapes, named by promote.model_name: refused naming that field
    assert registry.promote(layout, "shapes-small", rgb_candidate(layout, "rgb", make_dataset(layout, "shapes-a"))).promoted
    code = train.main(["--storage-root", layout.root, "--preset", "smoke", "--promote.model-name", "shapes-small"])
    err = capsys.readouterr().err
    assert code == 2 and "trained on 3x20x20 images of 3 classes" in err and "1x28x28 images of 10 classes (0, 1, 2, 3, 4, 5, ..." in err
    assert "Set promote.model_name to a name of this data's own (it is shapes-small)" in err

    # the same images and classes: nothing to refuse (the data is only read when there is a champion)
    assert train.check_registry_fits(folder_config(images, storage_root=layout.root, promote={"model_name": "shapes-small"})) is None
    assert train.check_registry_fits(folder_config(images, storage_root=layout.root, workload="fresh")) is None
    assert train.check_registry_fits(folder_config(images, storage_root=layout.root, promote={"enabled": False})) is None


# --------------------------------------------------------------------------- flows.predict


@pytest.fixture
def predict_root(tmp_path) -> str:
    layout = StorageLayout.create(str(tmp_path / "storage"), "unused")
    assert registry.promote(layout, "shapes-resnet18", rgb_candidate(layout, "rgb", make_dataset(layout, "shapes-a"))).promoted
    return layout.root


def predict(*args: str, capsys) -> tuple[int, str]:
    import ray

    from flows import predict as cli

    code = cli.main(list(args))
    assert not ray.is_initialized()
    return code, capsys.readouterr().err


def test_predict_names_the_champions_there_are_when_the_model_is_not_in_the_registry(tmp_path, predict_root, capsys):
    images = str(write_image_folder(tmp_path / "in", {"test": 1}) / "test")
    code, err = predict("--storage-root", predict_root, "--input", images, "--model", "shapes-resnet19", capsys=capsys)
    assert code == 2 and "--model shapes-resnet19: no such model in" in err
    assert "the models with a champion there, to pass as --model: shapes-resnet18 (champion v1)" in err and "no champion yet" not in err
    code, err = predict("--storage-root", predict_root, "--input", images, capsys=capsys)  # the default, mnist-resnet18
    assert code == 2 and "the default model mnist-resnet18 (of --workload mnist): no such model" in err and "shapes-resnet18" in err
    code, err = predict("--storage-root", str(tmp_path / "empty"), "--input", images, capsys=capsys)
    assert code == 2 and "no model there has a champion yet" in err


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["--model", "../x"], "--model: '../x': use lowercase letters"),
        (["--version", "two"], "--version: Input should be a valid integer"),
        (["--num-actors", "0"], "--num-actors: Input should be greater than or equal to 1"),
        (["--workload", "My Data"], "--workload: workload 'My Data': use lowercase letters"),
        (["--ray-address", "nowhere"], "--ray-address: cannot parse Ray address 'nowhere'"),
        (["--output", "s3://B/x.parquet"], "--output 's3://B/x.parquet': 'B' is not an S3 bucket name"),
    ],
)
def test_predict_argument_errors_are_one_line_each_with_exit_2(tmp_path, predict_root, capsys, args, line):
    code, err = predict("--storage-root", predict_root, "--input", str(tmp_path), *args, capsys=capsys)
    assert code == 2 and err.splitlines() == ["invalid input:", err.splitlines()[1]] and err.splitlines()[1].startswith(line), err
    assert "pydantic" not in err and "validation error" not in err and "input_value" not in err
    code, err = predict("--storage-root", predict_root, capsys=capsys)
    assert code == 2 and err == "invalid input:\n--input: Field required\n"


def test_the_closing_predict_line_fits_the_workload():
    base = {"run_name": "r", "storage_root": "/s", "promotion": {"model": "shapes-resnet18", "promoted": True, "version": 1}}
    lines = console.summary_lines(RunSummary.model_validate(base | {"data_source": "folder"}), None, 1, None, True)
    (line,) = [line for line in lines if "flows.predict" in line]
    assert line.endswith("--storage-root /s --model shapes-resnet18 --input <folder of images>")
    mnist = base | {"data_source": "sample", "promotion": base["promotion"] | {"model": "mnist-resnet18"}}
    (line,) = [line for line in console.summary_lines(RunSummary.model_validate(mnist), None, 1, None, True) if "flows.predict" in line]
    assert line.endswith("--storage-root /s --input <folder of IDX or Parquet digits>")
    parquet = base | {"data_source": "parquet"}
    (line,) = [line for line in console.summary_lines(RunSummary.model_validate(parquet), None, 1, None, True) if "flows.predict" in line]
    assert line.endswith("--input <folder of Parquet files>")
