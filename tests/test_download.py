"""Download stage: real HTTP servers on loopback, real files, real checksums; no mocked HTTP.

Most tests call ``download.fn`` (the undecorated function) so they need no Prefect API.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import socket
import threading
import time
import urllib.error
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

import dataset.sources.mnist_files as dl
from dataset.sources.fetch import ChecksumMismatchError, DownloadError, SourceUnreachableError, is_transient
from dataset.sources.mnist_files import official_reachable
from pipeline_config.common import MNIST_FILES, SAMPLE_DIR
from pipeline_config.data import DownloadConfig, MirrorChecksums
from storage_io import StorageLayout, sha256_file
from tasks.download import download

SAMPLE_BYTES = {name: (SAMPLE_DIR / name).read_bytes() for name in MNIST_FILES}
SAMPLE_SHA256 = MirrorChecksums().by_file()
SAMPLE_MD5 = {name: hashlib.md5(data).hexdigest() for name, data in SAMPLE_BYTES.items()}
DROP = 0  # scripted "status" meaning: close the connection without answering
STALL = 1  # scripted "status" meaning: send headers and half the body, then go silent


class MirrorServer:
    """A real HTTP mirror on 127.0.0.1 serving ``files``, with scripted failures per file."""

    def __init__(self, files: dict[str, bytes]):
        self.files = dict(files)
        self.script: dict[str, list[int]] = {}  # file -> statuses to answer its next requests with
        self.log: list[tuple[str, int]] = []  # (file, status) of every request, in order
        lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep pytest output clean
                pass

            def do_GET(self):
                name = self.path.lstrip("/")
                with lock:
                    scripted = server.script.get(name)
                    status = scripted.pop(0) if scripted else (200 if name in server.files else 404)
                    server.log.append((name, status))
                if status == DROP:
                    return  # the server closes the socket: the client sees a reset/disconnect
                if status == STALL:
                    body = server.files[name]
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body[: len(body) // 2])
                    self.wfile.flush()
                    time.sleep(3)  # silent far longer than the client's read timeout
                    return
                if status != 200:
                    self.send_error(status)
                    return
                body = server.files[name]
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                try:
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # a client may hang up after the headers (torchvision's redirect check does)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.base_url = f"http://127.0.0.1:{self.httpd.server_port}/"

    def count(self, name: str) -> int:
        return sum(1 for logged, _ in self.log if logged == name)

    def statuses(self, name: str) -> list[int]:
        return [status for logged, status in self.log if logged == name]


@pytest.fixture
def mirror():
    server = MirrorServer(SAMPLE_BYTES)
    thread = threading.Thread(target=server.httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield server
    server.httpd.shutdown()
    server.httpd.server_close()
    thread.join(5)


@pytest.fixture
def layout(tmp_path):
    return StorageLayout(root=str(tmp_path / "storage"), run_name="t")


@pytest.fixture
def closed_port():
    """A loopback port nothing listens on: connections are refused at once."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch):
    # A proxy from the environment would route loopback requests and probes elsewhere.
    for var in ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)


def mirror_cfg(url: str, **overrides) -> DownloadConfig:
    return DownloadConfig(source="mirror", mirror_url=url, **({"attempts": 4, "backoff_s": 0.01} | overrides))


def mirror_dir(layout: StorageLayout, url: str) -> Path:
    return Path(layout.raw_dir("mirror-" + hashlib.sha256(url.encode()).hexdigest()[:12]))


def assert_sample_files(directory: Path) -> None:
    """Exactly the four sample files, byte for byte, and no temporary leftovers."""
    assert sorted(os.listdir(directory)) == sorted(MNIST_FILES)
    for name in MNIST_FILES:
        assert (directory / name).read_bytes() == SAMPLE_BYTES[name]


def test_http_mirror_downloads_and_verifies_all_four_files(mirror, layout):
    raw = download.fn(mirror_cfg(mirror.base_url), layout)

    assert raw.source == "mirror"
    assert raw.url == mirror.base_url
    assert raw.skipped is False
    assert raw.directory == str(mirror_dir(layout, mirror.base_url))
    assert raw.files == SAMPLE_SHA256
    assert_sample_files(Path(raw.directory))
    assert {name for name, _ in mirror.log} == set(MNIST_FILES)
    assert all(status == 200 for _, status in mirror.log)


