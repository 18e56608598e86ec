"""The scale benchmark in its quick mode: two folders through ``flows.train``, both over the in-memory budget,
each stage timed, the run's peak PSS split by process kind, the plain PIL loop beside it.

The memory check: the larger folder (20x the images, 146 MB of training pixels) streams in windows as the smaller
one does, and its run's peak memory stays within 1.3x of the smaller one's. Measured on a 2-core AMD EPYC (Zen 4),
one run each, with the smaller folder held in memory: 1.17x, 1.19x with only the streamed reader's blocks cut to a
window, 1.23x at Ray Data's default of 128 MB blocks; the code before the streamed path (every split under 512 MB of
Parquet held in memory, at about 20x its pixels over the run's processes, and evaluation's views scored at once)
1.54x (docs/performance.md, "Folders bigger than memory"). Since a run whose data fits starts no Ray Data at all
(docs/design.md), that comparison measured the streamed path's own processes (a Ray Data task worker of about 850 MB)
more than its growth: 1.36x (Zen 5); both folders now stream. How fast anything is, the benchmark reports; this
asserts a ratio measured in the same run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_a_folder_over_the_in_memory_budget_streams_with_flat_memory(tmp_path):
    out = tmp_path / "scale.json"
    run = subprocess.run([sys.executable, "-m", "benchmarks.data.scale", "--quick", "--out", str(out)],
                         check=False, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    sizes = result["sizes"]
    assert [row["images"] for row in sizes] == [200, 4_000]
    assert result["environment"]["cpu_cores"] >= 1 and "CPU:" in run.stdout
    small, large = sizes
    for row in sizes:  # 7 MB and 146 MB of training pixels, over the 1 MB budget: both stream
        assert row["streamed"].startswith("train") and "streamed in windows" in row["streamed"], row["streamed"]
    assert "test" in large["streamed"], large["streamed"]
    assert large["peak_pss_mb"] <= 1.3 * small["peak_pss_mb"], (large["at_peak_mb"], small["at_peak_mb"])
    assert result["peak_ratio"] == pytest.approx(large["peak_pss_mb"] / small["peak_pss_mb"], abs=0.001)
    for row in sizes:
        assert set(row["stages_s"]) >= {"download", "to-parquet", "transform", "train", "evaluate"}
        assert all(seconds > 0 for seconds in row["stages_s"].values()), row["stages_s"]
        assert row["peak_pss_mb"] > 0 and row["per_kind"]["driver (flows.train)"]["peak_sum_mb"] > 0
        assert any(kind.startswith("ray::") for kind in row["per_kind"]) and sum(row["at_peak_mb"].values()) > 0
        assert row["plain_loop"]["images"] == row["images"] and row["plain_loop"]["images_per_s"] > 0
    for factor, images in (("10x", 40_000), ("100x", 400_000)):
        assert result["estimates"][factor]["images"] == images
        assert result["estimates"][factor]["peak_pss_mb"] > 0 and result["estimates"][factor]["wall_s"] > 0
