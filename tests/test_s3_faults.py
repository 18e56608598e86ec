"""An ``s3://`` storage root that turns read-only or fills up in the middle of a stage.

The object-store counterpart of tests/test_disk_faults.py. Between the code and moto's S3 server
sits a small HTTP proxy on 127.0.0.1 (below) that forwards every request unchanged until the test
arms it; from then on it answers writes the way real servers refuse them: ``403 AccessDenied``
(AWS and MinIO, a bucket policy that denies writes or credentials without write access) or
``507 XMinioStorageFull`` (MinIO with full drives). Reads always go through. The tests check that
the stage fails with a `StorageWriteError` naming the object, that the last good build still
verifies and the half-uploaded one is never trusted, and that the same stage completes once the
store takes writes again.
"""

from __future__ import annotations

import http.client
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from dataset.formats.parquet import verify_manifest
from dataset.sources.interface import RawData
from pipeline_config import ParquetConfig
from storage_io import (
    StorageLayout,
    StorageWriteError,
    atomic_write_json,
    file_lock,
    join,
    read_json,
    storage_writes,
)
from tasks.to_parquet import dataset_fingerprint, to_parquet
from tests.support.digits import write_raw
from tests.support.s3 import S3_TEST_ENV, s3_bucket, unique_bucket_name

GOOD = ParquetConfig(rows_per_file=64, rows_per_group=64, validation_every=4)
OTHER = ParquetConfig(rows_per_file=128, rows_per_group=64, validation_every=4)  # another fingerprint

REFUSALS = {
    "read-only": (403, "AccessDenied", "Access Denied"),
    "full": (507, "XMinioStorageFull", "Storage backend has reached its minimum free drive threshold."),
}
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "expect", "proxy-connection", "te", "upgrade"}


class FaultProxy(ThreadingHTTPServer):
    """Forwards S3 requests to ``upstream``; once armed, refuses writes after ``allowed`` more of them."""

    daemon_threads = True

    def __init__(self, upstream: str):
        super().__init__(("127.0.0.1", 0), _ProxyHandler)
        self.upstream = urllib.parse.urlsplit(upstream).netloc
        self.mode: str | None = None
        self.allowed = 0
        self.refused: list[str] = []  # "METHOD path" of every refused request
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def arm(self, mode: str | None, allowed: int = 0) -> None:
        """Refuse writes as ``mode`` ("read-only", "full") after ``allowed`` more writes; None: forward all."""
        with self.lock:
            self.mode, self.allowed = mode, allowed

    def refuse(self, method: str, path: str) -> tuple[int, str, str] | None:
        if method not in ("PUT", "POST", "DELETE"):
            return None
        with self.lock:
            if self.mode is None or (self.mode == "full" and method == "DELETE"):  # a full store still deletes
                return None
            if self.allowed > 0:
                self.allowed -= 1
                return None
            self.refused.append(f"{method} {path}")
            return REFUSALS[self.mode]


class _ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the AWS SDKs expect

    def log_message(self, *args) -> None:
        pass

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16):
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            while self.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers
                pass
            return b"".join(chunks)
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _handle(self) -> None:
        server: FaultProxy = self.server  # type: ignore[assignment]
        body = self._body()
        refusal = server.refuse(self.command, self.path)
        if refusal is not None:
            status, code, message = refusal
            payload = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
                       f"<Message>{message}</Message><Resource>{self.path}</Resource></Error>").encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            return
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
        if body or self.command in ("PUT", "POST"):
            headers["Content-Length"] = str(len(body))
        upstream = http.client.HTTPConnection(server.upstream, timeout=60)
        try:
            upstream.request(self.command, self.path, body=body, headers=headers)
            response = upstream.getresponse()
            data = response.read()
            self.send_response(response.status, response.reason)
            for key, value in response.getheaders():
                if key.lower() not in HOP_BY_HOP and key.lower() != "content-length":
                    self.send_header(key, value)
            length = response.getheader("Content-Length") if self.command == "HEAD" else str(len(data))
            self.send_header("Content-Length", length or "0")
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)
        finally:
            upstream.close()

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _handle


@pytest.fixture
def proxied_root(s3_server, monkeypatch, request):
    """(storage root through the fault proxy, the proxy): a fresh bucket, the AWS_* env pointing at the proxy."""
    proxy = FaultProxy(s3_server)
    thread = threading.Thread(target=proxy.serve_forever, daemon=True)
    thread.start()
    for key, value in S3_TEST_ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    root = s3_bucket(s3_server, unique_bucket_name(request)) + "/mnist"
    try:
        yield root, proxy
    finally:
        proxy.shutdown()
        proxy.server_close()


@pytest.mark.parametrize("mode", ["read-only", "full"])
def test_an_s3_root_that_refuses_writes_mid_conversion_fails_cleanly_and_a_rerun_completes(tmp_path, proxied_root, mode):
    root, proxy = proxied_root
    raw_dir = tmp_path / "raw"
    raw = RawData(**write_raw(raw_dir, n_train=240, n_test=80))
    layout = StorageLayout.create(root, "faults")
    good = to_parquet.fn(raw, GOOD, layout)
    assert verify_manifest(good.directory, good.fingerprint) is not None

    # The build lock and the first Parquet object (a multipart upload: start, part, complete) go
    # through, then the store says no.
    proxy.arm(mode, allowed=4)
    reason = "refuses writes" if mode == "read-only" else "storage root is full"
    with pytest.raises(StorageWriteError, match=rf"to-parquet: cannot write {root}/datasets/mnist-\w+/\S+\.parquet: .*{reason}") as info:
        to_parquet.fn(raw, OTHER, layout)
    assert "run again with the same --run-name" in str(info.value)
    assert ".parquet" in proxy.refused[0], proxy.refused  # refused mid-build, after the lock was taken
    with pytest.raises(StorageWriteError, match=rf"summary: cannot write {layout.summary_path}: .*{reason}"):
        with storage_writes("summary"):
            atomic_write_json(layout.summary_path, {"status": "failed"})

    proxy.arm(None)  # the store takes writes again
    assert verify_manifest(good.directory, good.fingerprint) is not None  # the last good build is intact
    half = layout.dataset_dir(dataset_fingerprint(raw, OTHER))
    assert verify_manifest(half, dataset_fingerprint(raw, OTHER)) is None  # the half-uploaded build has no manifest
    other = to_parquet.fn(raw, OTHER, layout)  # the same stage completes (a lock left behind is broken)
    assert not other.skipped and other.directory == half
    assert verify_manifest(other.directory, other.fingerprint) is not None
    assert other.rows == good.rows
    assert read_json(layout.summary_path) is None  # the refused summary write left nothing


def test_a_lock_left_by_a_failed_release_in_this_process_is_broken(proxied_root):
    """The bucket turns read-only while a build holds its lock: the release fails, the next taker breaks it."""
    root, proxy = proxied_root
    layout = StorageLayout.create(root, "locks")
    with pytest.raises(RuntimeError, match="the build failed"):
        with file_lock(layout, "dataset-x", timeout_s=5):
            proxy.arm("read-only")  # the release (a DELETE) is refused; the build's own error still surfaces
            raise RuntimeError("the build failed")
    proxy.arm(None)
    assert read_json(join(root, "locks", "dataset-x.lock")) is not None  # left behind ...
    with file_lock(layout, "dataset-x", timeout_s=5):  # ... and taken over at once, not after the timeout
        holder = read_json(join(root, "locks", "dataset-x.lock"))
        assert holder["token"]
    assert read_json(join(root, "locks", "dataset-x.lock")) is None
