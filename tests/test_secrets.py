"""Secrets never leave their variable (issue 47): a URL's user, password or token is never printed,
logged or stored, and an MLFLOW_TRACKING_URI the tracker cannot use is refused before any work.

All fast: the redaction helper, the closing lines and summary.json on a summary given such a URL,
a webhook that answers 404 on 127.0.0.1, and CLI refusals that exit before Prefect or Ray start.
"""

from __future__ import annotations

import http.server
import os
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest
from pydantic import ValidationError

from flows import mnist, train
from pipeline_config import PipelineConfig
from runner import console, hooks
from runner.pipeline_run import PipelineRun
from runner.summary import RunSummary, StageRecord
from runner.tracking_records import flat_params, tracking_uri
from storage_io import StorageLayout, has_credentials, redact_text, redact_url
from tests.support.cli import ROOT

SECRET = "s3cretpw"  # what must appear nowhere


@pytest.mark.parametrize(("url", "redacted"), [
    ("https://alice:s3cretpw@mlflow.example:5000/path", "https://***@mlflow.example:5000/path"),
    ("http://tok3n@127.0.0.1:9/", "http://***@127.0.0.1:9/"),
    ("https://host/data/?token=s3cretpw&page=2", "https://host/data/?token=***&page=2"),
    ("https://b.s3.amazonaws.com/k?X-Amz-Credential=AKIAS3CRET&X-Amz-Signature=s3cretpw&X-Amz-Expires=60",
     "https://b.s3.amazonaws.com/k?X-Amz-Credential=***&X-Amz-Signature=***&X-Amz-Expires=60"),
    ("https://acct.blob.core.windows.net/c/f?sv=2024&sig=s3cretpw", "https://acct.blob.core.windows.net/c/f?sv=2024&sig=***"),
    ("https://app/cb#access_token=s3cretpw&state=1", "https://app/cb#access_token=***&state=1"),
    ("https://host/p?api_key=s3cretpw&client_secret=s3cretpw&password=s3cretpw",
     "https://host/p?api_key=***&client_secret=***&password=***"),
])
def test_credentials_in_a_url_are_masked_and_the_rest_kept(url, redacted):
    assert redact_url(url) == redacted and has_credentials(url)


@pytest.mark.parametrize("url", [
    "http://127.0.0.1:5000", "https://mlflow.example/#/experiments/1/runs/abc", "s3://bucket/prefix",
    "file:///data/mnist/", "/local/folder?token=not-a-url", "https://host/p?page=2&sort=name",
])
def test_a_url_without_credentials_comes_back_unchanged(url):
    assert redact_url(url) == url and not has_credentials(url)


def test_every_url_in_a_message_is_redacted_and_a_hidden_host_masked_whole():
    message = ("input_value='http://alice:s3cretpw@127.0.0.1:9/' and \"https://h/x?token=s3cretpw\" "
               "then https://hooks.example/services/s3cretpw.")
    assert SECRET not in redact_text(message, hide_hosts=["hooks.example"])
    assert "http://***@127.0.0.1:9/" in redact_text(message) and "https://h/x?token=***" in redact_text(message)


def test_the_closing_lines_and_summary_json_never_show_a_password():
    tracking = {"uri": f"http://alice:{SECRET}@mlflow:5000", "url": f"http://alice:{SECRET}@mlflow:5000/#/experiments/1/runs/r",
                "experiment": "mnist", "run_id": "r", "not_recorded": ["test metrics"],
                "error": f"ConnectionError: cannot reach http://alice:{SECRET}@mlflow:5000/api/2.0"}
    summary = RunSummary(run_name="r1", storage_root="/tmp/root", tracking=tracking, status="failed",
                         stages={"download": StageRecord(status="failed", error=f"cannot download from https://m/?token={SECRET}")})
    error = RuntimeError(f"cannot reach http://bob:{SECRET}@mlflow:5000")
    lines = "\n".join(console.summary_lines(summary, error, 3.0, None, False, []))
    assert SECRET not in lines and "MLflow         http://***@mlflow:5000/#/experiments/1/runs/r" in lines
    assert "the server did not answer" not in lines and "MLflow failed: ConnectionError" in lines  # what happened, not a guess
    assert SECRET not in str(summary.to_json()) and summary.to_json()["tracking"]["uri"] == "http://***@mlflow:5000"


