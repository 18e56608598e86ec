"""Pure parts of training, evaluation and cleanup, on tiny inputs (no Ray, no Prefect API)."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline_config import CleanupConfig, TrainConfig
from storage_io import publish_dir, staging_dir
from tasks.cleanup import check_deletable, cleanup, plan
from tests.support.runs import torchvision_resnet18_seed_style
from training.checkpoint.files import CHECKSUMS_FILE, MODEL_FILE, IntegrityError
from training.checkpoint.model_files import build_resnet18, load_model, save_checkpoint_files
from training.checkpoint.records import read_history, record_epoch
from training.inference import TTA_SHIFTS, Predictor, actor_resources, confusion_matrix, metrics_from_confusion, shifted
from training.manifests import CheckpointInfo
from training.resources import plan_resources
from training.worker.recipe import one_cycle_lr


def test_one_cycle_schedule_warms_up_peaks_and_decays():
    lrs = [one_cycle_lr(p / 100, peak=1.0) for p in range(101)]
    assert lrs[0] == pytest.approx(1e-3)
    assert max(lrs) == pytest.approx(1.0) and lrs.index(max(lrs)) == 20
    assert all(a <= b for a, b in zip(lrs[:21], lrs[1:21]))  # rises during warm-up
    assert all(a >= b for a, b in zip(lrs[20:], lrs[21:]))  # then only falls
    assert lrs[-1] == pytest.approx(1e-3)
    assert one_cycle_lr(1.7, 1.0) == lrs[-1]  # clamped past the end (a resumed run cannot overshoot)


def test_resource_plan_leaves_cpus_for_ray_data():
    use_gpu, cpus, threads = plan_resources(TrainConfig(num_workers=2), cluster_cpus=2, cluster_gpus=0)
    assert (use_gpu, cpus, threads) == (False, 0.5, 1)  # 2 x 0.5 + 1 free for data = 2
    assert plan_resources(TrainConfig(num_workers=1), 2, 0)[1:] == (1.0, 2)
    assert plan_resources(TrainConfig(num_workers=1, use_gpu="auto"), 8, 1)[0] is True
    with pytest.raises(ValueError, match="too few"):
        plan_resources(TrainConfig(num_workers=2), cluster_cpus=1, cluster_gpus=0)
    with pytest.raises(ValueError, match="FSDP does not run on CPU"):
        plan_resources(TrainConfig(num_workers=1, strategy="fsdp", ema_decay=0), 2, 0)
    with pytest.raises(ValueError, match="needs 2 GPUs"):
        plan_resources(TrainConfig(num_workers=2, use_gpu="always"), 8, 1)


def test_actor_plan_leaves_a_cpu_for_the_reads_feeding_it():
    assert actor_resources(2, 1) == (1.0, 2)
    assert actor_resources(2, 2) == (0.5, 1)
    assert actor_resources(1, 4)[0] == 0.25


def test_metrics_from_a_known_confusion_matrix():
    labels = np.array([0, 0, 1, 1, 2, 2])
    preds = np.array([0, 1, 1, 1, 2, 0])
    confusion = confusion_matrix(labels, preds, num_classes=3)
    assert confusion.tolist() == [[1, 1, 0], [0, 2, 0], [1, 0, 1]]
    scores = metrics_from_confusion(confusion)
    assert scores["accuracy"] == pytest.approx(4 / 6)
    assert scores["precision"] == pytest.approx([0.5, 2 / 3, 1.0], abs=1e-5)
    assert scores["recall"] == pytest.approx([0.5, 1.0, 0.5], abs=1e-5)


def test_checkpoint_files_load_into_a_plain_seed_style_resnet(tmp_path):
    model = build_resnet18()
    wrapped = torch.nn.Sequential()  # stands in for DDP's `.module` attribute
    wrapped.module = model
    optimizer = torch.optim.AdamW(model.parameters())
    save_checkpoint_files(tmp_path, wrapped, optimizer, {"epoch": 3})
    state = torch.load(tmp_path / MODEL_FILE, weights_only=True)
    assert not any(key.startswith("module.") for key in state)
    plain = torchvision_resnet18_seed_style()
    plain.load_state_dict(state)  # the seeds' own restore code works on our checkpoints
    assert torch.load(tmp_path / "extra_state.pt", weights_only=True)["epoch"] == 3
    predictor = Predictor(str(tmp_path))
    x = np.random.default_rng(0).standard_normal((4, 1, 28, 28)).astype(np.float32)
    out = predictor({"image": x, "label": np.zeros(4, dtype=np.int64), "row_id": np.arange(4)})
    expected = plain.eval()(torch.from_numpy(x)).argmax(1).numpy()
    np.testing.assert_array_equal(out["pred"], expected)


def test_shifted_moves_content_and_repeats_the_edge_pixels():
    image = torch.full((1, 1, 28, 28), -1.0)
    image[0, 0, 10, 20] = 1.0
    down = shifted(image, 1, 0)
    assert down[0, 0, 11, 20] == 1.0 and down[0, 0, 10, 20] == -1.0
    left = shifted(image, 0, -1)
    assert left[0, 0, 10, 19] == 1.0 and left.shape == image.shape
    edge = torch.zeros((1, 3, 28, 28))
    edge[:, :, :, 0] = torch.tensor([0.2, 0.4, 0.6]).view(1, 3, 1)  # a coloured left edge, per channel
    moved = shifted(edge, 0, 1)
    assert torch.equal(moved[0, :, :, 0], edge[0, :, :, 0]) and torch.equal(moved[0, :, :, 1], edge[0, :, :, 0])
    assert (moved[0, :, :, 2:] == 0.0).all()


def test_predictor_averages_softmax_over_shifts_and_reports_the_plain_prediction(tmp_path):
    model = build_resnet18()
    save_checkpoint_files(tmp_path, model, torch.optim.AdamW(model.parameters()), {"epoch": 0})
    x = np.random.default_rng(1).standard_normal((6, 1, 28, 28)).astype(np.float32)
    batch = {"image": x, "label": np.zeros(6, dtype=np.int64), "row_id": np.arange(6)}
    plain = Predictor(str(tmp_path))(batch)
    np.testing.assert_array_equal(plain["pred"], plain["pred_plain"])
    tta = Predictor(str(tmp_path), tta=True)(batch)
    model = Predictor(str(tmp_path)).model
    with torch.no_grad():
        images = torch.from_numpy(x)
        probs = sum(model(shifted(images, dy, dx)).softmax(1) for dy, dx in TTA_SHIFTS) / len(TTA_SHIFTS)
    np.testing.assert_array_equal(tta["pred"], probs.argmax(1).numpy())
    np.testing.assert_array_equal(tta["pred_plain"], plain["pred_plain"])


def test_checkpoint_of_another_architecture_is_refused(tmp_path):
    from torchvision.models import resnet18

    other = resnet18(num_classes=10)  # 3-channel stem
    save_checkpoint_files(tmp_path, other, torch.optim.AdamW(other.parameters()), {"epoch": 0})
    with pytest.raises(ValueError, match="does not hold a model.name=resnet18 with 1 input channel"):
        load_model(tmp_path)


def test_tampered_or_unverifiable_checkpoint_is_refused_naming_the_file(tmp_path):
    model = build_resnet18()
    save_checkpoint_files(tmp_path, model, torch.optim.AdamW(model.parameters()), {"epoch": 0})
    load_model(tmp_path)  # intact: loads
    original = (tmp_path / MODEL_FILE).read_bytes()
    (tmp_path / MODEL_FILE).write_bytes(original[:-100])  # truncated
    with pytest.raises(IntegrityError, match=f"{tmp_path / MODEL_FILE} does not match its sha256"):
        load_model(tmp_path)
    tampered = bytearray(original)
    tampered[len(tampered) // 2] ^= 0xFF
    (tmp_path / MODEL_FILE).write_bytes(bytes(tampered))  # same size, one byte changed
    with pytest.raises(IntegrityError, match="modified or truncated"):
        load_model(tmp_path)
    (tmp_path / MODEL_FILE).write_bytes(original)
    (tmp_path / CHECKSUMS_FILE).unlink()
    with pytest.raises(IntegrityError, match="_checksums.json is missing"):
        load_model(tmp_path)


def test_publish_replaces_a_stale_folder_in_one_step(tmp_path):
    final = tmp_path / "dataset"
    final.mkdir()
    (final / "stale").write_text("old")
    staging = staging_dir(final)
    (staging / "fresh").write_text("new")
    publish_dir(staging, final)
    assert sorted(p.name for p in final.iterdir()) == ["fresh"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dataset"]


# --- cleanup (the run_tree fixture is in tests/conftest.py) --------------------------------


def test_cleanup_keeps_the_best_and_the_evaluated_checkpoint(run_tree):
    layout, raw, dataset, trained, evaluation = run_tree
    cfg = CleanupConfig(keep_checkpoints=1, delete_raw=True)
    dry = cleanup.fn(cfg.model_copy(update={"dry_run": True}), raw, dataset, trained, evaluation, layout)
    assert all(__import__("os").path.exists(p) for p in dry.paths)  # a dry run deletes nothing
    real = cleanup.fn(cfg, raw, dataset, trained, evaluation, layout)
    assert real.paths == dry.paths and real.bytes == dry.bytes == 10 + 10 + 5  # dry run listed exactly this
    remaining = sorted(p.name for p in Path(layout.run_dir).iterdir() if p.name.startswith("checkpoint_"))
    assert remaining == ["checkpoint_1"]  # best (and evaluated) stays
    assert not Path(layout.raw_dir("sample")).exists()
    assert Path(layout.dataset_dir("abc")).exists()


def test_cleanup_keep_zero_keeps_everything(run_tree):
    layout, raw, dataset, trained, evaluation = run_tree
    assert plan(CleanupConfig(), raw, dataset, trained, evaluation) == []


def test_cleanup_refuses_paths_outside_the_root_and_symlinks(run_tree, tmp_path):
    layout, raw, dataset, trained, evaluation = run_tree
    outside = tmp_path / "precious"
    outside.mkdir()
    with pytest.raises(ValueError, match="outside the storage root"):
        check_deletable(outside, layout, [])
    with pytest.raises(ValueError, match="outside the storage root"):
        check_deletable(Path(layout.root) / ".." / "precious", layout, [])
    link = Path(layout.root) / "link"
    link.symlink_to(outside)
    with pytest.raises(ValueError, match="symbolic link"):
        check_deletable(link, layout, [])
    with pytest.raises(ValueError, match="which the evaluation used"):
        check_deletable(layout.run_dir, layout, [str(Path(layout.run_dir) / "checkpoint_1")])
    escaping = raw.model_copy(update={"directory": str(outside)})
    with pytest.raises(ValueError, match="outside the storage root"):
        cleanup.fn(CleanupConfig(delete_raw=True, delete_parquet=True), escaping, dataset, trained, evaluation, layout)
    assert outside.exists() and Path(layout.dataset_dir("abc")).exists()  # refused before deleting anything


def test_ema_warms_up_then_tracks_the_weights_slowly():
    from training.worker.recipe import ema_decay_at, make_ema

    assert ema_decay_at(0.99, 0) == pytest.approx(0.1)  # early: mostly the current weights
    assert ema_decay_at(0.99, 10_000) == 0.99
    model = torch.nn.Linear(2, 1, bias=False)
    ema = make_ema(model, 0.99)
    with torch.no_grad():
        model.weight.fill_(0.0)
    ema.update_parameters(model)  # first update copies
    with torch.no_grad():
        model.weight.fill_(1.0)
    ema.update_parameters(model)
    assert ema.module.weight.detach().flatten().tolist() == pytest.approx([1 - ema_decay_at(0.99, 1)] * 2)
    assert make_ema(model, 0.0) is None


def test_ema_averages_batchnorm_buffers_including_the_integer_counter():
    from training.worker.recipe import ema_decay_at, make_ema

    model = torch.nn.BatchNorm1d(3)
    ema = make_ema(model, 0.99)
    ema.update_parameters(model)  # copies: mean 0, counter 0
    with torch.no_grad():
        model.running_mean.fill_(2.0)
        model.num_batches_tracked.fill_(50)
    ema.update_parameters(model)
    d = ema_decay_at(0.99, 1)
    assert ema.module.running_mean.tolist() == pytest.approx([2.0 * (1 - d)] * 3)
    assert ema.module.num_batches_tracked.dtype == torch.int64 and int(ema.module.num_batches_tracked) == int(50 * (1 - d))


def test_the_fused_adamw_stays_fused_after_loading_a_state_written_by_the_default_one():
    from training.checkpoint.in_attempt import load_optimizer_state
    from training.worker.recipe import make_optimizer

    torch.manual_seed(0)
    old_model, model = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)
    model.load_state_dict(old_model.state_dict())
    old = torch.optim.AdamW(old_model.parameters(), lr=0.1, weight_decay=0.01)  # as checkpoints before the fused one
    old_model(torch.ones(1, 4)).sum().backward()
    old.step()
    fused = make_optimizer(model, 0.1, 0.01)
    assert fused.param_groups[0]["fused"] is True
    load_optimizer_state(fused, copy.deepcopy(old.state_dict()))  # as torch.load gives it: no tensor shared
    assert fused.param_groups[0]["fused"] is True and fused.param_groups[0]["foreach"] is None
    assert fused.state_dict()["state"][0]["exp_avg"].tolist() == old.state_dict()["state"][0]["exp_avg"].tolist()
    model.load_state_dict(old_model.state_dict())
    for m, o in ((model, fused), (old_model, old)):  # the same next step from the same state
        o.zero_grad()
        m(torch.ones(1, 4)).sum().backward()
        o.step()
    assert torch.allclose(model.weight, old_model.weight, atol=1e-6) and int(fused.state[model.weight]["step"]) == 2


def test_checkpoint_rank_follows_the_configured_score():
    from training.manifests import checkpoint_rank

    early = CheckpointInfo(path="a", epoch=3, val_accuracy=1.0, val_loss=0.60)
    late = CheckpointInfo(path="b", epoch=9, val_accuracy=0.995, val_loss=0.51)
    tie = CheckpointInfo(path="c", epoch=12, val_accuracy=1.0, val_loss=0.55)
    pick = lambda score: max([early, late, tie], key=lambda c: checkpoint_rank(c, score)).path  # noqa: E731
    assert pick("val_loss") == "b"
    assert pick("val_accuracy") == "c"  # ties go to the later epoch


def test_epoch_history_keeps_every_epoch_and_a_rerun_replaces_the_rest(tmp_path):
    path = tmp_path / "history.jsonl"
    assert read_history(path) == []
    for epoch in range(3):
        record_epoch(path, {"epoch": epoch, "val_accuracy": 0.5 + epoch / 10})
    # A restart from the epoch-1 checkpoint reruns epoch 1: it replaces epochs 1 and 2.
    rows = record_epoch(path, {"epoch": 1, "val_accuracy": 0.9})
    assert rows == read_history(path) == [{"epoch": 0, "val_accuracy": 0.5}, {"epoch": 1, "val_accuracy": 0.9}]
