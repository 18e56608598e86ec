"""Configuration: one pydantic model (the flow's parameters) and the loader that fills it."""

from pipeline_config.model import (
    DEFAULT_WORKLOAD,
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
    registry_model_name,
)
from pipeline_config.settings import PRESETS, PipelineSettings, load_preset

__all__ = [
    "DEFAULT_WORKLOAD",
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
    "registry_model_name",
]
