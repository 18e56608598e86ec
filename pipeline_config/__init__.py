"""Configuration: one pydantic model (the flow's parameters) and the loader that fills it."""

from pipeline_config.common import DEFAULT_WORKLOAD, registry_model_name
from pipeline_config.data import DownloadConfig, ParquetConfig
from pipeline_config.evaluation import CleanupConfig, EvaluateConfig, PromoteConfig
from pipeline_config.learning import TrainConfig
from pipeline_config.model import ModelConfig, PipelineConfig, RayConfig
from pipeline_config.settings import PRESETS, PipelineSettings, load_preset
from pipeline_config.tracking import TrackingConfig
from pipeline_config.transform import TransformConfig
from pipeline_config.tune import Range, SearchSpace, TuneConfig, TunePipelineConfig

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
    "TrackingConfig",
    "TrainConfig",
    "TransformConfig",
    "TuneConfig",
    "TunePipelineConfig",
    "load_preset",
    "registry_model_name",
]
