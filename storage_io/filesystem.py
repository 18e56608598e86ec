"""Filesystem primitives for a local folder or an ``s3://`` prefix, through one pyarrow filesystem.

Paths are strings: absolute local paths or ``s3://`` URIs, so every manifest and report names
the object a user can look up. S3 endpoint, region and credentials come from the environment
(`S3Settings`), never from flow parameters.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import os
import posixpath
import shutil
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
from pydantic import AliasChoices, Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from storage_io.errors import s3_write_error
from storage_io.walk import Listing, walk_local

S3_SCHEME = "s3://"


# The environment variables an S3 storage root reads (forwarded to Ray workers by runner.cluster.runtime).
S3_ENV_VARS = (
    "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_REGION", "AWS_DEFAULT_REGION",
    "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
)


class S3Settings(BaseSettings):
    """Endpoint, region and credentials of an ``s3://`` storage root, from the standard AWS variables.

    Never flow parameters: those are stored in the Prefect database and shown in the UI. Unset
    keys fall back to the AWS SDK's own chain (instance profile, ~/.aws).
    """

    model_config = SettingsConfigDict(extra="ignore")

    endpoint_url: str | None = Field(None, validation_alias=AliasChoices("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"))
    region: str | None = Field(None, validation_alias=AliasChoices("AWS_REGION", "AWS_DEFAULT_REGION"))
    access_key_id: str | None = Field(None, validation_alias="AWS_ACCESS_KEY_ID")
    secret_access_key: SecretStr | None = Field(None, validation_alias="AWS_SECRET_ACCESS_KEY")
    session_token: SecretStr | None = Field(None, validation_alias="AWS_SESSION_TOKEN")

    @field_validator("endpoint_url", "region", "access_key_id", mode="before")
    @classmethod
    def _blank_is_unset(cls, value):
        """A variable set to nothing (``AWS_ENDPOINT_URL=""``) is unset, as the AWS SDKs read it (boto3 refused
        the empty endpoint: "Invalid endpoint: ")."""
        return None if isinstance(value, str) and not value.strip() else value

    def pyarrow_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"region": self.region} if self.region else {}  # unset: the SDK's chain
        if self.endpoint_url:
            scheme, _, host = self.endpoint_url.partition("://")
            kwargs |= {"endpoint_override": host.rstrip("/"), "scheme": scheme} if host else {"endpoint_override": scheme}
        if self.access_key_id and self.secret_access_key:
            kwargs |= {"access_key": self.access_key_id, "secret_key": self.secret_access_key.get_secret_value()}
            if self.session_token:
                kwargs["session_token"] = self.session_token.get_secret_value()
        return kwargs

    def boto3_client(self, config=None):
        """A boto3 S3 client for these settings; ``config``: an optional ``botocore.config.Config``.

        From a session of its own: boto3's default session keeps the first credentials it resolved
        from the environment or ~/.aws, and this client must see the environment as it is now."""
        import boto3  # only S3 roots need it (conditional PUTs for locks; pyarrow has none)

        return boto3.session.Session().client(
            "s3",
            config=config,
            endpoint_url=self.endpoint_url,
            region_name=self.region,
            aws_access_key_id=self.access_key_id,
            aws_secret_access_key=self.secret_access_key.get_secret_value() if self.secret_access_key else None,
            aws_session_token=self.session_token.get_secret_value() if self.session_token else None,
        )


def is_remote(path: str | os.PathLike[str]) -> bool:
    """True for an ``s3://`` URI."""
    return str(path).startswith(S3_SCHEME)


@functools.cache
def _s3_filesystem(settings_json: str) -> pafs.S3FileSystem:
    return pafs.S3FileSystem(**S3Settings.model_validate_json(settings_json).pyarrow_kwargs())


def s3_filesystem() -> pafs.S3FileSystem:
    """The pyarrow S3 filesystem for the current environment's `S3Settings` (one per settings)."""
    settings = S3Settings()
    return _s3_filesystem(_settings_key(settings))


def _settings_key(settings: S3Settings) -> str:
    """The settings as JSON with the secrets in clear (only a cache key, never logged)."""
    data = settings.model_dump()
    data["secret_access_key"] = settings.secret_access_key.get_secret_value() if settings.secret_access_key else None
    data["session_token"] = settings.session_token.get_secret_value() if settings.session_token else None
    return json.dumps(data)


def filesystem(path: str | os.PathLike[str]) -> tuple[pafs.FileSystem, str]:
    """(pyarrow filesystem, path on it) for a local path or an ``s3://`` URI."""
    text = str(path)
    if is_remote(text):
        return s3_filesystem(), text[len(S3_SCHEME) :].rstrip("/")
    return pafs.LocalFileSystem(), str(Path(text).absolute())


def join(base: str | os.PathLike[str], *parts: str) -> str:
    """``base/part/...`` for a local path or an ``s3://`` URI."""
    text = str(base)
    if is_remote(text):
        return "/".join([text.rstrip("/"), *(p.strip("/") for p in parts)])
    return str(Path(text, *parts))


