"""Benchmarks of the pipeline against plain baselines (``python -m benchmarks.run``).

Every row trains the model that ``PIPELINE_MODEL__NAME`` names, ours and the baselines alike, as the
pipeline reads that variable (default ``resnet18``, the seeds' model); ``--quick`` sets the small
CNN, since the quick mode only proves that every row is produced.
"""

from __future__ import annotations

import os

MODEL_ENV = "PIPELINE_MODEL__NAME"


def model_name() -> str:
    """The model every benchmark trains: ``PIPELINE_MODEL__NAME``, default resnet18."""
    return os.environ.get(MODEL_ENV, "resnet18")


def build_model():
    """A fresh `model_name` network for the digits (one channel, ten classes), as the pipeline builds it."""
    from training.checkpoint.files import SEEDS_MODEL
    from training.model.catalog import build_model as build

    return build(model_name(), in_channels=SEEDS_MODEL.in_channels, num_classes=SEEDS_MODEL.num_classes)
