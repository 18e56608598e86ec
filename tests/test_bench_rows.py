"""The start-up benchmark's rows (`benchmarks.start.startup`): what its parsers make of real terminal lines, importtime
output and /proc files, and its quick mode end to end. Speed and memory goals are the benchmark's rows, never asserted here."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from benchmarks.start import startup
from tests.support.cli import ROOT

# What a run's terminal says (README, "What you will see"), with each line's arrival time.
LINES = [
    (100.0, "MNIST pipeline: run mnist-20261126-160717-17ed83 -> /tmp/storage/runs/mnist-20261126-160717-17ed83"),
    (107.0, "Ray: local cluster, dashboard at http://127.0.0.1:8265 while the run lasts"),
    (112.0, "16:07:25.659 | INFO | [1/7] download ..."),
    (114.5, "16:07:30.486 | INFO | [1/7] download done in 2.5s: sample data"),
    (114.6, "16:07:30.488 | INFO | [2/7] to-parquet ..."),
    (115.0, "16:07:30.608 | INFO | [2/7] to-parquet done in 0.4s: 3,800 train / 200 validation / 1,000 test rows"),
    (115.5, "16:07:31.282 | INFO | [3/7] transform ..."),
    (118.0, "16:07:35.011 | INFO | [3/7] transform done in 2.5s"),
    (118.2, "16:07:35.014 | INFO | [4/7] train ... 1 epoch(s)"),
    (140.0, "16:07:53.047 | INFO | epoch 1/1  loss 1.398  val acc 72.50%  532 img/s  18.0s elapsed"),
    (141.0, "16:07:54.178 | INFO | [4/7] train done in 22.8s: best validation accuracy 72.50%"),
]


def test_stage_marks_come_from_the_stage_lines_only():
    marks = startup.stage_marks(LINES)
    assert list(marks) == ["download", "to-parquet", "transform", "train"]
    assert marks["download"] == {"start": 112.0, "end": 114.5} and marks["train"] == {"start": 118.2, "end": 141.0}
    retried = startup.stage_marks([*LINES[:3], (113.0, "| [1/7] download ..."), (116.0, "| [1/7] download done in 1s")])
    assert retried["download"] == {"start": 112.0, "end": 116.0}  # a retry keeps the stage's first start


def test_first_step_parts_add_up_to_the_total():
    out = startup.first_step_parts(95.0, startup.stage_marks(LINES), attempt_at=128.2, first_step_at=131.0)
    parts = out["parts"]
    assert out["to_first_step_s"] == 36.0
    assert parts == {"before_first_stage_s": 17.0, "download_s": 2.5, "to-parquet_s": 0.4, "transform_s": 2.5,
                     "between_stages_s": 0.8, "worker_group_s": 10.0, "first_batch_s": 2.8}
    assert sum(parts.values()) == pytest.approx(out["to_first_step_s"])


def test_importtime_gives_each_top_level_package_at_its_first_import():
    stderr = "\n".join([
        "import time: self [us] | cumulative | imported package",
        "import time:       120 |        120 |   _io",
        "import time:      2000 |      50000 |     torch._C",
        "import time:      3000 |    1400000 |   torch",
        "import time:       500 |     700000 | prefect",
        "import time:        90 |      90000 |       torch",  # a second mention: not the first import
        "import time:       100 |       1000 | flows",
        "import time:        10 |    3000000 | flows.mnist",
        "some other stderr line | with | bars",
    ])
    assert startup.parse_importtime(stderr) == {"torch": 1.4, "prefect": 0.7, "flows": 0.001, "_io": 0.0}


def test_importtime_of_a_real_module():
    out = startup.import_seconds("sqlite3", top=50)  # not imported at an interpreter's start
    assert out["module"] == "sqlite3" and out["wall_s"] > 0 and out["packages_s"]["sqlite3"] > 0


def test_cpu_seconds_read_from_a_real_stat_line():
    stat = f"1234 (ray::IDLE (x) y) S 1 2 3 4 5 6 7 8 9 10 {3 * os.sysconf('SC_CLK_TCK')} {os.sysconf('SC_CLK_TCK')} 0 0"
    assert startup.cpu_seconds(stat) == 4.0
    with open("/proc/self/stat") as own:
        assert startup.cpu_seconds(own.read()) > 0


def test_processes_group_by_where_their_memory_counts():
    assert startup.group_of("driver (flows.train)") == "driver"
    assert startup.group_of("ray::IDLE") == startup.group_of("ray::RayTrainWorker") == "Ray workers"
    assert startup.group_of("raylet") == startup.group_of("ray gcs_server") == "Ray's own (GCS, raylet, dashboard, agents)"
    assert startup.group_of("prefect server") == "Prefect server" and startup.group_of("python3") == "other"
    at_peak = {"ray::RayTrainWorker": 900, "driver (flows.train)": 700, "ray::IDLE": 300, "raylet": 80, "ray gcs_server": 40}
    per_kind = {"ray::RayTrainWorker": {"most_processes": 1}, "driver (flows.train)": {"most_processes": 1},
                "ray::IDLE": {"most_processes": 3}, "raylet": {"most_processes": 1}, "ray gcs_server": {"most_processes": 1},
                "prefect server": {"most_processes": 1}}
    groups = startup.memory_groups(at_peak, per_kind)
    assert list(groups) == ["Ray workers", "driver", "Ray's own (GCS, raylet, dashboard, agents)", "Prefect server"]
    assert groups["Ray workers"] == {"at_peak_mb": 1200, "most_processes": 4}
    assert groups["Prefect server"] == {"at_peak_mb": 0, "most_processes": 1}  # not running at the peak


def test_every_row_formats_as_one_table_row():
    memory = {"benchmark": "peak memory, small run (python -m flows.train)", "images": 2000, "side": 28, "peak_pss_mb": 2500,
              "peak_at_s": 40.5, "most_processes": 12, "goal": "<= 3,000 MB PSS",
              "groups": {"Ray workers": {"at_peak_mb": 1200, "most_processes": 4}, "driver": {"at_peak_mb": 700, "most_processes": 1}}}
    cli = {"benchmark": "first step, CLI path (cold python -m flows.mnist)", "to_first_step_s": 36.0, "goal": "<= 30 s",
           "parts": {"before_first_stage_s": 17.0, "worker_group_s": 10.0},
           "imports": {"module": "flows.mnist", "wall_s": 4.1, "packages_s": {"torch": 1.4, "prefect": 0.7}}}
    served = {"benchmark": "first step, served path (Prefect server and Ray cluster up)", "to_first_step_s": 20.1, "reused_runs": 3,
              "parts": {"ray_and_runner_s": 1.0, "first_batch_s": 2.0}, "goal": "<= 15 s",
              "first_run": {"stages_s": {"download": 1.5, "to-parquet": 0.5, "transform": 3.0, "train": 30.0}}}
    for row, expected in ((memory, "2,500 MB PSS at 40.5 s (Ray workers 1,200 MB (4 process(es) at most)"),
                          (cli, "36.0 s (before first stage 17.0 s, worker group 10.0 s); importing flows.mnist: 4.1 s (torch 1.4 s"),
                          (served, "20.1 s (ray and runner 1.0 s, first batch 2.0 s; first run's stages: download 1.5 s, to-parquet 0.5 s, transform 3.0 s)")):
        line = startup.format_row(row)
        assert line.startswith(f"| {row['benchmark']} |") and line.endswith(f"| {row['goal']} |") and line.count("|") == 7
        assert expected in line


@pytest.mark.slow
def test_quick_startup_benchmark_writes_its_rows(tmp_path):
    out = tmp_path / "startup.json"
    run = subprocess.run([sys.executable, "-m", "benchmarks.start.startup", "--quick", "--out", str(out)],
                         check=False, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    cli, memory = json.loads(out.read_text())["rows"]
    assert cli["to_first_step_s"] == pytest.approx(sum(cli["parts"].values()), abs=0.05)
    assert all(cli["parts"][f"{stage}_s"] > 0 for stage in ("download", "to-parquet", "transform"))
    assert cli["parts"]["worker_group_s"] > 0 and cli["parts"]["first_batch_s"] > 0
    assert "torch" not in cli["imports"]["packages_s"]  # the flow's module imports no torch (every stage's worker imports it)
    assert memory["images"] == startup.QUICK_MEMORY_IMAGES and memory["peak_pss_mb"] > 0 and memory["most_processes"] >= 4
    assert {"driver", "Ray workers"} <= set(memory["groups"]) and memory["cpu_s"] > 0
    assert memory["peak_pss_mb"] == pytest.approx(sum(memory["at_peak_mb"].values()), abs=len(memory["at_peak_mb"]))
