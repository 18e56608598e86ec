"""``train.mode: single``: the training stage in one process without Ray Train, on a real local Ray.

Real Parquet, the real Ray Data pipeline and real training steps on a tiny synthetic dataset:
the stage's checkpoints load into a plain ResNet-18 built the seeds' way, the kept set follows
``num_to_keep``, and a second call with more epochs resumes from the latest checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dataset.sources import RawData
from pipeline_config import ParquetConfig, TrainConfig, TransformConfig
from storage_io import StorageLayout
from tasks.to_parquet import to_parquet
from tasks.train import train
from tasks.transform import transform
from tests.support.digits import write_raw
from training.model import EXTRA_STATE_FILE, MODEL_FILE, build_resnet18, load_state


def test_single_process_mode_trains_keeps_the_best_and_resumes(tmp_path, local_ray):
    layout = StorageLayout.create(str(tmp_path / "storage"), "single")
    raw = RawData(**write_raw(tmp_path / "raw", n_train=100, n_test=20))
    dataset = to_parquet.fn(raw, ParquetConfig(rows_per_file=64, rows_per_group=64, validation_every=5), layout)
    spec = transform.fn(dataset, TransformConfig(), layout)
    cfg = TrainConfig(mode="single", epochs=2, global_batch_size=32, num_to_keep=1, checkpoint_score="val_loss")

    first = train.fn(spec, cfg, layout)
    assert [a["start_epoch"] for a in first.attempts] == [0] and first.num_workers == 1
    assert [row["epoch"] for row in first.history] == [0, 1]
    # num_to_keep=1: the best by validation loss stays, and the latest when it is not the best.
    best_epoch = min(first.history, key=lambda row: row["val_loss"])["epoch"]
    assert sorted(c.epoch for c in first.checkpoints) == sorted({best_epoch, 1})
    assert Path(first.best_checkpoint).name == f"checkpoint_epoch_{best_epoch:04d}"
    assert Path(first.best_checkpoint).is_relative_to(layout.run_dir)

    plain = build_resnet18()  # the seeds' restore code: a plain ResNet-18 loads model.pt
    plain.load_state_dict(torch.load(Path(first.best_checkpoint) / MODEL_FILE, weights_only=True))
    assert load_state(first.best_checkpoint, EXTRA_STATE_FILE)["epoch"] == best_epoch

    second = train.fn(spec, cfg.model_copy(update={"epochs": 3}), layout)  # resumes after epoch 1
    assert [a["start_epoch"] for a in second.attempts] == [0, 2] and second.resumed_from_epoch == 2
    assert [row["epoch"] for row in second.history] == [0, 1, 2]
    assert max(c.epoch for c in second.checkpoints) == 2