def test_corrupted_file_is_rejected_and_never_lands(mirror, layout):
    name = "train-labels-idx1-ubyte.gz"
    corrupted = bytearray(SAMPLE_BYTES[name])
    corrupted[20] ^= 0xFF
    mirror.files[name] = bytes(corrupted)

    with pytest.raises(ChecksumMismatchError) as failure:
        download.fn(mirror_cfg(mirror.base_url), layout)

    message = str(failure.value)
    assert name in message
    assert mirror.base_url + name in message
    assert SAMPLE_SHA256[name] in message  # expected
    assert hashlib.sha256(corrupted).hexdigest() in message  # actual
    directory = mirror_dir(layout, mirror.base_url)
    assert not (directory / name).exists()
    # The file before it is complete and verified; nothing else (no temporary file) is left.
    assert os.listdir(directory) == ["train-images-idx3-ubyte.gz"]
    # A checksum mismatch is not retried: fetched as often as a file that took one attempt.
    assert mirror.count(name) == mirror.count("train-images-idx3-ubyte.gz")


@pytest.mark.parametrize("script", [[500, 503], [DROP, 502]], ids=["http-5xx", "connection-dropped"])
def test_transient_failures_are_retried_until_the_download_succeeds(mirror, layout, caplog, script):
    name = "t10k-images-idx3-ubyte.gz"
    mirror.script[name] = list(script)

    with caplog.at_level(logging.WARNING, logger="tasks.download"):
        raw = download.fn(mirror_cfg(mirror.base_url, attempts=4, backoff_s=0.01), layout)

    assert mirror.statuses(name)[:2] == script  # the server saw both failing requests...
    assert mirror.statuses(name)[2:] and set(mirror.statuses(name)[2:]) == {200}  # ...then served it
    assert raw.files == SAMPLE_SHA256
    assert_sample_files(Path(raw.directory))
    retries = [r.getMessage() for r in caplog.records if "retrying" in r.getMessage()]
    assert len(retries) == 2 and all(name in message for message in retries)


def test_persistent_5xx_gives_up_after_the_configured_attempts(mirror, layout):
    name = "train-images-idx3-ubyte.gz"
    mirror.script[name] = [500] * 10

    with pytest.raises(DownloadError) as failure:
        download.fn(mirror_cfg(mirror.base_url, attempts=3, backoff_s=0.01), layout)

    message = str(failure.value)
    assert mirror.base_url + name in message and "HTTP 500" in message and "3 attempts" in message
    assert mirror.count(name) == 3
    assert not (mirror_dir(layout, mirror.base_url) / name).exists()


def test_404_fails_at_once_without_retrying(mirror, layout):
    name = "t10k-labels-idx1-ubyte.gz"
    del mirror.files[name]

    with pytest.raises(DownloadError) as failure:
        download.fn(mirror_cfg(mirror.base_url, attempts=4, backoff_s=5), layout)  # a retry would take 5 s

    message = str(failure.value)
    assert mirror.base_url + name in message and "HTTP 404" in message and "not retried" in message
    assert mirror.count(name) == 1
    assert not (mirror_dir(layout, mirror.base_url) / name).exists()


def test_second_run_is_skipped_without_any_request(mirror, layout):
    cfg = mirror_cfg(mirror.base_url)
    first = download.fn(cfg, layout)
    mirror.log.clear()

    second = download.fn(cfg, layout)

    assert second.skipped is True
    assert mirror.log == []
    assert second.files == first.files == SAMPLE_SHA256
    assert second.directory == first.directory
    assert_sample_files(Path(second.directory))


def test_present_file_with_wrong_checksum_is_downloaded_again(mirror, layout, caplog):
    cfg = mirror_cfg(mirror.base_url)
    directory = Path(download.fn(cfg, layout).directory)
    name = "train-images-idx3-ubyte.gz"
    (directory / name).write_bytes(b"not the real file")
    mirror.log.clear()

    with caplog.at_level(logging.WARNING, logger="tasks.download"):
        raw = download.fn(cfg, layout)

    assert raw.skipped is False
    assert {logged for logged, _ in mirror.log} == {name}  # only the bad file was fetched again
    assert raw.files == SAMPLE_SHA256
    assert_sample_files(directory)
    assert any(name in r.getMessage() and "does not match" in r.getMessage() for r in caplog.records)


