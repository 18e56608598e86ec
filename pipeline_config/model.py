"""The pipeline's one configuration model: a sub-model per stage, a description on every field.

`PipelineConfig` is the flow's parameter set, so the Prefect UI renders it as a typed form and
validates runs started there exactly as the CLI does. Validation here is the preflight: it
runs before any stage, names the field, says how to fix it, and creates or deletes nothing.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Literal
from urllib.parse import urlparse

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# The bundled sample (4,000 train / 1,000 test real MNIST digits) ships inside the project as
# IDX .gz files; its checksums are pinned here so it is verified like any other mirror.
SAMPLE_DIR = Path(__file__).resolve().parent.parent / "data" / "mnist-sample"
MNIST_FILES = (
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
)
_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
# model.name: a torchvision model's name or package.module:function (whether it exists is checked
# before any work by training.models.check_name, which imports what it names).
_MODEL_REF = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*(:[A-Za-z_][A-Za-z0-9_]*)?$")
_MODEL_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")  # also part of Prefect artifact keys
# The workload names run folders, Prefect artifact keys and the registry's model: the same rule
# as Prefect's artifact keys, short enough to leave room for what follows it.
DEFAULT_WORKLOAD = "mnist"
_WORKLOAD = re.compile(r"^[a-z0-9][a-z0-9-]{0,39}$")
# S3 bucket naming rules: 3-63 lowercase letters, digits, dots and hyphens, starting and ending alphanumeric.
_S3_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


def _no_control_characters(value: str, what: str) -> None:
    """Names and paths refuse line breaks, tabs, NUL and the other control characters (C0, DEL, C1)."""
    bad = next((c for c in value if ord(c) < 32 or 127 <= ord(c) < 160), None)
    if bad is not None:
        raise ValueError(f"{value!r}: {what} may not contain a line break or another control character ({bad!r})")


def model_slug(model_name: str) -> str:
    """``model.name`` as a name part: ``resnet18``, ``mobilenet-v3-small``, ``small-cnn`` (of ``pkg.mod:small_cnn``)."""
    short = model_name.rsplit(":", 1)[-1].rsplit(".", 1)[-1]
    return re.sub(r"[^a-z0-9]+", "-", short.lower()).strip("-") or "model"


def registry_model_name(workload: str, model_name: str) -> str:
    """The registry's name for ``model_name`` trained on ``workload``: ``<workload>-<model slug>``
    (``mnist-resnet18`` for the defaults), what ``promote.model_name`` means when unset."""
    return f"{workload}-{model_slug(model_name)}"[:63].rstrip("-")


class _Section(BaseModel):
    # allow_inf_nan=False: every float field is finite (nan and inf are refused, naming the field).
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class MirrorChecksums(_Section):
    """sha256 of the four IDX files a mirror serves (explicit fields: dict parameters render badly in the UI)."""

    train_images: str = Field(
        "598012102e69d0813c3881110cea5ec594c4f3fdcd790ca436a332005aeba072",
        description="sha256 of train-images-idx3-ubyte.gz.",
        pattern=r"^[0-9a-f]{64}$",
    )
    train_labels: str = Field(
        "02e5b31f60c5d4fca825a121359f040ef62984db9c237c00cf39b24b6ff5cb45",
        description="sha256 of train-labels-idx1-ubyte.gz.",
        pattern=r"^[0-9a-f]{64}$",
    )
    test_images: str = Field(
        "24599118783c30742c3f9cf38b3e1cc526a1938e6d569152fd77c72f755c1519",
        description="sha256 of t10k-images-idx3-ubyte.gz.",
        pattern=r"^[0-9a-f]{64}$",
    )
    test_labels: str = Field(
        "0ebb3b6d3f29a35bb350af27034f3f91ee4587fe3618cf53ba1b64e580dc41ae",
        description="sha256 of t10k-labels-idx1-ubyte.gz.",
        pattern=r"^[0-9a-f]{64}$",
    )

    def by_file(self) -> dict[str, str]:
        """Map each MNIST file name to its expected sha256."""
        values = (self.train_images, self.train_labels, self.test_images, self.test_labels)
        return dict(zip(MNIST_FILES, values))


class DownloadConfig(_Section):
    """Where the data comes from: MNIST's four IDX files, or a labelled image folder (source=folder)."""

    source: Literal["auto", "official", "mirror", "sample", "folder"] = Field(
        "auto",
        description=(
            "auto: try the official MNIST mirrors (short connect timeout) and fall back to the "
            "bundled 5,000-digit sample with a warning; official: fail if unreachable; "
            "mirror: use mirror_url; sample: use the bundled sample directly; "
            "folder: your own labelled images in download.path (train/<class>/*.png|jpg, test/<class>/..., optional val/<class>/...)."
        ),
    )
    path: str | None = Field(
        None,
        description=(
            "source=folder: a local folder or an s3://bucket/prefix holding train/<class>/ and test/<class>/ "
            "(and optionally val/<class>/) with PNG or JPEG images; read, never modified or deleted."
        ),
    )
    mirror_url: str | None = Field(
        None,
        description="Base URL (http://, https:// or file://) serving the four IDX .gz files; used when source=mirror.",
    )
    mirror_sha256: MirrorChecksums = Field(
        default_factory=MirrorChecksums,
        description="sha256 of each mirror file; the defaults are the bundled sample's.",
    )
    connect_timeout_s: float = Field(
        3.0, gt=0, le=120, description="Seconds to wait for a connection to the official source."
    )
    read_timeout_s: float = Field(
        30.0, gt=0, le=3600, description="Seconds a download may wait for the server's next bytes before the attempt fails."
    )
    attempts: int = Field(
        4, ge=1, le=20, description="Attempts per file for transient HTTP errors (5xx, resets)."
    )
    backoff_s: float = Field(
        0.5, ge=0, le=60, description="First retry delay in seconds; doubles on every retry."
    )

    @field_validator("mirror_url")
    @classmethod
    def _check_mirror(cls, value: str | None) -> str | None:
        if value is None:
            return value
        _no_control_characters(value, "download.mirror_url")
        if urlparse(value).scheme not in {"http", "https", "file"}:
            raise ValueError("must start with http://, https:// or file://")
        return value.rstrip("/") + "/"

    @field_validator("path")
    @classmethod
    def _check_path(cls, value: str | None) -> str | None:
        if value is None:
            return value
        _no_control_characters(value, "download.path")
        if not value.strip():
            raise ValueError("download.path is empty; name a folder or an s3://bucket/prefix")
        if "://" in value and not value.startswith("s3://"):
            raise ValueError(f"download.path {value!r}: use a local folder or s3://bucket/prefix")
        # A relative folder is the caller's: made absolute here, since Ray workers run elsewhere.
        return value.rstrip("/") if value.startswith("s3://") else str(Path(value).expanduser().absolute())

    @model_validator(mode="after")
    def _mirror_needs_url(self) -> DownloadConfig:
        if self.source == "mirror" and not self.mirror_url:
            raise ValueError("source=mirror needs download.mirror_url (a base URL serving the four files)")
        if self.source == "folder" and not self.path:
            raise ValueError("source=folder needs download.path (a folder or s3:// prefix holding train/<class>/ and test/<class>/)")
        if self.source != "folder" and self.path:
            raise ValueError(f"download.path is only read with download.source=folder (source is {self.source}); unset it or set source=folder")
        return self


