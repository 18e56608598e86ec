"""What every section of the configuration shares: the section base, name rules, the bundled sample's place."""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import BaseModel, ConfigDict

# The bundled sample (4,000 train / 1,000 test real MNIST digits) ships inside the project as
# IDX .gz files; its checksums are pinned here so it is verified like any other mirror.
SAMPLE_DIR = Path(__file__).resolve().parent.parent / "data" / "mnist-sample"


MNIST_FILES = (
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
)


RUN_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


# model.name: a torchvision model's name or package.module:function (whether it exists is checked
# before any work by training.model.catalog.check_name, which imports what it names).
MODEL_REF_PATTERN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*(:[A-Za-z_][A-Za-z0-9_]*)?$")


MODEL_NAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")  # also part of Prefect artifact keys


# The workload names run folders, Prefect artifact keys and the registry's model: the same rule
# as Prefect's artifact keys, short enough to leave room for what follows it.
DEFAULT_WORKLOAD = "mnist"


WORKLOAD_PATTERN = re.compile(r"^[a-z0-9][a-z0-9-]{0,39}$")


# S3 bucket naming rules: 3-63 lowercase letters, digits, dots and hyphens, starting and ending alphanumeric.
S3_BUCKET_PATTERN = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


def no_control_characters(value: str, what: str) -> None:
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


class Section(BaseModel):
    # allow_inf_nan=False: every float field is finite (nan and inf are refused, naming the field).
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)
