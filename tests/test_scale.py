"""The scale benchmark runs end to end in its quick mode: three folder sizes, each stage timed, the run's
peak PSS split by process kind, the plain PIL loop beside it, and the estimates at 10x and 100x.

It asserts the benchmark works, not how fast anything is (docs/performance.md holds the figures)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_quick_scale_benchmark_reports_every_size(tmp_path):
    out = tmp_path / "scale.json"
    run = subprocess.run([sys.executable, "-m", "benchmarks.scale", "--quick", "--out", str(out)],
                         check=False, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    sizes = result["sizes"]
    assert [row["images"] for row in sizes] == [200, 400, 800]
    assert result["environment"]["cpu_cores"] >= 1 and "CPU:" in run.stdout
    for row in sizes:
        assert set(row["stages_s"]) >= {"download", "to-parquet", "transform", "train", "evaluate"}
        assert all(seconds > 0 for seconds in row["stages_s"].values()), row["stages_s"]
        assert row["peak_pss_mb"] > 0 and row["per_kind"]["driver (flows.train)"]["peak_sum_mb"] > 0
        assert any(kind.startswith("ray::") for kind in row["per_kind"]) and sum(row["at_peak_mb"].values()) > 0
        assert row["plain_loop"]["images"] == row["images"] and row["plain_loop"]["images_per_s"] > 0
    for factor, images in (("10x", 8_000), ("100x", 80_000)):
        assert result["estimates"][factor]["images"] == images
        assert result["estimates"][factor]["peak_pss_mb"] > 0 and result["estimates"][factor]["wall_s"] > 0