class ParquetConfig(_Section):
    """How the source data (IDX files or an image folder) becomes Parquet."""

    rows_per_file: int = Field(
        1000, ge=64, le=1_000_000, description="Rows per Parquet file (files are Ray Data's unit of read parallelism)."
    )
    rows_per_group: int = Field(
        1000, ge=64, le=1_000_000, description="Rows per Parquet row group; conversion streams one group at a time."
    )
    validation_every: int = Field(
        20,
        ge=2,
        le=1000,
        description=(
            "Every n-th training row (by row_id) is held out for per-epoch validation and checkpoint "
            "selection, so the test split is only ever used by the evaluation stage. An image folder without "
            "val/: about 1/n of each class's training images, picked by split_seed (a stratified split)."
        ),
    )
    split_seed: int = Field(
        0,
        ge=0,
        description=(
            "download.source=folder without a val/ folder: the seed of the stratified split that holds out "
            "validation images (the same seed and files give the same split). Not used by MNIST's IDX sources."
        ),
    )


class TransformConfig(_Section):
    """The Ray Data transform that feeds training and evaluation."""

    mean: float = Field(0.5, description="Normalization mean on the 0..1 scale (the seeds' Normalize((0.5,), (0.5,))).")
    std: float = Field(0.5, gt=0, description="Normalization standard deviation on the 0..1 scale.")
    shift_px: int = Field(
        2, ge=0, le=8, description="Training-time augmentation: random shift of up to this many pixels (0 disables)."
    )
    rotate_deg: float = Field(
        10.0, ge=0, le=45, description="Training-time augmentation: random rotation of up to this many degrees (0 disables)."
    )
    scale: float = Field(
        0.1, ge=0, le=0.5, description="Training-time augmentation: random zoom by a factor in [1 - scale, 1 + scale]."
    )
    image_size: int | None = Field(
        None,
        ge=4,
        le=4096,
        description=(
            "download.source=folder: resize every image to image_size x image_size pixels when the conversion reads it "
            "(needed when the folder's images differ in size). Unset: images are kept as they are and must all be one size."
        ),
    )
    batch_rows: int = Field(512, ge=1, le=65536, description="Rows per map_batches call.")
    in_memory_mb: int = Field(
        512,
        ge=0,
        description=(
            "A split with up to this many MB of Parquet is read with pyarrow and handed to Ray Data as "
            "in-memory blocks (an epoch of 60,000 rows about 4x faster here); a larger one streams through "
            "ray.data.read_parquet. 0 always streams."
        ),
    )
    block_rows: int = Field(8192, ge=64, le=1_000_000, description="Rows per Ray Data block when a split is read in memory.")
    cpus_per_task: float = Field(
        0.25,
        gt=0,
        le=8,
        description=(
            "Logical CPUs each Ray Data task reserves. Must fit in the CPUs training leaves free "
            "(see train.data_cpus), or the data pipeline starves while training waits for it."
        ),
    )