def basename(path: str | os.PathLike[str]) -> str:
    return posixpath.basename(str(path).rstrip("/"))


def parent(path: str | os.PathLike[str]) -> str:
    text = str(path).rstrip("/")
    return text.rsplit("/", 1)[0] if is_remote(text) else str(Path(text).parent)


def _info(path: str | os.PathLike[str]) -> pafs.FileInfo:
    fs, where = filesystem(path)
    return fs.get_file_info(where)


def exists(path: str | os.PathLike[str]) -> bool:
    return _info(path).type != pafs.FileType.NotFound


def is_file(path: str | os.PathLike[str]) -> bool:
    return _info(path).type == pafs.FileType.File


def is_dir(path: str | os.PathLike[str]) -> bool:
    return _info(path).type == pafs.FileType.Directory


def read_bytes(path: str | os.PathLike[str]) -> bytes:
    """The content of a file; FileNotFoundError naming ``path`` when there is none."""
    fs, where = filesystem(path)
    try:
        with fs.open_input_stream(where, compression=None) as handle:
            return handle.readall()
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, "no such file", str(path)) from None
    except OSError as exc:
        if "not found" in str(exc).lower() or "NoSuchKey" in str(exc):
            raise FileNotFoundError(errno.ENOENT, "no such file", str(path)) from exc
        raise


def read_lines(path: str | os.PathLike[str]) -> list[dict]:
    """Every JSON line of a ``.jsonl`` file (empty when there is none)."""
    if not is_file(path):
        return []
    return [json.loads(line) for line in read_bytes(path).decode().splitlines() if line.strip()]


def read_json(path: str | os.PathLike[str]) -> Any | None:
    """Parsed JSON at ``path``, or None when the file is missing or unreadable as JSON."""
    try:
        return json.loads(read_bytes(path))
    except (OSError, ValueError):
        return None


def list_tree(directory: str | os.PathLike[str], suffix: str = "") -> Listing:
    """Every file under ``directory`` ending in ``suffix``, each once, as relative paths (with '/'), sorted.

    A local folder's links are followed by `storage_io.walk.walk_local`'s rules: never into the folder itself or
    a folder around it, nor a second time into a folder listed already; a link out of it is followed and named
    in `Listing.links_out`. An ``s3://`` prefix has no links: its keys, each relative path once."""
    if not is_remote(directory):
        return walk_local(str(Path(directory).absolute()), suffix)
    fs, where = filesystem(directory)
    try:
        infos = fs.get_file_info(pafs.FileSelector(where, recursive=True, allow_not_found=True))
    except NotADirectoryError:
        return Listing([])
    rels = {posixpath.relpath(info.path, where) for info in infos if info.type == pafs.FileType.File and info.path.endswith(suffix)}
    return Listing(sorted(rels))


def list_files(directory: str | os.PathLike[str], suffix: str = "") -> list[str]:
    """Relative paths (with '/') of every file under ``directory`` ending in ``suffix``, each once, sorted (`list_tree`)."""
    return list_tree(directory, suffix).files


def list_dirs(directory: str | os.PathLike[str]) -> list[str]:
    """Names of the folders directly inside ``directory`` (prefixes on S3), sorted; empty when it is missing."""
    fs, where = filesystem(directory)
    try:
        infos = fs.get_file_info(pafs.FileSelector(where, recursive=False, allow_not_found=True))
    except NotADirectoryError:
        return []
    return sorted(posixpath.basename(info.path.rstrip("/")) for info in infos if info.type == pafs.FileType.Directory)


def total_bytes(path: str | os.PathLike[str]) -> int:
    """Size of a file, or of every file under a folder."""
    fs, where = filesystem(path)
    info = fs.get_file_info(where)
    if info.type == pafs.FileType.File:
        return info.size or 0
    if info.type == pafs.FileType.NotFound:
        return 0
    return sum(i.size or 0 for i in fs.get_file_info(pafs.FileSelector(where, recursive=True)) if i.type == pafs.FileType.File)


def remove(path: str | os.PathLike[str]) -> None:
    """Delete a file or a folder tree (nothing when it is gone already)."""
    if not is_remote(path):
        target = Path(path)
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        else:
            target.unlink(missing_ok=True)
        return
    fs, where = filesystem(path)
    info = fs.get_file_info(where)
    try:
        if info.type == pafs.FileType.Directory:
            fs.delete_dir(where)
        elif info.type == pafs.FileType.File:
            fs.delete_file(where)
    except OSError as exc:
        raise s3_write_error(exc, str(path)) from exc


def sha256_file(path: str | os.PathLike[str], chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file (local or ``s3://``), read in chunks."""
    digest = hashlib.sha256()
    if is_remote(path):
        fs, where = filesystem(path)
        with fs.open_input_stream(where, compression=None) as handle:
            while block := handle.read(chunk):
                digest.update(block)
        return digest.hexdigest()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def sha256_json(obj: Any) -> str:
    """Hex sha256 of the canonical JSON form of ``obj``."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
