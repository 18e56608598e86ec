"""model.weights: a fresh training run starting from weights you have (training/model/weights.py).

Key matching on real state dicts saved with torch.save (torchvision's ResNet-18 with 3 channels and
1000 classes into ours for 1 channel and 10; small_cnn across channels and classes): what fits is
loaded exactly, the first layer and the head start as a fresh model of the same seed would. The
champion of another workload by its registry name, written by the real registry. Refusals through
the CLI in this process, before Ray starts (exit 2 naming model.weights). One slow test fine-tunes
from a champion of another workload through `flows.train` and beats the run from scratch.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from pipeline_config import PipelineConfig, TrainConfig
from storage_io import StorageLayout, atomic_write_bytes, join
from tests.support.models import SMALL_MODEL
from tests.support.registry import make_dataset
from training.champion import registry
from training.checkpoint.files import CHECKSUMS_FILE, MODEL_FILE
from training.checkpoint.in_attempt import checkpoint_extra
from training.checkpoint.model_files import save_checkpoint_files
from training.manifests import LoopConfig
from training.model.catalog import ModelSpec, build_model
from training.model.weights import WeightsError, check, for_training, match, read_state, start_from
from training.trainer import loop_config
from training.worker.loop import start_attempt

ROOT = Path(__file__).resolve().parent.parent


def saved(model: torch.nn.Module, path: Path, prefix: str = "") -> Path:
    """``model``'s state dict written with torch.save, keys under ``prefix`` (a DDP model's ``module.``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({prefix + key: value for key, value in model.state_dict().items()}, path)
    return path


def fresh(name: str, channels: int, classes: int, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model(name, in_channels=channels, num_classes=classes)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a, b)


def test_torchvision_resnet18_loads_into_ours_for_one_channel_and_ten_classes_with_conv1_and_fc_fresh(tmp_path):
    from torchvision.models import resnet18

    torch.manual_seed(1)
    theirs = resnet18(weights=None)  # 3 channels, 1000 classes: a torchvision .pth as it comes
    file = saved(theirs, tmp_path / "resnet18-imagenet.pth")
    model, untouched = fresh("resnet18", 1, 10), fresh("resnet18", 1, 10)
    found = match(model, read_state(str(file), str(file))[0])
    assert found.fresh_layers() == ["conv1", "fc"] and not found.missing and not found.unexpected
    assert found.mismatched == {"conv1.weight": ((64, 3, 7, 7), (64, 1, 7, 7)), "fc.weight": ((1000, 512), (10, 512)),
                                "fc.bias": ((1000,), (10,))}
    file_state, ours, before = theirs.state_dict(), model.state_dict(), untouched.state_dict()
    for key in ours:
        expected = before[key] if key in found.mismatched else file_state[key]  # fresh: as the same seed built it
        assert same(ours[key], expected), key
    assert len(found.loaded) == len(ours) - 3
    line = found.describe(str(file), "ab" * 32)
    assert "119 of 122 tensors loaded; starting fresh: conv1 (64x3x7x7 in the file, 64x1x7x7 here), fc (1000x512" in line


def test_small_cnn_of_other_channels_and_classes_and_a_ddp_prefix(tmp_path):
    source = fresh(SMALL_MODEL, 3, 5, seed=7)
    file = saved(source, tmp_path / "ddp.pt", prefix="module.")  # a DDP model's state dict: the prefix goes
    model, untouched = fresh(SMALL_MODEL, 1, 2), fresh(SMALL_MODEL, 1, 2)
    found = match(model, read_state(str(file), str(file))[0])
    assert found.fresh_layers() == ["0.0", "5"]  # the first conv (1 channel, not 3) and the head (2 classes, not 5)
    assert set(found.mismatched) == {"0.0.weight", "5.weight", "5.bias"}
    for key, value in model.state_dict().items():
        assert same(value, (untouched if key in found.mismatched else source).state_dict()[key]), key
    same_shape = fresh(SMALL_MODEL, 3, 5)
    assert match(same_shape, read_state(str(file), str(file))[0]).fresh == []  # every tensor loaded
    assert all(same(v, source.state_dict()[k]) for k, v in same_shape.state_dict().items())