class ModelConfig(_Section):
    """Which network is trained, evaluated and promoted (training.models builds it)."""

    name: str = Field(
        "resnet18",
        description=(
            "resnet18 (the seeds' model), any torchvision classification model by name (e.g. mobilenet_v3_small; "
            "built without weights, first layer and head fitted to the data), or your own function as "
            "package.module:function, called with in_channels= and num_classes= and returning a torch.nn.Module "
            "(importable on every Ray worker). training.models:small_cnn is a small CNN for quick runs."
        ),
    )

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        _no_control_characters(value, "model.name")
        value = value.strip()
        if not _MODEL_REF.fullmatch(value):
            raise ValueError(
                f"{value!r}: use resnet18, a torchvision model's name (e.g. mobilenet_v3_small) or package.module:function"
            )
        return value


class TrainConfig(_Section):
    """Distributed training with Ray Train (TorchTrainer, Ray Train V2)."""

    mode: Literal["distributed", "single"] = Field(
        "distributed",
        description=(
            "distributed: Ray Train workers (TorchTrainer). single: the same model, recipe, data pipeline and "
            "checkpoint files in one process without Ray Train (the seeds' plain PyTorch section), to see the price "
            "of distribution on your hardware; it ignores the worker and Ray Train failure settings."
        ),
    )
    num_workers: int = Field(
        1,
        ge=1,
        le=1024,
        description=(
            "Ray Train workers (data-parallel ranks). 1 on a small CPU machine is fastest (one worker "
            "uses every core); raise it on a cluster."
        ),
    )
    min_workers: int | None = Field(
        None,
        ge=1,
        le=1024,
        description=(
            "Elastic training: when set, Ray Train runs with between min_workers and num_workers workers "
            "(ScalingConfig(num_workers=(min, max))), so losing a node restarts on what remains instead of "
            "waiting for it. The global batch stays the same: each worker takes global_batch_size / workers. Unset: fixed."
        ),
    )
    epochs: int = Field(12, ge=1, le=1000, description="Passes over the training split (at most; see max_images).")
    max_images: int = Field(
        150_000,
        ge=0,
        le=10**10,
        description=(
            "Caps the epochs by data size: a run trains on about this many images at most, "
            "epochs = min(epochs, ceil(max_images / training rows)). The defaults give 12 epochs on the bundled "
            "3,800-image sample and 3 on full MNIST's 57,000. 0: no cap."
        ),
    )
    global_batch_size: int = Field(
        128, ge=1, le=65536, description="Images per optimizer step across all workers; each worker takes global ÷ workers."
    )
    learning_rate: float = Field(3e-3, gt=0, le=10, description="Peak learning rate of the one-cycle AdamW schedule.")
    weight_decay: float = Field(5e-4, ge=0, le=1, description="AdamW weight decay.")
    label_smoothing: float = Field(0.1, ge=0, lt=1, description="Cross-entropy label smoothing.")
    ema_decay: float = Field(
        0.99,
        ge=0,
        lt=1,
        description="Decay of the exponential moving average of the weights that is validated and saved (0 disables).",
    )
    seed: int = Field(0, ge=0, description="Seed for weights, shuffling and augmentation.")
    strategy: Literal["ddp", "fsdp"] = Field("ddp", description="Data-parallel strategy passed to prepare_model.")
    use_gpu: Literal["auto", "never", "always"] = Field(
        "auto", description="auto: use GPUs when the Ray cluster has them; never / always force it."
    )
    data_cpus: float = Field(
        1.0,
        ge=1,
        le=64,
        description=(
            "Logical CPUs left free for Ray Data while training runs; workers share the rest. "
            "At least 1: some Ray Data operators (file listing) always reserve a whole CPU. "
            "This is what keeps num_workers == CPU count from deadlocking."
        ),
    )
    max_failures: int = Field(2, ge=-1, le=100, description="Worker-group restarts Ray Train makes (FailureConfig); -1 = unlimited.")
    stage_retries: int = Field(
        1,
        ge=0,
        le=20,
        description=(
            "Prefect retries of the training stage after Ray Train gives up (max_failures spent) on an "
            "infrastructure failure (a worker or node lost, a hang); each retry resumes the same Ray Train run "
            "from its latest checkpoint. Errors in the training code are never retried."
        ),
    )
    stage_retry_delay_s: float = Field(10.0, ge=0, le=3600, description="Seconds Prefect waits before retrying the training stage.")
    hang_timeout_s: float = Field(
        600.0,
        ge=0,
        le=86400,
        description=(
            "A training worker that does not reach the next step within this many seconds (stalled, deadlocked, stuck "
            "in a collective) fails the attempt with an error naming its rank; 0 disables the per-step check."
        ),
    )
    checkpoint_every_steps: int = Field(
        0,
        ge=0,
        le=1_000_000,
        description=(
            "Also checkpoint every this many optimizer steps inside an epoch (0: only at epoch ends). Such a checkpoint "
            "records which rows the epoch has trained on, so a restart trains the rest of the epoch exactly once, "
            "with any number of workers."
        ),
    )
    num_to_keep: int = Field(2, ge=1, le=100, description="Checkpoints Ray Train keeps, best by checkpoint_score.")
    checkpoint_score: Literal["val_loss", "val_accuracy"] = Field(
        "val_loss",
        description=(
            "Validation metric that ranks checkpoints (CheckpointConfig) and picks the one evaluated. "
            "val_loss by default: on a small validation split accuracy moves in coarse steps, and a "
            "mid-training 100% picked a checkpoint that scored 98.4% on test (measured)."
        ),
    )

    def epochs_for(self, train_rows: int) -> int:
        """The epochs a run over ``train_rows`` training rows makes: ``epochs``, capped by ``max_images``."""
        if self.max_images == 0 or train_rows <= 0:
            return self.epochs
        return max(1, min(self.epochs, math.ceil(self.max_images / train_rows)))