def test_file_mirror_is_copied_and_verified(tmp_path, layout):
    source = tmp_path / "local mirror"  # a space, to exercise URL quoting
    shutil.copytree(SAMPLE_DIR, source, ignore=shutil.ignore_patterns("*.py"))
    cfg = mirror_cfg(source.as_uri())

    raw = download.fn(cfg, layout)

    assert cfg.mirror_url == source.as_uri() + "/"
    assert (raw.source, raw.url, raw.skipped) == ("mirror", cfg.mirror_url, False)
    assert raw.directory == str(mirror_dir(layout, cfg.mirror_url))
    assert raw.files == SAMPLE_SHA256
    assert_sample_files(Path(raw.directory))


def test_file_mirror_missing_a_file_fails_clearly(tmp_path, layout):
    source = tmp_path / "partial"
    source.mkdir()
    for name in MNIST_FILES[:2]:
        shutil.copy(SAMPLE_DIR / name, source / name)

    with pytest.raises(DownloadError) as failure:
        download.fn(mirror_cfg(source.as_uri(), backoff_s=5), layout)

    assert MNIST_FILES[2] in str(failure.value) and "not retried" in str(failure.value)
    assert sorted(os.listdir(mirror_dir(layout, source.as_uri() + "/"))) == sorted(MNIST_FILES[:2])


def test_sample_source_uses_the_bundled_files_and_their_pinned_checksums(layout):
    # mirror_sha256 describes a mirror, not the sample: the sample keeps its own checksums.
    other = MirrorChecksums(train_images="0" * 64)
    raw = download.fn(DownloadConfig(source="sample", mirror_sha256=other), layout)

    assert (raw.source, raw.url, raw.skipped) == ("sample", SAMPLE_DIR.as_uri() + "/", False)
    assert raw.directory == str(layout.raw_dir("sample"))
    assert raw.files == SAMPLE_SHA256
    assert_sample_files(Path(raw.directory))


def test_auto_falls_back_to_the_sample_with_a_warning_when_offline(layout, closed_port, monkeypatch, caplog):
    monkeypatch.setattr(dl, "OFFICIAL_MIRRORS", (f"http://127.0.0.1:{closed_port}/mnist/",))
    start = time.monotonic()

    with caplog.at_level(logging.WARNING, logger="tasks.download"):
        raw = download.fn(DownloadConfig(source="auto", connect_timeout_s=2), layout)

    assert time.monotonic() - start < 5
    assert raw.source == "sample"
    assert raw.directory == str(layout.raw_dir("sample"))
    assert raw.files == SAMPLE_SHA256
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("falling back" in m and "5,000-digit sample" in m for m in warnings)


def test_probe_is_bounded_by_its_timeout_even_for_dns(mirror, closed_port):
    # .invalid never resolves (RFC 6761) and 192.0.2.1 is unroutable (RFC 5737): whether they
    # fail fast or hang in DNS / SYN retries, the probe must give up within its timeout.
    start = time.monotonic()
    assert official_reachable(0.5, ["https://mnist-probe.invalid/", "http://192.0.2.1:81/"]) is None
    assert time.monotonic() - start < 1.5
    # Preference order: a refused first mirror hands over to the next one that answers.
    assert official_reachable(2, [f"http://127.0.0.1:{closed_port}/", mirror.base_url]) == mirror.base_url


def test_official_unreachable_fails_with_a_clear_error(layout, closed_port, monkeypatch):
    unreachable = f"http://127.0.0.1:{closed_port}/mnist/"
    monkeypatch.setattr(dl, "OFFICIAL_MIRRORS", (unreachable,))

    with pytest.raises(SourceUnreachableError) as failure:
        download.fn(DownloadConfig(source="official", connect_timeout_s=1), layout)

    message = str(failure.value)
    assert "unreachable" in message and unreachable in message
    for hint in ("download.source=auto", "download.source=sample", "download.source=mirror"):
        assert hint in message
    assert not Path(layout.raw_dir("official")).exists()