def test_mlflow_params_carry_no_credentials():
    params = flat_params({"download": {"mirror_url": f"https://alice:{SECRET}@m/"}, "note": f"see https://h/?sig={SECRET}"})
    assert SECRET not in str(params) and params["download.mirror_url"] == "https://***@m/"


@pytest.fixture
def webhook_404() -> Iterator[str]:
    """A real HTTP server on 127.0.0.1 that answers every POST with 404; yields a Slack-style URL, its secret in the path."""

    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/services/T000/B000/{SECRET}"
    finally:
        server.shutdown()


def test_a_failed_webhook_is_reported_without_its_url(webhook_404):
    with pytest.raises(Exception) as failed:
        hooks.post_webhook(webhook_404, {"text": "x"}, timeout_s=5)
    assert SECRET in str(failed.value)  # httpx names the URL: what the warning must not show
    said = hooks.webhook_error(failed.value, webhook_404)
    assert SECRET not in said and "404" in said and hooks.WEBHOOK_ENV in said


def test_the_webhook_variable_is_pipeline_s_and_the_old_name_is_still_read(monkeypatch, webhook_404):
    monkeypatch.delenv(hooks.WEBHOOK_ENV, raising=False)
    monkeypatch.delenv(hooks.OLD_WEBHOOK_ENV, raising=False)
    assert hooks.webhook_url() == ("", hooks.WEBHOOK_ENV)
    monkeypatch.setenv(hooks.OLD_WEBHOOK_ENV, " http://127.0.0.1:9/old ")
    assert hooks.webhook_url() == ("http://127.0.0.1:9/old", hooks.OLD_WEBHOOK_ENV)
    monkeypatch.setenv(hooks.WEBHOOK_ENV, "http://127.0.0.1:9/new")
    assert hooks.webhook_url() == ("http://127.0.0.1:9/new", hooks.WEBHOOK_ENV)  # the new name wins
    with pytest.raises(Exception) as failed:
        hooks.post_webhook(webhook_404, {"text": "x"})
    said = hooks.webhook_error(failed.value, webhook_404, hooks.OLD_WEBHOOK_ENV)
    assert SECRET not in said and hooks.OLD_WEBHOOK_ENV in said  # named by the variable it came from


def test_the_failure_report_does_not_repeat_a_refused_parameters_password():
    message = f"1 validation error: tracking.uri holds credentials [input_value='https://alice:{SECRET}@mlflow:5000']"
    report = hooks.failure_summary("witty-fox", message, None, {"config": {}})
    assert SECRET not in report["text"] and SECRET not in report["cause"] and "tracking.uri" in report["cause"]


@pytest.mark.parametrize(("uri", "named"), [
    (f"http://alice:{SECRET}@127.0.0.1:9/", "MLFLOW_TRACKING_PASSWORD"),
    ("file:///tmp/x", "a file: URI"),
    ("sqlite:///mlflow.db", "a sqlite: URI"),
    (f"https://mlflow.example/?token={SECRET}", "MLFLOW_TRACKING_TOKEN"),
])
def test_an_unusable_mlflow_tracking_uri_is_refused_naming_the_variable(monkeypatch, uri, named):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    with pytest.raises(ValueError, match="MLFLOW_TRACKING_URI") as refused:
        tracking_uri(PipelineConfig())
    assert named in str(refused.value) and SECRET not in str(refused.value)


