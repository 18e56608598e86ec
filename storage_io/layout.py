"""Where everything of a run lives under the storage root (`StorageLayout`, passed to every stage).

    <root>/raw/<source>/                  the four IDX .gz files of one data source
    <root>/datasets/<workload>-<fingerprint>/  Parquet splits + _manifest.json (shared across runs)
    <root>/runs/<run>/                    the Ray Train run (checkpoints) + summary.json
    <root>/runs/<run>/evaluation/         metrics.json, confusion matrix, predictions
    <root>/locks/                         one dataset build at a time (`storage_io.locks`)
    <root>/leases/<run>.json              live runs and the folders they read (cleanup leaves those alone)
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from storage_io.filesystem import S3_SCHEME, S3Settings, is_remote, join
from storage_io.redact import redact_text, redact_url


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

    def dataset_dir(self, fingerprint: str, workload: str = "mnist") -> str:
        return join(self.root, "datasets", f"{workload}-{fingerprint}")

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
        """Fail before any work when an S3 root's bucket cannot be used, saying what is wrong.

        One HEAD of the bucket, with short timeouts and one retry, tells apart the cases a user fixes
        differently: no credentials, an endpoint that does not answer, a bucket that does not exist,
        and credentials the endpoint refuses."""
        if not self.remote:
            return
        from botocore.config import Config  # botocore: only for an s3:// root

        # botocore: only for an s3:// root
        from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

        settings = S3Settings()
        bucket = self.root[len(S3_SCHEME) :].split("/", 1)[0]
        where = redact_url(settings.endpoint_url) if settings.endpoint_url else "AWS"  # never its credentials
        config = Config(connect_timeout=5, read_timeout=15, retries={"max_attempts": 2, "mode": "standard"})
        try:
            settings.boto3_client(config).head_bucket(Bucket=bucket)
        except NoCredentialsError:
            raise ValueError(
                f"storage_root {self.root}: no S3 credentials found; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                "(or a profile in ~/.aws) in the environment"
            ) from None
        except ClientError as exc:
            error = exc.response.get("Error", {})
            code = str(error.get("Code", "?"))
            if code in {"404", "NoSuchBucket", "NotFound"}:
                raise ValueError(f"storage_root {self.root}: bucket {bucket!r} does not exist at {where}") from None
            if code in {"403", "AccessDenied", "Forbidden", "InvalidAccessKeyId", "SignatureDoesNotMatch"}:
                raise ValueError(
                    f"storage_root {self.root}: {where} refused the credentials for bucket {bucket!r} ({code}); "
                    "check AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and the bucket's permissions"
                ) from None
            raise ValueError(f"storage_root {self.root}: {where} answered {code} for bucket {bucket!r}: {redact_text(str(error.get('Message', exc)))}") from None
        except BotoCoreError as exc:  # connection refused, DNS, timeouts: nothing answered
            raise ValueError(
                f"storage_root {self.root}: cannot reach the S3 endpoint {where} ({type(exc).__name__}: {redact_text(str(exc))}); "
                "check AWS_ENDPOINT_URL and that the server is up"
            ) from None