def test_official_source_verifies_md5_and_records_sha256(mirror, layout, closed_port, monkeypatch):
    # Stand-in for the official mirrors: the loopback server, with md5s of what it serves.
    monkeypatch.setattr(dl, "OFFICIAL_MIRRORS", (f"http://127.0.0.1:{closed_port}/", mirror.base_url))
    monkeypatch.setattr(dl, "OFFICIAL_MD5", SAMPLE_MD5)

    raw = download.fn(DownloadConfig(source="official", backoff_s=0.01), layout)

    assert (raw.source, raw.url, raw.skipped) == ("official", mirror.base_url, False)
    assert raw.directory == str(layout.raw_dir("official"))
    assert raw.files == SAMPLE_SHA256
    assert_sample_files(Path(raw.directory))

    # auto re-run while offline: the verified official copy is reused without probing.
    monkeypatch.setattr(dl, "OFFICIAL_MIRRORS", (f"http://127.0.0.1:{closed_port}/",))
    mirror.log.clear()
    again = download.fn(DownloadConfig(source="auto"), layout)
    assert (again.source, again.skipped, again.files) == ("official", True, SAMPLE_SHA256)
    assert mirror.log == []


def test_official_md5_mismatch_is_rejected(mirror, layout, monkeypatch):
    name = "train-labels-idx1-ubyte.gz"
    monkeypatch.setattr(dl, "OFFICIAL_MIRRORS", (mirror.base_url,))
    monkeypatch.setattr(dl, "OFFICIAL_MD5", SAMPLE_MD5 | {name: "0" * 32})

    with pytest.raises(ChecksumMismatchError) as failure:
        download.fn(DownloadConfig(source="official"), layout)

    message = str(failure.value)
    assert f"expected md5 {'0' * 32}" in message and SAMPLE_MD5[name] in message and name in message
    assert not (Path(layout.raw_dir("official")) / name).exists()


@pytest.mark.parametrize(
    ("error", "transient"),
    [
        (urllib.error.HTTPError("http://x/f", 503, "Service Unavailable", {}, None), True),
        (urllib.error.HTTPError("http://x/f", 404, "Not Found", {}, None), False),
        (urllib.error.HTTPError("http://x/f", 403, "Forbidden", {}, None), False),
        (urllib.error.URLError(ConnectionRefusedError(111, "refused")), True),
        (urllib.error.URLError(TimeoutError("timed out")), True),
        (urllib.error.URLError(socket.gaierror(socket.EAI_AGAIN, "try again")), True),
        (urllib.error.URLError(socket.gaierror(socket.EAI_NONAME, "unknown host")), False),
        (urllib.error.URLError("unknown url type: ftp"), False),
        (ConnectionResetError(104, "reset"), True),
        (FileNotFoundError(2, "missing"), False),
    ],
)
def test_transient_error_classification(error, transient):
    assert is_transient(error) is transient


def test_task_is_named_and_documented_for_the_prefect_ui():
    assert download.name == "download"
    doc = download.fn.__doc__.strip()
    assert doc and "\n" not in doc
    assert sha256_file(SAMPLE_DIR / MNIST_FILES[0]) == SAMPLE_SHA256[MNIST_FILES[0]]  # pinned defaults hold


def test_stalled_server_times_out_and_is_retried(mirror, layout, caplog):
    name = "train-images-idx3-ubyte.gz"
    # Two: torchvision's redirect check is a GET of its own that reads only the headers.
    mirror.script[name] = [STALL, STALL]
    start = time.monotonic()
    raw = download.fn(mirror_cfg(mirror.base_url, read_timeout_s=0.5), layout)
    assert time.monotonic() - start < 10  # never waits for the stalled server to finish
    assert mirror.statuses(name).count(STALL) == 2 and mirror.statuses(name)[-1] == 200
    assert any("timed out" in r.getMessage() and name in r.getMessage() for r in caplog.records)
    assert raw.files == SAMPLE_SHA256
    assert_sample_files(Path(raw.directory))


def test_server_that_always_stalls_fails_with_a_timeout(mirror, layout):
    name = "t10k-labels-idx1-ubyte.gz"
    mirror.script[name] = [STALL] * 4  # each attempt is two GETs (see above)
    with pytest.raises(DownloadError, match="timed out.*gave up after 2 attempts"):
        download.fn(mirror_cfg(mirror.base_url, read_timeout_s=0.3, attempts=2), layout)
    assert not (mirror_dir(layout, mirror.base_url) / name).exists()
