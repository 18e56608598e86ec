"""The served champion's benchmark row (`benchmarks.serve`): its load figures from a real HTTP server, its table line, and
``python -m benchmarks.run --only served --quick`` end to end. Speed is the row's figures, never asserted here."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from benchmarks.serve import load
from benchmarks.table import format_table

ROOT = Path(__file__).resolve().parent.parent


class Echo(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # kept alive, as the served endpoint keeps its connections

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["content-length"]))
        status = 500 if body == b"fail" else 200
        self.send_response(status)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def echo_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Echo)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_percentile_interpolates_between_ranks():
    assert load.percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert load.percentile([1.0, 2.0], 50) == 1.5 and load.percentile([1.0, 2.0], 99) == pytest.approx(1.99)
    assert load.percentile([5.0], 99) == 5.0


def test_sequential_and_concurrent_load_count_every_request(echo_url):
    seq = load.sequential(echo_url, [b"a", b"b"], "image/png", 7)
    assert seq["requests"] == 7 and seq["requests_per_s"] > 0 and 0 < seq["p50_ms"] <= seq["p99_ms"]
    conc = load.concurrent(echo_url, [b"a", b"b", b"c"], "application/json", clients=4, per_client=3)
    assert conc["clients"] == 4 and conc["requests"] == 12 and conc["requests_per_s"] > 0
    both = load.medians([conc, conc | {"requests_per_s": 2 * conc["requests_per_s"]}], batch=32)
    assert both["requests"] == 24 and both["images_per_s"] == pytest.approx(both["requests_per_s"] * 32, abs=0.1)
    with pytest.raises(RuntimeError, match="500"):
        load.sequential(echo_url, [b"fail"], "image/png", 1)
    with pytest.raises(RuntimeError, match="clients failed"):
        load.concurrent(echo_url, [b"fail"], "image/png", clients=2, per_client=1)


def served_row() -> dict:
    figures = {"requests": 10, "requests_per_s": 50.0, "p50_ms": 20.0, "p99_ms": 40.0, "mean_ms": 21.0, "images_per_s": 50.0}
    return {"benchmark": "served champion", "model": "resnet18", "rounds": 3, "batch": 32, "server_start_s": 12.5,
            "baseline_s": {"32": 10.0, "256": 12.0}, "baseline_images_per_s": {"32": 3.2, "256": 21.3},
            "served": {"batch_1": {"sequential": figures, "concurrent": figures | {"clients": 4}},
                       "batch_32": {"sequential": figures, "concurrent": figures | {"clients": 4, "images_per_s": 1600.0}}},
            "ratio": 75.12, "latency_ratio": 500.0, "goal": "(reported)"}


def test_the_table_line_names_both_sides():
    line = format_table([served_row()]).splitlines()[-1]
    assert line.startswith("| served champion (`python -m deployments.serve_model`) | resnet18") and line.count("|") == 7
    assert "`flows.predict`: 32 images 10.0 s (3.2 img/s), 256 images 12.0 s (21.3 img/s)" in line
    assert "batch 32: p50 20.0 ms, p99 40.0 ms; 4 clients 50.0 req/s (1600.0 img/s)" in line and "75.12x" in line


@pytest.mark.slow
def test_quick_served_row_runs_alone(tmp_path):
    out = tmp_path / "served.json"
    run = subprocess.run([sys.executable, "-m", "benchmarks.run", "--only", "served", "--quick", "--out", str(out)],
                         check=False, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["mode"] == "quick" and result["device"] and len(result["suite_wall_s_per_row"]) == 1
    (row,) = result["rows"]
    assert row["benchmark"] == "served champion" and row["model"] == "training.model.catalog:small_cnn"
    assert list(row["baseline_s"]) == ["32"] and row["baseline_s"]["32"] > 0 and row["server_start_s"] > 0
    for batch, per_request in (("batch_1", 1), ("batch_32", 32)):
        seq, conc = row["served"][batch]["sequential"], row["served"][batch]["concurrent"]
        assert seq["requests"] > 0 and 0 < seq["p50_ms"] <= seq["p99_ms"] and conc["clients"] == 4
        assert conc["images_per_s"] == pytest.approx(conc["requests_per_s"] * per_request, abs=0.1)
    assert row["same_answers"] is True  # the served classes of the first 32 digits are flows.predict's
    assert row["ratio"] == pytest.approx(row["ours_images_per_s"] / row["baseline_images_per_s"]["32"], rel=0.05)
    assert "| served champion (`python -m deployments.serve_model`) |" in run.stdout