class EvaluateConfig(_Section):
    """Batch inference on the test split and the quality gate."""

    # The default recipe (12 epochs, test-time augmentation) on the bundled sample scored 98.6-99.1% over
    # seeds 0-4 on an AMD EPYC Zen 5 (docs/performance.md); 97.5% sits 1.1 points (about 3 binomial standard
    # deviations on 1,000 test images) below the worst, and a broken pipeline (every training label
    # shuffled) still fails it (tests/test_flow_e2e.py).
    min_accuracy: float = Field(
        0.975,
        ge=0,
        le=1,
        description=(
            "Gate: the flow fails (keeping every artifact) below this test accuracy. The default recipe scored "
            "98.6-99.1% on the bundled sample over five seeds; raise it for full MNIST if you want a stricter gate."
        ),
    )
    num_actors: int = Field(1, ge=1, le=256, description="Model actors in the Ray Data inference pool.")
    batch_rows: int = Field(250, ge=1, le=65536, description="Images per inference batch.")
    tta: bool = Field(
        True,
        description=(
            "Test-time augmentation: predict from the softmax averaged over each test image and its four "
            "one-pixel shifts (5 forward passes per image); metrics.json also reports the accuracy without it. "
            "On by default: with the 12-epoch recipe it added 0.1-0.2 points on average over seeds (docs/performance.md)."
        ),
    )


