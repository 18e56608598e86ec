"""The data sections of the configuration: download (and a mirror's checksums) and Parquet conversion (the
transform's section: `pipeline_config.transform`)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal
from urllib.parse import urlparse

from pydantic import Field, SerializerFunctionWrapHandler, field_validator, model_serializer, model_validator

from pipeline_config.common import MNIST_FILES, Section, no_control_characters
from pipeline_config.sources import PATH_SOURCES, SOURCES, SourceChoice, described


class MirrorChecksums(Section):
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


class DownloadConfig(Section):
    """Where the data comes from: MNIST's four IDX files, a labelled image folder (source=folder), or a folder of
    Parquet files (source=parquet)."""

    source: SourceChoice = Field("auto", description=described())  # the choices: `pipeline_config.sources.SOURCES`
    path: str | None = Field(
        None,
        description=(
            "source=folder: a local folder or an s3://bucket/prefix holding train/<class>/ and test/<class>/ "
            "(and optionally val/<class>/) with PNG or JPEG images; source=parquet: a local folder or an s3://bucket/prefix "
            "holding train and test Parquet files (and optionally validation). Read, never modified or deleted."
        ),
    )
    image_column: str = Field(
        "image",
        min_length=1,
        max_length=200,
        description=(
            "source=parquet: the column holding the encoded images (PNG or JPEG): a struct {bytes, path} as the "
            "Hugging Face datasets library writes an Image feature, or plain binary."
        ),
    )
    label_column: str = Field(
        "label",
        min_length=1,
        max_length=200,
        description=(
            "source=parquet: the column holding the labels: integers (class names from the files' Hugging Face "
            "ClassLabel metadata when present, else 0, 1, ...), or strings, whose sorted values become the classes."
        ),
    )
    max_image_pixels: int = Field(
        50_000_000,
        ge=1,
        le=150_000_000,
        description=(
            "source=folder or parquet: the most pixels (width x height) one image may have, read from its header before it is "
            "decoded; a larger image is refused before any work, naming the file. At most 150 megapixels."
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
        no_control_characters(value, "download.mirror_url")
        parsed = urlparse(value)
        if parsed.scheme not in {"http", "https", "file"}:
            raise ValueError("must start with http://, https:// or file://")
        # Never used by the download (file names are appended to the base URL), and a flow parameter is stored and shown.
        if "@" in parsed.netloc or parsed.query or parsed.fragment or "?" in value or "#" in value:
            raise ValueError(
                "download.mirror_url holds credentials (user:password@) or a ?query/#fragment: give the base URL "
                "alone, of a mirror that needs no credentials in its URL (the four file names are appended to it)"
            )
        return value.rstrip("/") + "/"

    @field_validator("path")
    @classmethod
    def _check_path(cls, value: str | None) -> str | None:
        if value is None:
            return value
        no_control_characters(value, "download.path")
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
        needs = SOURCES[self.source].path
        if needs and not self.path:
            raise ValueError(f"source={self.source} needs download.path ({needs})")
        if not needs and self.path:
            raise ValueError(
                f"download.path is only read with download.source={' or '.join(PATH_SOURCES)} (source is {self.source}); "
                "unset it or set source=folder"
            )
        return self


class ParquetConfig(Section):
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
    leakage: Literal["warn", "error"] = Field(
        "warn",
        description=(
            "Rows of the test or validation split whose image is an exact copy of a training image (the same pixels, "
            "found by a hash of each row's bytes as the data is converted): warn names them in the to-parquet line and "
            "the evaluation report; error fails the to-parquet stage, naming them, before any training."
        ),
    )

    @model_serializer(mode="wrap")
    def _dump(self, handler: SerializerFunctionWrapHandler) -> dict:
        """``leakage`` left out while it is ``warn``: every dataset's fingerprint is made of this dump, and what the
        stage does about copies (`conversion_settings`) changes nothing the conversion writes."""
        dumped = handler(self)
        if isinstance(dumped, dict) and dumped.get("leakage") == "warn":
            dumped.pop("leakage")
        return dumped

    def conversion_settings(self) -> ParquetConfig:
        """These settings less what changes nothing the conversion writes (``leakage``): what a dataset's fingerprint
        is made of, so the same data is one dataset whatever the stage does about copies."""
        return self.model_copy(update={"leakage": "warn"})


