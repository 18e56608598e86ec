"""Issue 60: every refusal masks, every image folder says what it passed over, exit 2 leaves nothing.

All fast and in-process where the real thing runs there: the CLI's own ``main`` on real flags (and
once as a command in a process of its own), real PNGs written with PIL, a real storage root on
tmp_path. A CLI run that gets past its checks would start Prefect and Ray; a tripwire in their place
fails the test instead.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from flows import mnist
from pipeline_config import PipelineConfig
from storage_io import redact_error, redact_text, redact_url
from storage_io.redact import _SECRET_NAMES, _SECRET_PARTS
from tests.support.cli import ROOT

# What must appear nowhere, not even in part: no four characters of it in a row.
TOKEN = "Qz9Xk2Vw7Jm4Pq8Yt5Rn3Hb6"


def leaked(text: str, secret: str = TOKEN, least: int = 4) -> list[str]:
    """Every piece of ``secret`` of ``least`` characters or more that ``text`` holds."""
    return [secret[i:i + least] for i in range(len(secret) - least + 1) if secret[i:i + least] in text]


def _clean_env() -> dict[str, str]:
    return {key: value for key, value in os.environ.items() if not key.startswith(("MLFLOW_", "MNIST_", "PIPELINE_"))}


# -- 3. One redaction, before any shortening -------------------------------------------------------------------------

def test_the_cli_refuses_a_mirror_url_with_a_token_without_printing_any_of_it(tmp_path):
    """The command as a user types it: pydantic shortens the value it echoes to about 50 characters by
    cutting out its middle; the '?access_token=' went and the token's tail was printed."""
    url = f"https://mirror.example/mnist/?access_token={TOKEN}"
    out = subprocess.run(
        [sys.executable, "-m", "flows.mnist", "--storage-root", str(tmp_path / "storage"), "--download.mirror-url", url],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=_clean_env(),
    )
    assert out.returncode == 2, out.stderr
    assert "download.mirror_url" in out.stderr and "access_token=***" in out.stderr
    assert leaked(out.stdout + out.stderr) == [] and not (tmp_path / "storage").exists()


SECRET_NAMES = sorted({*_SECRET_NAMES, *_SECRET_PARTS, "access_token", "X-Amz-Signature", "client_secret"})


@pytest.mark.parametrize("name", SECRET_NAMES)
@pytest.mark.parametrize("where", ["?", "#", "?page=2&", "#state=1&"])
def test_no_part_of_a_credential_parameter_is_printed_whatever_its_name(capsys, tmp_path, name, where):
    url = f"https://mirror.example/a/long/path/to/the/mnist/files/{where}{name}={TOKEN}"
    assert mnist.main(["--storage-root", str(tmp_path / "storage"), "--download.mirror-url", url]) == 2
    out = capsys.readouterr()
    assert "download.mirror_url" in out.err and leaked(out.out + out.err) == [], out.err


@pytest.mark.parametrize("flag", ["--tracking.uri", "--download.mirror-url"])
@pytest.mark.parametrize("tail", [f"#{TOKEN}", f"?{TOKEN}", f"/#{TOKEN}"])
def test_a_bare_fragment_or_query_is_masked(capsys, tmp_path, flag, tail):
    """``https://host:5000/#token``: a value without a name is a token as likely as not."""
    assert mnist.main(["--storage-root", str(tmp_path / "storage"), flag, f"https://mlflow.example:5000{tail}"]) == 2
    out = capsys.readouterr()
    assert flag.lstrip("-").replace("-", "_") in out.err and leaked(out.out + out.err) == [], out.err


@pytest.mark.parametrize(("url", "redacted"), [
    ("https://host:5000/#s3cretpw", "https://host:5000/#***"),
    ("https://host/p?s3cretpw", "https://host/p?***"),
    ("https://host/p?page=2&s3cretpw", "https://host/p?page=2&***"),
])
def test_redact_url_masks_a_bare_value_and_keeps_a_route(url, redacted):
    assert redact_url(url) == redacted
    assert redact_url("https://mlflow.example/#/experiments/1/runs/abc") == "https://mlflow.example/#/experiments/1/runs/abc"


def test_a_validation_error_is_redacted_before_pydantic_shortens_it():
    """Any input: a field's string, and a whole section echoed by a model-level error."""
    url = f"https://mirror.example/mnist/?access_token={TOKEN}"
    with pytest.raises(ValidationError) as refused:
        PipelineConfig.model_validate({"download": {"source": "mirror", "mirror_url": url}, "train": {"epochs": 0}})
    assert leaked(redact_text(str(refused.value)))  # what the CLI printed before: a tail of the token
    text = redact_error(refused.value)
    assert leaked(text) == [] and "access_token=***" in text
    assert "train.epochs" in text and "greater than or equal to 1" in text  # every other error as pydantic words it
    assert redact_error(ValueError(f"see {url}")) == "see https://mirror.example/mnist/?access_token=***"


def test_a_whole_section_echoed_by_a_model_level_error_is_redacted_too():
    url = f"https://mirror.example/a/long/path/?sig={TOKEN}"
    error = ValidationError.from_exception_data("PipelineConfig", [
        {"type": "value_error", "loc": ("download",), "input": {"source": "mirror", "mirror_url": url},
         "ctx": {"error": ValueError(f"download: {url} is refused")}},
    ])
    assert leaked(str(error)) and leaked(redact_error(error)) == []
