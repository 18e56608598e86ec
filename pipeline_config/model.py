"""The pipeline's one configuration model: a sub-model per stage, a description on every field.

`PipelineConfig` is the flow's parameter set, so the Prefect UI renders it as a typed form and
validates runs started there exactly as the CLI does. Validation here is the preflight: it
runs before any stage, names the field, says how to fix it, and creates or deletes nothing.

The sections live beside it, one file a concern: `common` (the section base, name rules), `data` (download,
Parquet), `transform`, `sources` (the download.source choices), `learning` (model, train), `evaluation` (evaluate,
promote, cleanup) and `tune` (the search's sections and `TunePipelineConfig`); `ModelConfig` (which network, its weights) and `RayConfig` are here.
"""

from __future__ import annotations

import os
import re
import unicodedata
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from pydantic import Field, field_validator, model_validator

from pipeline_config.common import (
    DEFAULT_WORKLOAD,
    MODEL_REF_PATTERN,
    RUN_NAME_PATTERN,
    S3_BUCKET_PATTERN,
    WORKLOAD_PATTERN,
    Section,
    no_control_characters,
)
from pipeline_config.data import DownloadConfig, ParquetConfig
from pipeline_config.evaluation import CleanupConfig, EvaluateConfig, PromoteConfig
from pipeline_config.learning import TrainConfig
from pipeline_config.sources import PATH_SOURCES
from pipeline_config.tracking import TrackingConfig
from pipeline_config.transform import TransformConfig


class ModelConfig(Section):
    """Which network is trained, evaluated and promoted (training.model.catalog builds it)."""

    name: str = Field(
        "resnet18",
        description=(
            "resnet18 (the seeds' model), any torchvision classification model by name (e.g. mobilenet_v3_small; "
            "built without weights, first layer and head fitted to the data), or your own function as "
            "package.module:function, called with in_channels= and num_classes= and returning a torch.nn.Module "
            "(importable on every Ray worker). training.model.catalog:small_cnn is a small CNN for quick runs. A run started "
            "from a deployment imports only modules the server allows (PIPELINE_MODEL_MODULES); every run tries the "
            "model on the data's shape before any work."
        ),
    )

    weights: str | None = Field(
        None,
        description=(
            "Start training from weights you have instead of random ones (a fresh start only; a resumed run goes on "
            "from its checkpoint): a state dict file, local or s3:// (torchvision's .pth files as they come, or a "
            "run's model.pt or its folder), or another workload's champion by its registry name (e.g. "
            "shapes-resnet18). Tensors whose shape does not fit the data (the first layer for other channels, the "
            "head for other classes) start fresh; the log names them. Loaded with weights_only=True."
        ),
        max_length=1024,
    )

    @field_validator("weights")
    @classmethod
    def _check_weights(cls, value: str | None) -> str | None:
        if value is None:
            return None
        no_control_characters(value, "model.weights")
        value = value.strip()
        scheme, found, rest = value.partition("://")
        if found and scheme != "s3":
            raise ValueError(f"model.weights {scheme}://...: give a local path, an s3:// URI or a registry model's name")
        if found and ("@" in rest.split("/", 1)[0] or "?" in rest or "#" in rest):
            raise ValueError(
                "model.weights holds credentials (user:password@) or a ?query/#fragment: give s3://bucket/key alone "
                "(S3 credentials come from the AWS_* environment variables, never from here)"
            )
        return value or None

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        no_control_characters(value, "model.name")
        value = value.strip()
        if not MODEL_REF_PATTERN.fullmatch(value):
            raise ValueError(
                f"{value!r}: use resnet18, a torchvision model's name (e.g. mobilenet_v3_small) or package.module:function"
            )
        return value