def test_a_deployments_run_refuses_it_in_the_flows_own_preflight(monkeypatch, tmp_path):
    """What a served deployment's run does first (`PipelineRun`): refused before the run folder exists."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "file:///tmp/x")
    config = PipelineConfig.model_validate({"storage_root": str(tmp_path / "root"), "download": {"source": "sample"}})
    with pytest.raises(ValueError, match="MLFLOW_TRACKING_URI is a file: URI"):
        with PipelineRun(config, "flows.mnist", [], lambda _: pytest.fail("got past the preflight")):
            pytest.fail("got past the preflight")
    assert not (tmp_path / "root").exists()


def test_the_cli_refuses_credentials_in_mlflow_tracking_uri_with_exit_2_and_never_prints_them(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "flows.mnist", "--storage-root", str(tmp_path / "storage")], cwd=ROOT, capture_output=True,
        text=True, timeout=300, env={**_clean_env(), "MLFLOW_TRACKING_URI": f"http://user:{SECRET}@127.0.0.1:9/"},
    )
    assert out.returncode == 2 and "MLFLOW_TRACKING_URI holds credentials" in out.stderr
    assert "MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD" in out.stderr
    assert SECRET not in out.stdout + out.stderr and not (tmp_path / "storage").exists()


@pytest.mark.parametrize("cli", [mnist.main, train.main])
def test_the_cli_refuses_a_file_tracking_uri_with_exit_2_naming_the_variable(monkeypatch, capsys, tmp_path, cli):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "file:///tmp/x")
    assert cli(["--storage-root", str(tmp_path / "storage")]) == 2
    err = capsys.readouterr().err
    assert "MLFLOW_TRACKING_URI is a file: URI" in err and "unset MLFLOW_TRACKING_URI" in err
    assert not (tmp_path / "storage").exists()


@pytest.mark.parametrize("flag", [
    ["--tracking.uri", f"http://alice:{SECRET}@127.0.0.1:9/"],
    ["--download.source", "mirror", "--download.mirror-url", f"https://alice:{SECRET}@mirror.example/mnist/"],
    ["--download.source", "mirror", "--download.mirror-url", f"https://mirror.example/mnist/?token={SECRET}"],
])
def test_a_refused_flag_is_named_without_repeating_its_secret(capsys, tmp_path, flag):
    """Validation errors echo their input: the CLI prints them redacted."""
    assert mnist.main(["--storage-root", str(tmp_path / "storage"), *flag]) == 2
    err = capsys.readouterr().err
    assert flag[-2].lstrip("-").replace("-", "_") in err and SECRET not in err


@pytest.mark.parametrize("name", [f"token={SECRET}", f"run?access_token={SECRET}", "ghp_16C7e42F292c6912E7710c838347Ae178B4a/x"])
def test_a_refused_run_name_is_named_without_repeating_a_token_in_it(capsys, tmp_path, name):
    """Issue 66: ``--run-name token=...`` was refused with the token echoed twice (the message and pydantic's input)."""
    assert train.main(["--storage-root", str(tmp_path / "storage"), "--run-name", name]) == 2
    err = capsys.readouterr().err
    assert "run_name" in err and SECRET not in err and "16C7e42F292c6912E7710c838347Ae178B4a" not in err
    assert not (tmp_path / "storage").exists()  # refused before any work


def test_credentials_outside_urls_are_masked_and_other_assignments_kept():
    text = f"token={SECRET} page=2 monkey=banana client_secret={SECRET}; AKIAIOSFODNN7EXAMPLE xoxb-123456789012-abcdef"
    assert redact_text(text) == "token=*** page=2 monkey=banana client_secret=***; *** ***"
    assert redact_text("epoch=3 loss=0.25 https://h/x?token=***") == "epoch=3 loss=0.25 https://h/x?token=***"


def test_an_s3_endpoint_that_does_not_answer_is_named_without_its_credentials(monkeypatch):
    for name, value in {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_REGION": "us-east-1",
                        "AWS_ENDPOINT_URL": f"http://user:{SECRET}@127.0.0.1:9"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    with pytest.raises(ValueError, match="cannot reach the S3 endpoint http://\\*\\*\\*@127.0.0.1:9") as refused:
        StorageLayout.create("s3://bucket/prefix", "r1").check_reachable()
    assert SECRET not in str(refused.value)


def test_a_mirror_url_with_credentials_is_refused_naming_the_field():
    with pytest.raises(ValidationError, match="download.mirror_url holds credentials"):
        PipelineConfig.model_validate({"download": {"source": "mirror", "mirror_url": f"https://u:{SECRET}@m.example/"}})


def _clean_env() -> dict[str, str]:
    return {key: value for key, value in os.environ.items() if not key.startswith(("MLFLOW_", "MNIST_", "PIPELINE_"))}
