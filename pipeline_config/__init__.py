"""Configuration: one pydantic model (the flow's parameters) and the loader that fills it."""

from pipeline_config.model import (
    CleanupConfig,
    DownloadConfig,
    EvaluateConfig,
    ModelConfig,
    ParquetConfig,
    PipelineConfig,
    PromoteConfig,
    Range,
    RayConfig,
    SearchSpace,
    TrainConfig,
    TransformConfig,
    TuneConfig,
    TunePipelineConfig,
)
from pipeline_config.settings import PRESETS, PipelineSettings, load_preset

__all__ = [
    "PRESETS",
    "CleanupConfig",
    "DownloadConfig",
    "EvaluateConfig",
    "ModelConfig",
    "ParquetConfig",
    "PipelineConfig",
    "PipelineSettings",
    "PromoteConfig",
    "Range",
    "RayConfig",
    "SearchSpace",
    "TrainConfig",
    "TransformConfig",
    "TuneConfig",
    "TunePipelineConfig",
    "load_preset",
]