class RayConfig(Section):
    """Which Ray cluster runs the stages."""

    address: str | None = Field(
        None,
        description="Unset: start a local Ray for the run. 'auto', 'host:port' or 'ray://host:10001': connect to that cluster.",
    )
    num_cpus: int | None = Field(
        None, ge=1, le=4096, description="CPUs of the local Ray started when address is unset (default: all)."
    )
    metrics_export_port: int | None = Field(
        None, ge=1024, le=65535,
        description="Port where the local Ray started when address is unset serves Prometheus metrics, Ray's and the "
                    "pipeline's (docs/operations.md, Metrics). Unset: a port Ray picks, listed in "
                    "/tmp/ray/prom_metrics_service_discovery.json.",
    )
    log_to_driver: bool = Field(
        False,
        description=(
            "Mirror every Ray worker's output (Ray Data execution plans, Ray Train, the stages' own logs) into the "
            "terminal of the process running the flow. Off: that terminal shows stage and epoch lines and warnings; "
            "the Prefect UI has every stage log either way. The CLI's --verbose turns it on."
        ),
    )

    @field_validator("address")
    @classmethod
    def _check_address(cls, value: str | None) -> str | None:
        if value is None or value == "auto":
            return value
        no_control_characters(value, "ray.address")
        parsed = urlparse(value if "://" in value else f"tcp://{value}")
        try:
            port = parsed.port
        except ValueError:
            port = None
        if parsed.scheme not in {"ray", "tcp"} or not parsed.hostname or port is None or parsed.path not in {"", "/"}:
            raise ValueError(
                f"cannot parse Ray address {value!r}: use 'auto', 'host:port' or 'ray://host:10001', or leave it unset"
            )
        return value


