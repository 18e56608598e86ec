"""``train.mode: single``: the training stage in one process without Ray Train, on a real local Ray.

Real Parquet, the real Ray Data pipeline and real training steps on a tiny synthetic dataset, on
the small model (``training.model.catalog:small_cnn``): the kept set follows ``num_to_keep``, the
checkpoints record the model and model.pt loads back into it (strict, no wrapper prefix), and a
second call with more epochs resumes from the latest checkpoint. The seeds' contract (a ResNet-18
model.pt loads into a plain ResNet-18 built the seeds' way) is checked on the default recipe's run
(tests/test_default_recipe.py); single mode saves through the same `save_checkpoint_files`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dataset.sources.interface import RawData
from pipeline_config import ModelConfig, ParquetConfig, TrainConfig, TransformConfig
from storage_io import StorageLayout
from tasks.to_parquet import to_parquet
from tasks.train import train
from tasks.transform import transform
from tests.support.digits import write_raw
from tests.support.models import SMALL_MODEL
from training.checkpoint.files import EXTRA_STATE_FILE, MODEL_FILE
from training.checkpoint.model_files import checkpoint_model, load_model, load_state
from training.model.catalog import ModelSpec


def transformed(tmp_path: Path, run_name: str):
    """(layout, transform spec) of a run on 100 synthetic training and 20 test digits."""
    layout = StorageLayout.create(str(tmp_path / "storage"), run_name)
    raw = RawData(**write_raw(tmp_path / "raw", n_train=100, n_test=20))
    dataset = to_parquet.fn(raw, ParquetConfig(rows_per_file=64, rows_per_group=64, validation_every=5), layout)
    return layout, transform.fn(dataset, TransformConfig(), layout)


def test_single_process_mode_trains_keeps_the_best_and_resumes(tmp_path, local_ray):
    layout, spec = transformed(tmp_path, "single")
    cfg = TrainConfig(mode="single", epochs=2, global_batch_size=32, num_to_keep=1, checkpoint_score="val_loss")
    small = ModelConfig(name=SMALL_MODEL)

    first = train.fn(spec, cfg, layout, model=small)
    assert first.model == ModelSpec(name=SMALL_MODEL, in_channels=1, num_classes=10)
    assert [a["start_epoch"] for a in first.attempts] == [0] and first.num_workers == 1
    assert [row["epoch"] for row in first.history] == [0, 1]
    # num_to_keep=1: the best by validation loss stays, and the latest when it is not the best.
    best_epoch = min(first.history, key=lambda row: row["val_loss"])["epoch"]
    assert sorted(c.epoch for c in first.checkpoints) == sorted({best_epoch, 1})
    assert Path(first.best_checkpoint).name == f"checkpoint_epoch_{best_epoch:04d}"
    assert Path(first.best_checkpoint).is_relative_to(layout.run_dir)

    # The checkpoint records the model it holds; load_model rebuilds it from that and loads model.pt strictly
    assert checkpoint_model(first.best_checkpoint) == first.model
    model = load_model(first.best_checkpoint)
    weights = torch.load(Path(first.best_checkpoint) / MODEL_FILE, weights_only=True)
    assert weights.keys() == model.state_dict().keys()
    assert load_state(first.best_checkpoint, EXTRA_STATE_FILE)["epoch"] == best_epoch

    second = train.fn(spec, cfg.model_copy(update={"epochs": 3}), layout, model=small)  # resumes after epoch 1
    assert [a["start_epoch"] for a in second.attempts] == [0, 2] and second.resumed_from_epoch == 2
    assert [row["epoch"] for row in second.history] == [0, 1, 2]
    assert max(c.epoch for c in second.checkpoints) == 2
    assert second.model == first.model

