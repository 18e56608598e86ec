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

from benchmarks.speed import accuracy, device_rows
from benchmarks.table import format_table

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_quick_benchmark_writes_every_row(tmp_path):
    out = tmp_path / "bench.json"
    run = subprocess.run([sys.executable, "-m", "benchmarks.run", "--quick", "--out", str(out)],
                         check=False, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["model"] == "training.model.catalog:small_cnn"  # quick: the small CNN on both sides of every row
    kinds = [row["benchmark"] for row in result["rows"]]
    assert kinds == [
        "data path", "conversion peak RSS", "fixed overhead", "deployment path, flow start to first training step",
        "training throughput, train.mode=single (no Ray Train)", "training throughput (1 worker x 2 threads, batch 128)",
        "training throughput (2 workers x 1 thread, DDP, global batch 128)", "time to accuracy", "tune stage, per trial",
        "training throughput at full size (1 worker x 2 threads, batch 128)",
        "training throughput on the device (1 worker, precision auto)", "time to accuracy at full size",
        "time to accuracy at full size on the device", "full-size default flow, by stage", "served champion",
    ]
    # What the suite took, in total and row by row (rows added together take 0 s after the first).
    per_row = result["suite_wall_s_per_row"]
    assert len(per_row) == len(kinds) and all(s >= 0 for s in per_row) and sum(per_row) > 0
    assert result["suite_wall_s"] >= sum(per_row) - 0.5  # each rounded to 0.1 s
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
    deploy = result["rows"][3]  # quick: one run on an empty root, the one quoted
    assert deploy["reused_runs"] == 0 and deploy["runs_s"] == [deploy["to_first_step_s"]] and deploy["to_first_step_s"] > 0
    assert set(deploy["parts"]) == {"ray_and_runner_s", "stages_before_training_s", "worker_group_s", "first_batch_s"}
    assert all(v > 0 for v in deploy["parts"].values()), deploy["parts"]  # in order: run start, download, train, attempt, step
    assert abs(sum(deploy["parts"].values()) - deploy["to_first_step_s"]) <= 0.05  # the parts add up to the total
    assert deploy["first_run"]["to_first_step_s"] == deploy["to_first_step_s"] and not deploy["first_run"]["data_reused"]
    single, train = result["rows"][4], result["rows"][5]
    assert "single" in single["benchmark"] and single["ours_images_per_s"] > 0 and single["ratio"] > 0
    assert train["baseline_images_per_s"] > 0 and train["ours_images_per_s"] > 0 and train["ratio"] > 0
    assert train["ratio_to_single_mode"] > 0
    two = result["rows"][6]  # against plain DDP (2 processes outside Ray), and against the plain loop
    assert "DDP" in two["baseline"] and len(two["baseline_runs"]) == 1 and two["baseline_images_per_s"] > 0
    assert two["workers"] == 2 and two["epochs"] == 1 and two["train_rows"] == 3800 and two["ours_images_per_s"] > 0
    assert two["ratio"] == pytest.approx(two["ours_images_per_s"] / two["baseline_images_per_s"], rel=0.01)
    assert two["plain_loop_images_per_s"] == train["baseline_images_per_s"]  # the plain loop's median of this run
    assert two["ratio_to_plain_loop"] == pytest.approx(two["ours_images_per_s"] / two["plain_loop_images_per_s"], rel=0.01)
    reach = result["rows"][7]
    assert reach["epochs"] == 1 and len(reach["baseline_history"]) >= 1 and len(reach["ours_history"]) == 1
    assert 0 <= reach["ours_history"][0] <= 1 and reach["ours_stage_s"] > 0
    # Both sides learn (ten classes: chance is 0.1). A plain loop fed NaN (unset transform.mean/std) stayed at 0.1.
    for row in (reach, result["rows"][11], result["rows"][12]):
        assert max(row["baseline_history"]) > 0.2 and max(row["ours_history"]) > 0.2, row
    assert reach["train_rows"] == 3800 and reach["val_rows"] == 200  # the bundled sample's split
    # Either side reaches the (quick) target or says it did not; a ratio only when both did.
    assert (reach["ratio"] is not None) == (reach["ours_s"] is not None and reach["baseline_s"] is not None)
    tuned = result["rows"][8]  # one trial of the default recipe against the training stage, same epochs
    assert tuned["epochs"] == 1 and tuned["baseline_s"] > 0 and tuned["ours_s"] > 0
    assert tuned["overhead_per_trial_s"] == round(tuned["ours_s"] - tuned["baseline_s"], 2)
    assert tuned["ratio"] == round(tuned["ours_s"] / tuned["baseline_s"], 3)
    # Full size, on the quick mirror (2,000 / 500 rows): every 20th training row is held out.
    big = result["rows"][9]  # plain loop, ours, plain loop
    assert big["train_rows"] == 1900 and big["epochs"] == 1 and big["workers"] == 1 and big["threads"] == 2
    assert len(big["baseline_runs"]) == 2 and all(p > 0 for p in big["baseline_runs"])
    assert big["baseline_images_per_s"] > 0 and big["ours_images_per_s"] > 0 and len(big["ours_epochs"]) == 1
    assert big["ratio"] == pytest.approx(big["ours_images_per_s"] / big["baseline_images_per_s"], rel=0.01)
    # The GPU row; quick mode on a machine without a GPU runs it on the CPU and names the CPU.
    device = result["rows"][10]
    assert device["device"] == result["device"] == device_rows.device_name()
    assert device["train_rows"] == 1900 and device["batch"] == 512 and len(device["baseline_runs"]) == 2
    assert device["ours_images_per_s"] > 0 and device["ratio"] == pytest.approx(device["ours_images_per_s"] / device["baseline_images_per_s"], rel=0.01)
    if device_rows.default_device() == "cpu":
        assert device["device"].startswith("CPU: ") and device["precision"] == "fp32" and device["gpu_busy_percent"] is None
    reach_big = result["rows"][11]  # both sides on the mirror's rows, the same held-out split
    assert "mirror" in reach_big["data"] and reach_big["train_rows"] == 1900 and reach_big["val_rows"] == 100
    assert reach_big["epochs"] == 1 and reach_big["target"] == 0.5 and len(reach_big["ours_history"]) == 1
    assert len(reach_big["baseline_history"]) == 1 and reach_big["ours_stage_s"] > 0
    assert all(0 <= a <= 1 for a in reach_big["baseline_history"] + reach_big["ours_history"])
    assert (reach_big["ratio"] is not None) == (reach_big["ours_s"] is not None and reach_big["baseline_s"] is not None)
    # The GPU time-to-accuracy row: the same mirror and held-out split, both sides on the device (here: as above).
    reach_device = result["rows"][12]
    assert reach_device["device"] == device["device"] and reach_device["precision"] == device["precision"]
    assert reach_device["train_rows"] == 1900 and reach_device["val_rows"] == 100 and reach_device["target"] == 0.5
    assert len(reach_device["ours_history"]) == 1 and len(reach_device["baseline_history"]) == 1
    assert all(0 <= a <= 1 for a in reach_device["baseline_history"] + reach_device["ours_history"])
    assert (reach_device["ratio"] is not None) == (reach_device["ours_s"] is not None and reach_device["baseline_s"] is not None)
    flow = result["rows"][13]  # python -m flows.mnist on the mirror, split by stage
    assert flow["rows"] == {"train": 1900, "val": 100, "test": 500} and flow["epochs"] == 1 and flow["workers"] == 1
    assert {"download", "to-parquet", "transform", "train", "evaluate"} <= set(flow["stages_s"])
    assert all(s >= 0 for s in flow["stages_s"].values()) and flow["stages_s"]["train"] > 0
    assert flow["wall_s"] >= sum(flow["stages_s"].values())  # the stages are part of the run's wall time
    assert len(flow["epoch_s"]) == 1 and flow["epoch_s"][0] > 0 and flow["images_per_s"][0] > 0
    assert flow["peak_rss_mb"]["driver"] > 0 and flow["peak_rss_mb"]["train_worker"] > 0
    assert 0 <= flow["test_accuracy_on_derived_digits"] <= 1 and flow["goal"] == "(split reported)"
    served = result["rows"][14]  # the champion served over HTTP against flows.predict on the same digits
    assert served["baseline_s"]["32"] > 0 and served["ours_images_per_s"] > 0 and served["same_answers"] is True
    # The printed table has a line for every row.
    assert "| data path | 4,000 rows |" in run.stdout
    assert "| tune stage, per trial | 1 trial, 1 epoch(s)" in run.stdout
    assert "| deployment path: flow run start to first training step (server already up) |" in run.stdout
    assert "| 3,800 training rows (sample), 1 epoch(s), 2 workers |" in run.stdout and "img/s (plain DDP)" in run.stdout
    assert "| 1,900 training rows (full-size mirror), 1 epoch(s), 1 worker x 2 threads |" in run.stdout
    assert "| time to 50% validation accuracy | 1,900 training rows (full-size mirror), 1 epochs, 1 worker(s) |" in run.stdout
    assert "| full-size default flow, by stage (`python -m flows.mnist`) | 1,900 train / 100 val / 500 test rows" in run.stdout
    assert "| served champion (`python -m deployments.serve_model`) | training.model.catalog:small_cnn" in run.stdout
    assert f"| training throughput on the device (1 worker, precision auto) | {device['device']}, 1,900 training rows" in run.stdout
    assert f"| time to 50% validation accuracy on the device ({device['device']}, {device['precision']}) | 1,900 training rows" in run.stdout


def test_step_parts_times_every_part_of_a_step_both_ways(monkeypatch):
    """`benchmarks.speed.step_parts` on the small CNN: every part timed, old and new, and the step ratio from them."""
    from benchmarks import MODEL_ENV
    from benchmarks.speed import step_parts
    monkeypatch.setenv(MODEL_ENV, "training.model.catalog:small_cnn")
    row = step_parts.measure(batch=8, steps=2, rounds=1)
    parts = ("forward_backward_ms", "adamw_default_ms", "adamw_fused_ms", "ema_per_tensor_ms", "ema_grouped_ms")
    assert row["model"] == "training.model.catalog:small_cnn" and row["batch"] == 8 and all(row[p] > 0 for p in parts)
    old = row["forward_backward_ms"] + row["adamw_default_ms"] + row["ema_per_tensor_ms"]
    new = row["forward_backward_ms"] + row["adamw_fused_ms"] + row["ema_grouped_ms"]
    assert row["step_ratio"] == pytest.approx(old / new, abs=0.001)


def test_quick_recipe_benchmark_trains_both_sides_of_every_cell(tmp_path):
    """`python -m benchmarks.speed.recipe --quick`: each of the four generated workloads, both sides trained and
    scored on its test images (accuracy a fraction of them), the table made from the rows, the machine named."""
    from benchmarks.speed import recipe

    out = tmp_path / "recipe.json"
    assert recipe.main(["--quick", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [row["workload"] for row in rows] == ["shapes", "glyphs", "textures", "dots"]
    for row in rows:
        assert row["budget"] == "quick" and row["model"] == "training.model.catalog:small_cnn" and row["steps"] >= 12
        # Accuracy is a count of the workload's test images (10 a class in quick mode), rounded to 4 places.
        for side in ("plain", "ours"):
            correct = row[side] * row["test_images"]
            assert 0 <= row[side] <= 1 and abs(correct - round(correct)) < 0.01
        assert row["test_images"] == 10 * row["classes"] and row["gap_points"] == round(100 * (row["ours"] - row["plain"]), 1)
    assert result["environment"] and result["long_budget_mean_gap_points"] is None  # quick: no long budget
    table = recipe.format_table(rows)
    assert table.count("\n") == 1 + len(rows) and "| shapes: 3 classes, 3 ch" in table


def test_the_gpu_row_says_why_it_did_not_run_on_a_machine_without_a_gpu(tmp_path):
    """Full mode on a machine without a GPU: the row names the CPU and says there is no GPU, with no figure
    made up; the busy sampler says nothing where ``nvidia-smi`` is missing. (On a GPU this test has nothing
    to check: the quick benchmark's test checks the row that ran.)"""
    import shutil

    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the row runs there (test_quick_benchmark_writes_every_row)")
    row = device_rows.measure(tmp_path, {"source": "sample"}, epochs=1, steps=1)
    no_gpu = "no GPU on this machine (torch.cuda.is_available() is False)"
    assert row == {"benchmark": "training throughput on the device (1 worker, precision auto)",
                   "device": device_rows.device_name(), "skipped": no_gpu}
    assert row["device"].startswith("CPU: ")
    reach = accuracy.measure_time_to_accuracy(tmp_path, tmp_path / "no-mirror", {}, epochs=1, target=0.99)
    assert reach == {"benchmark": "time to accuracy at full size on the device", "device": row["device"], "skipped": no_gpu}
    table = format_table([row, reach])  # both print as rows that say why, with no figure
    assert table.count(f"| {row['device']} | | | | not run: {no_gpu} |") == 2
    if shutil.which("nvidia-smi") is None:
        with device_rows.BusySampler(every=0.05) as busy:
            pass
        assert busy.result() is None
    plain = device_rows.plain_images_per_s_on("cpu", steps=1, batch=4)
    assert plain["precision"] == "fp32" and plain["images_per_s"] > 0  # auto is fp32 on a CPU