class PipelineConfig(Section):
    """An image classifier (ResNet-18 on MNIST by default): download, Parquet, Ray Data transform, Ray Train, evaluation, cleanup."""

    workload: str = Field(
        DEFAULT_WORKLOAD,
        description=(
            "What this pipeline trains, as a name: it starts the default run names (<workload>-<time>-<id>), the Prefect "
            "artifact keys (<workload>-test-metrics, ...) and the registry's model name (<workload>-<model>). "
            "Lowercase letters, digits and '-'. mnist keeps the names MNIST runs always had. With "
            "download.source=folder or parquet, unset or mnist: the folder's name (my-images for download.path data/my-images)."
        ),
    )
    run_name: str | None = Field(
        None,
        description="Names the run folder <storage_root>/runs/<run_name>; reuse a name to resume that run. Unset: a timestamped name.",
    )
    storage_root: str = Field(
        "storage",
        description=(
            "Folder every Ray node can reach (local disk, NFS mount) or an S3 prefix s3://bucket/prefix "
            "(endpoint, region and credentials from the AWS_* environment variables, never from here); "
            "every artifact lives below it."
        ),
    )
    download: DownloadConfig = Field(default_factory=DownloadConfig, description="Download stage.")
    parquet: ParquetConfig = Field(default_factory=ParquetConfig, description="Parquet conversion stage.")
    transform: TransformConfig = Field(default_factory=TransformConfig, description="Ray Data transform stage.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="The network (model.name).")
    train: TrainConfig = Field(default_factory=TrainConfig, description="Training stage.")
    evaluate: EvaluateConfig = Field(default_factory=EvaluateConfig, description="Evaluation stage.")
    promote: PromoteConfig = Field(default_factory=PromoteConfig, description="Champion promotion stage.")
    cleanup: CleanupConfig = Field(default_factory=CleanupConfig, description="Cleanup stage.")
    tracking: TrackingConfig = Field(
        default_factory=TrackingConfig, description="Experiment tracking in MLflow (off unless MLFLOW_TRACKING_URI is set)."
    )
    ray: RayConfig = Field(default_factory=RayConfig, description="Ray cluster.")

    @model_validator(mode="before")
    @classmethod
    def _workload_from_folder(cls, data: Any) -> Any:
        """download.source=folder or parquet with workload unset or mnist (the default, what the Prefect form
        starts with): the folder's name, so such a run never takes MNIST's datasets, artifacts or champion."""
        if not isinstance(data, dict) or data.get("workload") not in (None, DEFAULT_WORKLOAD):
            return data
        download = data.get("download")
        source, path = (download.get("source"), download.get("path")) if isinstance(download, dict) else (
            getattr(download, "source", None), getattr(download, "path", None))
        if source not in PATH_SOURCES or not isinstance(path, str) or not path.strip():
            return data
        name = folder_workload(path)
        if not name:
            raise ValueError(
                f"download.path {path!r}: its folder's name cannot name the workload (lowercase letters, digits and '-'); "
                "set --workload <name> (workload: in a config file), e.g. --workload flowers"
            )
        return {**data, "workload": name}

    @field_validator("workload")
    @classmethod
    def _check_workload(cls, value: str) -> str:
        no_control_characters(value, "workload")
        if not WORKLOAD_PATTERN.fullmatch(value):
            raise ValueError(
                f"workload {value!r}: use lowercase letters, digits and '-', starting with a letter or digit (at most 40), "
                "e.g. mnist or flowers-rgb"
            )
        return value

    @property
    def registry_name(self) -> str:
        """The registry's name of the model this run trains: promote.model_name, or <workload>-<model>."""
        return self.promote.registry_name(self.workload, self.model.name)

    @field_validator("run_name")
    @classmethod
    def _check_run_name(cls, value: str | None) -> str | None:
        if value is None:
            return value
        no_control_characters(value, "run_name")
        if "/" in value or "\\" in value or ".." in value:
            raise ValueError(f"{value!r} may not contain '/', '\\' or '..': it names one folder under runs/")
        if not RUN_NAME_PATTERN.fullmatch(value):
            raise ValueError(f"{value!r}: use letters, digits, '-', '_' and '.', starting with a letter or digit")
        return value

    @field_validator("storage_root")
    @classmethod
    def _check_storage_root(cls, value: str) -> str:
        no_control_characters(value, "storage_root")
        if not value.strip():
            raise ValueError("storage_root is empty; use a folder path or s3://bucket/prefix")
        if value.startswith("s3://"):
            bucket, _, prefix = value[len("s3://") :].partition("/")
            if not S3_BUCKET_PATTERN.fullmatch(bucket):
                raise ValueError(f"{value!r}: {bucket!r} is not an S3 bucket name; use s3://bucket/prefix")
            if ".." in prefix.split("/") or "//" in prefix.rstrip("/"):
                raise ValueError(f"{value!r}: the prefix may not contain '..' or empty parts; use s3://bucket/prefix")
            return value
        if "://" in value:
            raise ValueError(f"{value!r}: use a folder path or s3://bucket/prefix (no other URL scheme is supported)")
        path = Path(value).expanduser().absolute()
        probe = path
        while not probe.exists():  # the nearest existing ancestor decides whether we may create it
            probe = probe.parent
        if not probe.is_dir():
            raise ValueError(f"{path} is not a folder ({probe} is a file); pick another storage_root")
        if not os.access(probe, os.W_OK | os.X_OK):
            raise ValueError(f"{probe} is not writable; pick a storage_root you can write to")
        return value  # made absolute when the run starts, not when the default is built at import

    @model_validator(mode="after")
    def _check_batch(self) -> PipelineConfig:
        if self.train.global_batch_size < self.train.num_workers:
            raise ValueError(
                f"train.global_batch_size ({self.train.global_batch_size}) is smaller than train.num_workers "
                f"({self.train.num_workers}): every worker needs at least one image per step; raise the batch or lower the workers"
            )
        if self.train.min_workers is not None and self.train.min_workers > self.train.num_workers:
            raise ValueError(
                f"train.min_workers ({self.train.min_workers}) is larger than train.num_workers ({self.train.num_workers}): "
                "the elastic range is min_workers..num_workers; lower min_workers or raise num_workers"
            )
        if self.train.strategy == "fsdp" and self.train.ema_decay > 0:
            raise ValueError(
                "train.strategy=fsdp shards the weights, which the weight EMA cannot follow; set train.ema_decay=0 with fsdp"
            )
        if self.storage_root.startswith("s3://") and self.train.mode == "single":
            raise ValueError(
                "train.mode=single keeps its checkpoints in a local folder and cannot use an s3:// storage_root; "
                "use train.mode=distributed or a local storage_root"
            )
        if self.transform.cpus_per_task > self.train.data_cpus:
            raise ValueError(
                f"transform.cpus_per_task ({self.transform.cpus_per_task}) exceeds train.data_cpus "
                f"({self.train.data_cpus}): Ray Data tasks could never run beside training; lower one or raise the other"
            )
        return self


def folder_workload(path: str) -> str:
    """The workload an image folder's name makes (``data/My Images/`` -> ``my-images``, ``s3://b/flowers`` ->
    ``flowers``): ASCII lowercase letters and digits, other runs of characters a '-', at most 40; "" when none is left."""
    if path.startswith("s3://"):
        name = path[len("s3://") :].rstrip("/").rsplit("/", 1)[-1]
    else:
        name = os.path.basename(os.path.normpath(os.path.abspath(os.path.expanduser(path))))
    ascii_name = unicodedata.normalize("NFKD", name).encode("ascii", "ignore").decode()
    return re.sub(r"[^a-z0-9]+", "-", ascii_name.lower()).strip("-")[:40].rstrip("-")