class PromoteConfig(_Section):
    """Champion promotion, the evaluation stage's last step: a model that passed the gate becomes the
    champion under <storage_root>/models/<model_name>/ only when it beats the current one on the same test set."""

    enabled: bool = Field(
        True,
        description="Compare every model that passed the gate with the champion and promote it when better; off: compare nothing.",
    )
    model_name: str | None = Field(
        None,
        description=(
            "Names the folder models/<model_name>/ (numbered versions, the champion pointer) and the run-comparison "
            "artifacts. Unset: <workload>-<model.name>, e.g. mnist-resnet18 (mnist-small-cnn for training.models:small_cnn)."
        ),
    )
    min_improvement: float = Field(
        0.0,
        ge=0,
        le=1,
        description=(
            "Test accuracy (0..1) a candidate must gain over the champion to replace it: promoted only when "
            "accuracy > champion's + min_improvement. A tie is not promoted."
        ),
    )
    recent_runs: int = Field(20, ge=1, le=1000, description="Runs listed in the run-comparison table and picture.")

    @field_validator("model_name")
    @classmethod
    def _check_model_name(cls, value: str | None) -> str | None:
        if value is not None and not _MODEL_NAME.fullmatch(value):
            raise ValueError(f"{value!r}: use lowercase letters, digits and '-', starting with a letter or digit (at most 63)")
        return value

    def registry_name(self, workload: str, model_name: str) -> str:
        """``model_name`` when set, else the name the workload and model give (`registry_model_name`)."""
        return self.model_name or registry_model_name(workload, model_name)


class CleanupConfig(_Section):
    """Retention policy, applied after a successful evaluation; deletes only inside the storage root."""

    keep_checkpoints: int = Field(
        0,
        ge=0,
        le=1000,
        description="Keep the best N checkpoints of this run (the evaluated one always stays); 0 keeps all.",
    )
    delete_raw: bool = Field(
        False, description="Delete the downloaded IDX files of this run's data source (never a download.source=folder image folder)."
    )
    delete_parquet: bool = Field(False, description="Delete this run's Parquet dataset.")
    dry_run: bool = Field(False, description="Only list what the policy would delete.")


