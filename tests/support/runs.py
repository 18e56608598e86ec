"""Training outputs without training: a seed-style ResNet-18 and a run folder with checkpoints, raw files and a dataset."""

from __future__ import annotations

from pathlib import Path

import torch

from dataset.formats.parquet import ParquetDataset
from dataset.sources.interface import RawData
from storage_io import StorageLayout
from tasks.manifests import Evaluation
from training.checkpoint.files import MODEL_FILE, SEEDS_MODEL
from training.manifests import CheckpointInfo, TrainedModel


def torchvision_resnet18_seed_style():
    """The one-channel torchvision ResNet-18 the seed code builds, to load our checkpoints with."""
    from torchvision.models import resnet18

    model = resnet18(num_classes=10)
    model.conv1 = torch.nn.Conv2d(1, 64, kernel_size=(7, 7), stride=(2, 2), padding=(3, 3), bias=False)
    return model


def build_run_tree(tmp_path: Path) -> tuple[StorageLayout, RawData, ParquetDataset, TrainedModel, Evaluation]:
    """Run ``run`` under ``tmp_path/root``: three checkpoints (epoch 1 the best and evaluated), raw files, a dataset."""
    layout = StorageLayout.create(str(tmp_path / "root"), "run")
    ckpts = []
    for epoch, acc in enumerate([0.90, 0.97, 0.95]):
        path = Path(layout.run_dir) / f"checkpoint_{epoch}"
        path.mkdir(parents=True)
        (path / MODEL_FILE).write_bytes(b"x" * 10)
        ckpts.append(CheckpointInfo(path=str(path), epoch=epoch, val_accuracy=acc))
    raw = Path(layout.raw_dir("sample"))
    raw.mkdir(parents=True)
    (raw / "f.gz").write_bytes(b"y" * 5)
    data = Path(layout.dataset_dir("abc"))
    data.mkdir(parents=True)
    (data / "part.parquet").write_bytes(b"z" * 7)
    trained = TrainedModel(
        run_dir=layout.run_dir, model=SEEDS_MODEL, best_checkpoint=ckpts[1].path, best_val_accuracy=0.97,
        checkpoints=ckpts, history=[], num_workers=1, cpus_per_worker=1.0,
    )
    evaluation = Evaluation(
        checkpoint=ckpts[1].path, accuracy=0.9, precision=[], recall=[], confusion=[], rows=1,
        metrics_path="m", predictions_path="p", passed_gate=True,
    )
    raw_data = RawData(source="sample", url="file:///x/", directory=str(raw), files={}, skipped=False)
    dataset = ParquetDataset(directory=str(data), fingerprint="abc", rows={})
    return layout, raw_data, dataset, trained, evaluation
