"""Where everything of a run lives under the storage root (`StorageLayout`, passed to every stage).

    <root>/raw/<source>/                  the four IDX .gz files of one data source
    <root>/datasets/mnist-<fingerprint>/  Parquet splits + _manifest.json (shared across runs)
    <root>/runs/<run>/                    the Ray Train run (checkpoints) + summary.json
    <root>/runs/<run>/evaluation/         metrics.json, confusion matrix, predictions
    <root>/locks/                         one dataset build at a time (`storage_io.locks`)
    <root>/leases/<run>.json              live runs and the folders they read (cleanup leaves those alone)
"""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow.fs as pafs
from pydantic import BaseModel, ConfigDict

from storage_io.filesystem import S3_SCHEME, S3Settings, filesystem, is_remote, join


class StorageLayout(BaseModel):
    """Paths of one run under one storage root (passed to every stage)."""

    model_config = ConfigDict(frozen=True)

    root: str
    run_name: str

    @classmethod
    def create(cls, root: str, run_name: str) -> StorageLayout:
        """Layout with ``root`` made absolute (relative roots are relative to the working directory)."""
        if is_remote(root):
            return cls(root=root.rstrip("/"), run_name=run_name)
        return cls(root=str(Path(root).expanduser().absolute()), run_name=run_name)

    @property
    def remote(self) -> bool:
        return is_remote(self.root)

    def raw_dir(self, source_key: str) -> str:
        return join(self.root, "raw", source_key)

    def dataset_dir(self, fingerprint: str) -> str:
        return join(self.root, "datasets", f"mnist-{fingerprint}")

    @property
    def runs_dir(self) -> str:
        return join(self.root, "runs")

    @property
    def run_dir(self) -> str:
        return join(self.runs_dir, self.run_name)

    @property
    def summary_path(self) -> str:
        return join(self.run_dir, "summary.json")

    @property
    def evaluation_dir(self) -> str:
        return join(self.run_dir, "evaluation")

    def contains(self, path: str | os.PathLike[str]) -> bool:
        """True when ``path`` (symlinks resolved; no '..' on S3) lies strictly inside the storage root."""
        if self.remote or is_remote(path):
            text = str(path).rstrip("/")
            if not (self.remote and is_remote(text)) or ".." in text[len(S3_SCHEME) :].split("/"):
                return False
            return text.startswith(self.root + "/")
        root = Path(self.root).resolve()
        target = Path(path).resolve()
        return target != root and target.is_relative_to(root)

    def check_reachable(self) -> None:
        """Fail before any work when an S3 root cannot be listed (naming the root and the endpoint)."""
        if not self.remote:
            return
        fs, where = filesystem(self.root)
        bucket = where.split("/", 1)[0]
        try:
            info = fs.get_file_info(bucket)
        except OSError as exc:
            raise ValueError(
                f"storage_root {self.root}: cannot reach the bucket at {S3Settings().endpoint_url or 'AWS'}: {exc}; "
                "check AWS_ENDPOINT_URL, AWS_REGION and the credentials in the environment"
            ) from exc
        if info.type == pafs.FileType.NotFound:
            raise ValueError(f"storage_root {self.root}: bucket {bucket!r} does not exist at {S3Settings().endpoint_url or 'AWS'}")
