"""The benchmark suite runs end to end in its quick mode and reports every row with real numbers.

It asserts the suite works, not how fast anything is: speed goals are ratios in the benchmark's
own table (README, Performance), never timed unit tests.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_quick_benchmark_writes_every_row(tmp_path):
    out = tmp_path / "bench.json"
    run = subprocess.run([sys.executable, "-m", "benchmarks.run", "--quick", "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    kinds = [row["benchmark"] for row in result["rows"]]
    assert kinds[0] == "data path" and "conversion peak RSS" in kinds and kinds[-2:] == ["time to accuracy", "tune stage, per trial"]
    data = result["rows"][0]
    assert data["rows"] == 4000 and data["baseline_s"] > 0 and data["ours_s"] > 0 and data["speedup"] > 0
    rss = result["rows"][1]
    assert rss["peak_rss_mb"] >= rss["rss_before_mb"] > 0 and rss["rows_per_s"] > 0
    overhead = result["rows"][2]
    assert overhead["benchmark"] == "fixed overhead" and overhead["prefect_server_and_ray_s"] > 0
    assert overhead["total_s"] >= overhead["ray_train_worker_group_s"] > 0
    parts = overhead["worker_group_parts"]  # the worker group split at the worker's start and the function's start
    assert set(parts) == {"to_worker_process_s", "worker_process_to_train_fn_s", "train_fn_to_fit_return_s"}
    assert all(v > 0 for v in parts.values()), parts  # in order: fit, worker process start, function start, return
    single, train = result["rows"][3], result["rows"][4]
    assert "single" in single["benchmark"] and single["ours_images_per_s"] > 0 and single["ratio"] > 0
    assert train["baseline_images_per_s"] > 0 and train["ours_images_per_s"] > 0 and train["ratio"] > 0
    assert train["ratio_to_single_mode"] > 0
    two = result["rows"][5]
    assert "2 workers" in two["benchmark"] and two["ours_images_per_s"] > 0 and two["ratio"] > 0
    reach = result["rows"][6]
    assert reach["epochs"] == 1 and len(reach["baseline_history"]) >= 1 and len(reach["ours_history"]) == 1
    assert 0 <= reach["ours_history"][0] <= 1 and reach["ours_stage_s"] > 0
    # Either side reaches the (quick) target or says it did not; a ratio only when both did.
    assert (reach["ratio"] is not None) == (reach["ours_s"] is not None and reach["baseline_s"] is not None)
    tuned = result["rows"][7]  # one trial of the default recipe against the training stage, same epochs
    assert tuned["epochs"] == 1 and tuned["baseline_s"] > 0 and tuned["ours_s"] > 0
    assert tuned["overhead_per_trial_s"] == round(tuned["ours_s"] - tuned["baseline_s"], 2)
    assert tuned["ratio"] == round(tuned["ours_s"] / tuned["baseline_s"], 3)
    assert "| tune stage, per trial | 1 trial, 1 epoch(s)" in run.stdout
    assert "| data path | 4,000 rows |" in run.stdout  # the printed table