class RayConfig(_Section):
    """Which Ray cluster runs the stages."""

    address: str | None = Field(
        None,
        description="Unset: start a local Ray for the run. 'auto', 'host:port' or 'ray://host:10001': connect to that cluster.",
    )
    num_cpus: int | None = Field(
        None, ge=1, le=4096, description="CPUs of the local Ray started when address is unset (default: all)."
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
        _no_control_characters(value, "ray.address")
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


class PipelineConfig(_Section):
    """An image classifier (ResNet-18 on MNIST by default): download, Parquet, Ray Data transform, Ray Train, evaluation, cleanup."""

    workload: str = Field(
        DEFAULT_WORKLOAD,
        description=(
            "What this pipeline trains, as a name: it starts the default run names (<workload>-<time>-<id>), the Prefect "
            "artifact keys (<workload>-test-metrics, ...) and the registry's model name (<workload>-<model>). "
            "Lowercase letters, digits and '-'. mnist keeps the names MNIST runs always had."
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
    promote: PromoteConfig = Field(default_factory=PromoteConfig, description="Champion promotion (end of the evaluation stage).")
    cleanup: CleanupConfig = Field(default_factory=CleanupConfig, description="Cleanup stage.")
    ray: RayConfig = Field(default_factory=RayConfig, description="Ray cluster.")

    @field_validator("workload")
    @classmethod
    def _check_workload(cls, value: str) -> str:
        _no_control_characters(value, "workload")
        if not _WORKLOAD.fullmatch(value):
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
        _no_control_characters(value, "run_name")
        if "/" in value or "\\" in value or ".." in value:
            raise ValueError(f"{value!r} may not contain '/', '\\' or '..': it names one folder under runs/")
        if not _RUN_NAME.fullmatch(value):
            raise ValueError(f"{value!r}: use letters, digits, '-', '_' and '.', starting with a letter or digit")
        return value

    @field_validator("storage_root")
    @classmethod
    def _check_storage_root(cls, value: str) -> str:
        _no_control_characters(value, "storage_root")
        if not value.strip():
            raise ValueError("storage_root is empty; use a folder path or s3://bucket/prefix")
        if value.startswith("s3://"):
            bucket, _, prefix = value[len("s3://") :].partition("/")
            if not _S3_BUCKET.fullmatch(bucket):
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


class Range(_Section):
    """A closed interval Tune samples from; low == high fixes the knob at that value."""

    low: float = Field(description="Smallest value sampled.")
    high: float = Field(description="Largest value sampled.")

    @model_validator(mode="after")
    def _ordered(self) -> Range:
        if self.low > self.high:
            raise ValueError(f"low ({self.low:g}) is larger than high ({self.high:g}); swap them")
        return self


class SearchSpace(_Section):
    """The recipe's knobs a search samples, one distribution each (fix one with low == high or a single choice)."""

    learning_rate: Range = Field(
        default=Range(low=3e-4, high=1e-2),
        description="Peak learning rate (train.learning_rate), sampled log-uniformly; low must be > 0.",
    )
    weight_decay: Range = Field(
        default=Range(low=1e-5, high=1e-2),
        description="AdamW weight decay (train.weight_decay), sampled log-uniformly; low must be > 0.",
    )
    global_batch_size: list[int] = Field(
        default=[64, 128, 256],
        min_length=1,
        max_length=16,
        description="Images per optimizer step (train.global_batch_size), one of these, uniformly.",
    )
    augmentation: Range = Field(
        default=Range(low=0.0, high=1.5),
        description=(
            "Augmentation strength, sampled uniformly: a factor on transform.shift_px, rotate_deg and scale "
            "(0 turns augmentation off, 1 keeps the configured values; each is capped at its own field's limit)."
        ),
    )
    label_smoothing: Range = Field(
        default=Range(low=0.0, high=0.2),
        description="Cross-entropy label smoothing (train.label_smoothing), sampled uniformly.",
    )

    @model_validator(mode="after")
    def _check(self) -> SearchSpace:
        for name in ("learning_rate", "weight_decay"):
            if getattr(self, name).low <= 0:
                raise ValueError(f"{name}.low must be > 0: it is sampled log-uniformly")
        if self.learning_rate.high > 10:
            raise ValueError("learning_rate.high must be at most 10 (train.learning_rate's limit)")
        if self.weight_decay.high > 1:
            raise ValueError("weight_decay.high must be at most 1 (train.weight_decay's limit)")
        if self.augmentation.low < 0 or self.augmentation.high > 10:
            raise ValueError("augmentation must lie in 0..10 (a factor on the configured augmentation)")
        if self.label_smoothing.low < 0 or self.label_smoothing.high >= 1:
            raise ValueError("label_smoothing must lie in 0..1 (1 excluded)")
        bad = [size for size in self.global_batch_size if not 1 <= size <= 65536]
        if bad:
            raise ValueError(f"global_batch_size choices {bad} are outside 1..65536")
        return self


class TuneConfig(_Section):
    """Hyperparameter search with Ray Tune: every trial is a Ray Train run of the training loop."""

    num_samples: int = Field(8, ge=1, le=10_000, description="Trials: configurations sampled from the search space.")
    epochs: int = Field(
        4, ge=1, le=1000, description="Each trial's epoch budget (the most a trial trains; ASHA stops weak ones sooner)."
    )
    scheduler: Literal["asha", "none"] = Field(
        "asha",
        description="asha: stop trials that fall behind at each rung (Async Successive Halving); none: every trial runs its epochs.",
    )
    grace_period: int = Field(1, ge=1, le=1000, description="ASHA: epochs every trial trains before it can be stopped.")
    reduction_factor: float = Field(
        2.0, ge=1.1, le=100, description="ASHA: at each rung only the best 1/reduction_factor of trials go on."
    )
    metric: Literal["val_ce", "val_loss", "val_accuracy"] = Field(
        "val_ce",
        description=(
            "Validation metric that ranks trials (ASHA's stops and the best trial). val_ce: cross-entropy without "
            "label smoothing, comparable across trials that sample different smoothing; val_loss: the training "
            "criterion (smoothing included); val_accuracy: coarse on a small validation split."
        ),
    )
    mode: Literal["min", "max"] | None = Field(
        None, description="min or max; unset: min for the losses, max for val_accuracy. A mode that contradicts the metric is refused."
    )
    max_concurrent_trials: int = Field(
        0,
        ge=0,
        le=1024,
        description=(
            "Trials running at once. 0: as many as the cluster holds, one whole CPU per training worker after "
            "train.data_cpus are set aside for Ray Data (1 on a 2-CPU machine). More than the cluster holds is refused."
        ),
    )
    seed: int | None = Field(0, ge=0, description="Seed of the search's sampling (same seed, same trial configs); unset: random.")
    max_failures: int = Field(
        0, ge=0, le=100, description="Times Tune restarts a failed trial (inside a trial, Ray Train restarts lost workers: train.max_failures)."
    )
    train_best: bool = Field(
        False,
        description="Then train the best config with train.epochs and evaluate it through the normal stages (gate included) in the same flow run.",
    )
    search_space: SearchSpace = Field(default=SearchSpace(), description="What each trial samples.")

    @property
    def direction(self) -> str:
        """``mode``, or the one the metric implies."""
        return self.mode or ("max" if self.metric == "val_accuracy" else "min")

    @model_validator(mode="after")
    def _check(self) -> TuneConfig:
        implied = "max" if self.metric == "val_accuracy" else "min"
        if self.mode is not None and self.mode != implied:
            raise ValueError(f"mode={self.mode} contradicts metric={self.metric} (better is {implied}); leave mode unset")
        if self.scheduler == "asha" and self.grace_period > self.epochs:
            raise ValueError(
                f"grace_period ({self.grace_period}) is larger than epochs ({self.epochs}): ASHA could never stop a trial; "
                "lower grace_period or raise epochs"
            )
        return self


class TunePipelineConfig(PipelineConfig):
    """Ray Tune over the pipeline's model and workload: the pipeline's stages with a tune stage (and optionally the best config trained)."""

    tune: TuneConfig = Field(default=TuneConfig(), description="Hyperparameter search.")

    @model_validator(mode="after")
    def _check_tune(self) -> TunePipelineConfig:
        small = [size for size in self.tune.search_space.global_batch_size if size < self.train.num_workers]
        if small:
            raise ValueError(
                f"tune.search_space.global_batch_size choices {small} are smaller than train.num_workers "
                f"({self.train.num_workers}): every worker needs at least one image per step"
            )
        if self.train.mode == "single":
            raise ValueError("tune runs every trial with Ray Train; use train.mode=distributed")
        return self
