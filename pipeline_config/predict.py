"""The settings of `python -m flows.predict`: its flags and ``PIPELINE_PREDICT_*`` variables, and the model it scores by default."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from pipeline_config import DEFAULT_WORKLOAD, ModelConfig, registry_model_name
from pipeline_config.settings import ReadsOldPrefix


class PredictSettings(ReadsOldPrefix, BaseSettings):
    """Score a folder of IDX, Parquet or PNG/JPEG images with a promoted model and write predictions to Parquet."""

    model_config = SettingsConfigDict(
        cli_prog_name="python -m flows.predict", env_prefix="PIPELINE_PREDICT_", cli_kebab_case=True,
        cli_implicit_flags=True, cli_hide_none_type=True, cli_avoid_json=True, extra="forbid",
    )
    old_env_prefix: ClassVar[str] = "MNIST_PREDICT_"  # read below PIPELINE_PREDICT_, named as deprecated

    input: Path = Field(
        description=(
            "Folder of Parquet files (an 'image' column), IDX files (*-images-idx3-ubyte[.gz]) or PNG/JPEG images "
            "(in <class>/ subfolders for accuracy, or directly in the folder, unlabelled)."
        )
    )
    output: str | None = Field(
        None, description="Parquet file to write (local path or s3://); unset: <storage_root>/predictions/<model>-v<N>-<time>.parquet."
    )
    storage_root: str = Field("storage", description="The storage root the model was promoted on (folder or s3://bucket/prefix).")
    workload: str = Field(DEFAULT_WORKLOAD, description="The workload the model was trained on (the runs' workload).")
    model: str | None = Field(
        None,
        description=(
            "The model's registry name (promote.model_name of the runs that trained it, or <workload>-<model.name>: "
            "mnist-small-cnn for training.model.catalog:small_cnn). Unset: <workload>-resnet18, e.g. mnist-resnet18."
        ),
    )
    version: int | None = Field(None, ge=1, description="A published version number; unset: the champion.")
    num_actors: int = Field(1, ge=1, le=256, description="Model actors in the Ray Data inference pool. 1 on one machine without GPUs: no actor, this process scores.")
    batch_rows: int = Field(250, ge=1, le=65536, description="Images per inference batch.")
    ray_address: str | None = Field(None, description="Unset: a local Ray for this command. 'auto' or 'host:port': that cluster.")
    overwrite: bool = Field(False, description="Replace --output when that file exists already (unset: an existing file is refused).")

    def model_name(self) -> str:
        """``--model``, or the name runs of ``--workload`` with the default model register under."""
        return self.model or default_model(self.workload)


def default_model(workload: str = DEFAULT_WORKLOAD) -> str:
    """The registry name runs of ``workload`` with the default ``model.name`` promote to (``mnist-resnet18``)."""
    return registry_model_name(workload, ModelConfig().name)