def test_our_model_pt_and_its_folder_are_read_and_a_damaged_one_is_refused(tmp_path):
    model = fresh(SMALL_MODEL, 3, 4, seed=3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    (tmp_path / "checkpoint_epoch-0000").mkdir()
    folder = save_checkpoint_files(tmp_path / "checkpoint_epoch-0000", model, optimizer, {"epoch": 0})
    start, found = check(str(folder), str(tmp_path), SMALL_MODEL, (3, 20, 20), 2)  # a folder: its model.pt
    assert start.file == str(folder / MODEL_FILE) and found.fresh_layers() == ["5"]
    assert start.sha256 == json.loads((folder / CHECKSUMS_FILE).read_text())[MODEL_FILE]
    data = (folder / MODEL_FILE).read_bytes()
    (folder / MODEL_FILE).write_bytes(data[:-10] + b"0123456789")  # same size, other bytes
    with pytest.raises(WeightsError, match=r"model.weights .*model.pt does not match its sha256 in _checksums.json"):
        check(str(folder / MODEL_FILE), str(tmp_path), SMALL_MODEL, (3, 20, 20), 2)


def promote_champion(root: Path, name: str, model: torch.nn.Module) -> str:
    """``model`` promoted by the real registry as the first (so champion) version of ``name`` on ``root``."""
    layout = StorageLayout.create(str(root), "source-run")
    checkpoint = join(layout.runs_dir, "source-run", "checkpoint_epoch-0000")
    saved(model, Path(checkpoint) / MODEL_FILE)
    candidate = registry.Candidate(
        run_name="source-run", checkpoint=checkpoint, accuracy=0.9, passed_gate=True, dataset_dir=make_dataset(layout, "src"),
        data_hash="0" * 64, model=ModelSpec(name=SMALL_MODEL, in_channels=3, num_classes=4).model_dump(),
    )
    assert registry.promote(layout, name, candidate).promoted
    return checkpoint


def test_a_champion_of_another_workload_by_its_registry_name_and_what_the_run_records(tmp_path):
    source = fresh(SMALL_MODEL, 3, 4, seed=5)
    promote_champion(tmp_path / "storage", "dots-small-cnn", source)
    spec = ModelSpec(name=SMALL_MODEL, in_channels=3, num_classes=2)
    start, said = for_training("dots-small-cnn", str(tmp_path / "storage"), spec)
    assert start.file == str(tmp_path / "storage" / "models" / "dots-small-cnn" / "v1" / MODEL_FILE)
    assert said.startswith(f"model.weights dots-small-cnn (sha256 {start.sha256[:12]}): 18 of 20 tensors loaded")
    assert "starting fresh: 5 (4x64 in the file, 2x64 here)" in said
    # every rank: a fresh start loads exactly the champion's tensors; a resume (fresh=False) builds only
    cfg = LoopConfig.model_validate(loop_config(TrainConfig(), 10, 1, spec, weights=start.model_dump()))
    loaded = start_attempt(cfg, 1, torch.device("cpu"), prepare=lambda m: m).model
    assert same(loaded.state_dict()["1.0.weight"], source.state_dict()["1.0.weight"])
    resumed = start_attempt(cfg, 1, torch.device("cpu"), prepare=lambda m: m, fresh=False).model
    assert same(resumed.state_dict()["1.0.weight"], fresh(SMALL_MODEL, 3, 2).state_dict()["1.0.weight"])
    extra = checkpoint_extra({"val_loss": 1.0}, loaded, 0, None, model_spec=cfg.model)  # extra_state.pt
    assert extra["weights"] == start.record() == {"source": "dots-small-cnn", "file": start.file, "sha256": start.sha256}
    assert extra["model"] == spec.model_dump()
    atomic_write_bytes(start.file, b"replaced during the run")
    with pytest.raises(WeightsError, match="changed since the run checked it"):
        start_from(fresh(SMALL_MODEL, 3, 2), start.model_dump())


def test_the_model_card_records_the_weights_a_run_started_from(tmp_path):
    layout = StorageLayout.create(str(tmp_path / "storage"), "run-b")
    checkpoint = join(layout.runs_dir, "run-b", "checkpoint_epoch-0000")
    saved(fresh(SMALL_MODEL, 3, 2), Path(checkpoint) / MODEL_FILE)
    record = {"source": "dots-small-cnn", "file": "/x/models/dots-small-cnn/v1/model.pt", "sha256": "c" * 64}
    candidate = registry.Candidate(run_name="run-b", checkpoint=checkpoint, accuracy=0.8, passed_gate=True,
                                   dataset_dir=make_dataset(layout, "b"), data_hash="1" * 64, weights=record)
    done = registry.promote(layout, "shapes-small-cnn", candidate)
    card = json.loads((Path(done.version_dir) / "model_card.json").read_text())
    assert card["weights"] == record


def test_config_refuses_other_schemes_and_credentials_naming_the_field():
    for value, said in (("https://example.com/r18.pth", "give a local path, an s3:// URI or a registry model's name"),
                        ("s3://key:secret@bucket/r18.pth", "holds credentials"), ("s3://bucket/r18.pth?token=x", "holds credentials")):
        with pytest.raises(ValidationError, match=f"model.weights(.|\n)*{said}"):
            PipelineConfig(model={"weights": value})
    assert PipelineConfig(model={"weights": "  s3://bucket/r18.pth "}).model.weights == "s3://bucket/r18.pth"


def refused(tmp_path, capsys, weights: str, *args: str) -> str:
    """flows.train's main in this process, as `python -m flows.train` runs it: exit 2 before Ray starts; its stderr."""
    import ray

    from flows import train

    runs = tmp_path / "storage" / "runs"
    before = sorted(runs.iterdir()) if runs.exists() else []
    code = train.main(["--storage-root", str(tmp_path / "storage"), "--model.name", SMALL_MODEL, "--model.weights", weights, *args])
    stderr = capsys.readouterr().err
    assert code == 2, stderr
    assert "invalid configuration" in stderr and "Traceback" not in stderr
    assert not ray.is_initialized() and (sorted(runs.iterdir()) if runs.exists() else []) == before  # nothing started or written
    return stderr


def test_the_cli_refuses_a_missing_file(tmp_path, capsys):
    missing = tmp_path / "nowhere" / "r18.pth"
    assert f"model.weights '{missing}': no such file" in refused(tmp_path, capsys, str(missing))


def test_the_cli_refuses_a_text_file(tmp_path, capsys):
    text = tmp_path / "weights.pth"
    text.write_text("these are not weights\n")
    stderr = refused(tmp_path, capsys, str(text))
    assert f"model.weights '{text}': {text} is not a state dict file torch.load reads with weights_only=True" in stderr


def test_the_cli_refuses_an_unknown_registry_name_listing_the_known_ones(tmp_path, capsys):
    promote_champion(tmp_path / "storage", "dots-small-cnn", fresh(SMALL_MODEL, 3, 4))
    stderr = refused(tmp_path, capsys, "glyphs-resnet18")
    assert "model.weights 'glyphs-resnet18': no model of that name with a champion in the registry at" in stderr
    assert "(models with a champion: dots-small-cnn); for a local file of that name write ./glyphs-resnet18" in stderr


def test_the_cli_refuses_weights_of_another_architecture(tmp_path, capsys):
    from torchvision.models import resnet18

    file = saved(resnet18(weights=None), tmp_path / "r18.pth")
    stderr = refused(tmp_path, capsys, str(file))
    assert f"none of the 122 tensors in {file} fits model.name '{SMALL_MODEL}'" in stderr


def test_a_state_dict_of_no_tensors_is_refused(tmp_path):
    torch.save({"epoch": 3, "note": "no weights here"}, tmp_path / "extra.pt")
    with pytest.raises(WeightsError, match="holds no tensors: not a state dict"):
        read_state(str(tmp_path / "extra.pt"), "extra.pt")
    torch.save([torch.zeros(2)], tmp_path / "list.pt")
    with pytest.raises(WeightsError, match="holds list, not a state dict"):
        read_state(str(tmp_path / "list.pt"), "list.pt")


def test_the_flow_refuses_a_deployments_run_naming_model_weights_before_any_work(tmp_path):
    """`PipelineRun` (what a deployment's run goes through) checks model.weights beside the model trial."""
    from runner.pipeline_run import PipelineRun

    config = PipelineConfig(storage_root=str(tmp_path / "storage"), model={"name": SMALL_MODEL, "weights": "glyphs-resnet18"})
    with pytest.raises(ValueError, match="model.weights 'glyphs-resnet18': no model of that name with a champion"):
        with PipelineRun(config, "flows.train", [], None):
            pytest.fail("got past the checks")
    assert not (tmp_path / "storage").exists()


# --------------------------------------------------------------------------- end to end


def pretrained_small_cnn(seed: int = 0) -> torch.nn.Module:
    """small_cnn trained in this process by a plain loop on the shapes workload (3 classes, 32x32 RGB)."""
    from benchmarks.data.workloads import make

    data = make("shapes", train_per_class=200, test_per_class=1, seed=seed + 100)
    images = (torch.from_numpy(data.train_x).permute(0, 3, 1, 2).float() / 255 - 0.5) / 0.5  # the flow's mean/std below
    labels = torch.from_numpy(data.train_y)
    model = fresh(SMALL_MODEL, 3, 3, seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 s; two threads on a busy 2-core machine took 40x that (measured)
    try:
        for _ in range(8):
            for batch in torch.randperm(len(labels)).split(32):
                optimizer.zero_grad()
                torch.nn.functional.cross_entropy(model(images[batch]), labels[batch]).backward()
                optimizer.step()
    finally:
        torch.set_num_threads(threads)
    return model.eval()


def two_shapes_folder(root: Path) -> Path:
    """Another workload: discs and triangles only (2 classes, other images), as an image folder."""
    from benchmarks.data.workloads import Workload, make, write_folder

    data = make("shapes", train_per_class=40, test_per_class=60, seed=7)
    keep_train, keep_test = data.train_y != 1, data.test_y != 1  # no squares
    relabel = np.array([0, -1, 1])
    return write_folder(Workload("discs-triangles", ("disc", "triangle"), data.train_x[keep_train], relabel[data.train_y[keep_train]],
                                 data.test_x[keep_test], relabel[data.test_y[keep_test]]), root)


@pytest.mark.slow
@pytest.mark.spine
def test_fine_tuning_from_another_workloads_champion_beats_the_start_from_scratch(tmp_path, shared_server, shared_ray):
    """One epoch on 2-class images from scratch, and the same run (same seed, same data) from the champion of a
    3-class workload: its head starts fresh, the rest loads, and the test accuracy is higher.
    (Both runs join the session's Ray cluster, ``shared_ray``: this test is not about a run's own Ray.)"""
    from tests.support.prefect_server import api_env
    from tests.support.ray_cluster import join_env

    storage = tmp_path / "storage"
    promote_champion(storage, "shapes-small-cnn", pretrained_small_cnn())
    images = two_shapes_folder(tmp_path / "discs-triangles")
    env = {k: v for k, v in api_env(shared_server.api).items() if not k.startswith("PIPELINE_")} | join_env(shared_ray)
    common = ["--storage-root", str(storage), "--download.source", "folder", "--download.path", str(images),
              "--model.name", SMALL_MODEL, "--train.epochs", "1", "--train.global-batch-size", "8", "--train.ema-decay", "0",
              "--transform.mean", "0.5", "--transform.std", "0.5", "--evaluate.min-accuracy", "0", "--no-promote.enabled"]
    accuracy = {}
    for run, extra in (("scratch", []), ("tuned", ["--model.weights", "shapes-small-cnn"])):
        out = subprocess.run([sys.executable, "-m", "flows.train", *common, "--run-name", run, *extra], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        summary = json.loads((storage / "runs" / run / "summary.json").read_text())
        accuracy[run] = summary["test_accuracy"]
    print(f"one epoch: from scratch {accuracy['scratch']:.2%}, from the shapes champion {accuracy['tuned']:.2%}")
    champion = storage / "models" / "shapes-small-cnn" / "v1" / MODEL_FILE
    assert summary["weights"] == {"source": "shapes-small-cnn", "file": str(champion), "sha256": summary["weights"]["sha256"]}
    (checkpoint,) = (storage / "runs" / "tuned").glob("checkpoint_epoch-*")
    assert torch.load(checkpoint / "extra_state.pt", weights_only=True)["weights"] == summary["weights"]
    assert accuracy["tuned"] > accuracy["scratch"] + 0.1
