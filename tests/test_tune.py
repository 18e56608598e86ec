"""The tune flow (``python -m flows.tune``): config refusals, the cluster split, results people use,
and one real search on the bundled sample that is killed, resumed and whose best config trains."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from flows import tune as tune_flow
from pipeline_config import TrainConfig, TransformConfig, TuneConfig, TunePipelineConfig
from pipeline_config.settings import PipelineSettings, parse_cli
from reporting.pictures import trial_curves_png
from reporting.report_text import trial_rows
from runner import console
from runner.summary import RunSummary
from tests.support.cli import CliRun, wait_gone
from tests.support.models import SMALL_MODEL, pause_env
from tests.support.prefect_server import free_port
from training.trial_configs import best_config_values, param_space, plan_trials, scaled_augmentation
from training.tuning import TrialRecord, best_config_yaml, best_trial
from training.worker.faults import FAULT_ENV, paused, release_pauses

# --------------------------------------------------------------------------- fast: refused before any work


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--tune.num-samples", "0"], "tune.num_samples"),
        (["--tune.search-space.learning-rate.low", "0"], "learning_rate.low must be > 0"),
        (["--tune.metric", "val_loss", "--tune.mode", "max"], "mode=max contradicts metric=val_loss"),
        (["--tune.grace-period", "5", "--tune.epochs", "2"], "grace_period (5) is larger than epochs (2)"),
        (["--tune.scheduler", "hyperband"], "tune.scheduler"),
        (["--tune.search-space.augmentation.low", "2", "--tune.search-space.augmentation.high", "1"], "low (2) is larger than high (1)"),
        (["--tune.reduction-factor", "1"], "tune.reduction_factor"),
        (["--train.mode", "single"], "use train.mode=distributed"),
    ],
)
def test_bad_tune_values_are_refused_naming_the_field_and_nothing_is_created(tmp_path, capsys, args, named):
    root = tmp_path / "storage"
    code = tune_flow.main(["--storage-root", str(root), *args])
    assert code == 2
    err = capsys.readouterr().err
    assert "invalid configuration" in err and named in err, err
    assert not root.exists()


def test_bad_tune_value_from_the_environment_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PIPELINE_TUNE__MAX_CONCURRENT_TRIALS", "-1")
    assert tune_flow.main(["--storage-root", str(tmp_path / "s")]) == 2
    assert "tune.max_concurrent_trials" in capsys.readouterr().err


def test_batch_choices_smaller_than_the_workers_are_refused():
    with pytest.raises(ValidationError, match=r"choices \[1\] are smaller than train.num_workers \(2\)"):
        TunePipelineConfig.model_validate({"train": {"num_workers": 2}, "tune": {"search_space": {"global_batch_size": [1, 64]}}})


# --------------------------------------------------------------------------- fast: the cluster split


def test_two_cpus_run_one_trial_at_a_time_and_leave_ray_data_its_cpu():
    plan = plan_trials(TrainConfig(num_workers=1), TuneConfig(), cluster_cpus=2, cluster_gpus=0)
    assert (plan.concurrent, plan.use_gpu, plan.torch_threads) == (1, False, 2)
    assert 0.95 < plan.cpus_per_worker <= 2 - 1 - 0.01  # trial driver + worker + Ray Data's CPU fit in 2
    two = plan_trials(TrainConfig(num_workers=2), TuneConfig(), 2, 0)
    assert two.concurrent == 1 and 2 * two.cpus_per_worker <= 2 - 1 - 0.01


def test_a_bigger_cluster_runs_trials_side_by_side_and_refuses_more_than_fit():
    eight = plan_trials(TrainConfig(num_workers=1), TuneConfig(), 8, 0)
    assert eight.concurrent == 6  # 8 CPUs - 1 for Ray Data - the trial drivers' share: 6 whole CPUs
    assert eight.concurrent * eight.cpus_per_worker + 0.01 * eight.concurrent <= 8 - 1
    assert plan_trials(TrainConfig(num_workers=2), TuneConfig(max_concurrent_trials=2), 8, 0).concurrent == 2
    with pytest.raises(ValueError, match=r"tune.max_concurrent_trials=3: .* hold 1 trial"):
        plan_trials(TrainConfig(num_workers=1), TuneConfig(max_concurrent_trials=3), 2, 0)
    with pytest.raises(ValueError, match="too few"):
        plan_trials(TrainConfig(num_workers=1, data_cpus=2), TuneConfig(), 2, 0)


# --------------------------------------------------------------------------- fast: search space and results


def test_search_space_samples_ranges_and_fixes_knobs_with_equal_bounds():
    from ray.tune.search.sample import Categorical, Float

    space = param_space(
        TuneConfig(search_space={"learning_rate": {"low": 1e-3, "high": 1e-3}, "global_batch_size": [128, 64, 128]})
    )
    assert space["learning_rate"] == 1e-3
    assert isinstance(space["weight_decay"], Float) and isinstance(space["augmentation"], Float)
    assert isinstance(space["global_batch_size"], Categorical) and space["global_batch_size"].categories == [64, 128]


def test_augmentation_strength_scales_each_transform_knob_within_its_limit():
    base = TransformConfig(shift_px=2, rotate_deg=10, scale=0.1)
    assert scaled_augmentation(base, 0).model_dump(include={"shift_px", "rotate_deg", "scale"}) == {
        "shift_px": 0, "rotate_deg": 0.0, "scale": 0.0}
    strong = scaled_augmentation(base, 10)
    assert (strong.shift_px, strong.rotate_deg, strong.scale) == (8, 45.0, 0.5)


def _record(trial_id: str, status: str, values: list[float]) -> TrialRecord:
    history = [{"epoch": float(epoch), "val_ce": value} for epoch, value in enumerate(values)]
    config = {"learning_rate": 1e-3, "weight_decay": 1e-4, "global_batch_size": 64, "augmentation": 0.5, "label_smoothing": 0.05}
    return TrialRecord(trial_id=trial_id, config=config, status=status, epochs_run=len(values), best_metric=min(values),
                       last_metric=values[-1], history=history, run_dir=f"/r/trials/{trial_id}")


def test_best_config_yaml_is_accepted_by_the_main_flow_and_sets_the_trial_recipe(tmp_path):
    records = [_record("a_00000", "completed", [0.9, 0.4]), _record("a_00001", "stopped early", [1.6])]
    best = best_trial(records, TuneConfig())
    assert best.trial_id == "a_00000"
    values = best_config_values(TrainConfig(), TransformConfig(), best.config)
    path = tmp_path / "best_config.yaml"
    path.write_text(best_config_yaml(values, best, "val_ce", "tune-x"))
    assert yaml.safe_load(path.read_text()) == values
    config = parse_cli(["--config-file", str(path)], PipelineSettings).pipeline_config()
    assert (config.train.learning_rate, config.train.global_batch_size, config.transform.shift_px) == (1e-3, 64, 1)


def test_another_workloads_best_config_names_it_for_flows_train(tmp_path):
    """A search of another workload: the best config carries the workload, says flows.train, and the
    summary's hint trains it with flows.train; MNIST's file and hint stay as they were."""
    from pipeline_config.settings import TrainSettings

    best = best_trial([_record("a_00000", "completed", [0.9, 0.4])], TuneConfig())
    values = best_config_values(TrainConfig(), TransformConfig(), best.config, "training.model.catalog:small_cnn", "shapes")
    text = best_config_yaml(values, best, "val_ce", "shapes-tune-x", "flows.train")
    assert "# Train it: python -m flows.train --config-file" in text and "download.*" in text
    path = tmp_path / "best_config.yaml"
    path.write_text(text)
    config = parse_cli(["--config-file", str(path)], TrainSettings).pipeline_config()
    assert (config.workload, config.model.name, config.registry_name) == ("shapes", "training.model.catalog:small_cnn", "shapes-small-cnn")
    assert "workload" not in best_config_values(TrainConfig(), TransformConfig(), best.config)  # MNIST's: unchanged
    # A search on an image folder: the file names the folder (and the resize), so the winner trains on the same images
    folder = {"source": "folder", "path": str(tmp_path)}
    on_images = best_config_values(TrainConfig(), TransformConfig(image_size=16), best.config, None, "shapes", folder)
    assert on_images["download"] == folder and on_images["transform"]["image_size"] == 16
    assert "on the data the search ran on" in best_config_yaml(on_images, best, "val_ce", "shapes-tune-x", "flows.train")
    assert "download" not in values and "image_size" not in values["transform"]
    tuning = {"metric": "val_ce", "trials": 1, "stopped_early": 0, "best_trial": {
        "trial_id": "a_00000", "val_ce": 0.4, "epochs_run": 2, "sampled": {}, "config_file": str(path)}}
    assert any(line.strip().startswith(f"train it       python -m flows.train --config-file {path}")
               for line in console.tuning_lines(tuning, "shapes"))
    assert any(f"python -m flows.mnist --config-file {path}" in line for line in console.tuning_lines(tuning, "mnist"))


def test_trial_table_and_picture_show_every_trial_and_which_stopped_early():
    records = [r.model_dump() for r in (_record("a_00000", "completed", [0.9, 0.4]), _record("a_00001", "stopped early", [1.6]))]
    rows = trial_rows(records, "val_ce", "a_00000")
    assert [(r["trial"], r["stopped early"], r["epochs run"], r["best val_ce"]) for r in rows] == [
        ("a_00000 (best)", "no", 2, "0.4000"), ("a_00001", "yes", 1, "1.6000")]
    png = trial_curves_png(records, "val_ce", "a_00000")
    assert png.startswith(b"\x89PNG") and len(png) > 5000
    with pytest.raises(ValueError, match="no trial reported val_accuracy"):
        trial_curves_png(records, "val_accuracy")


def test_summary_names_the_best_trial_and_the_resume_command_the_tune_module():
    tuning = {"metric": "val_ce", "trials": 4, "stopped_early": 2, "best_trial": {
        "trial_id": "a_00003", "val_ce": 0.41, "epochs_run": 2, "sampled": {"learning_rate": 0.004}, "config_file": "/s/best_config.yaml"}}
    lines = console.summary_lines(RunSummary(run_name="t", tuning=tuning, module="flows.tune"), RuntimeError("x"), 5, None, False, [])
    text = "\n".join(lines)
    assert "best trial     a_00003: val_ce 0.4100 after 2 epoch(s) (4 trials, 2 stopped early)" in text
    assert "python -m flows.mnist --config-file /s/best_config.yaml" in text
    assert re.search(r"to resume +\S*python\S* -m flows.tune --run-name t", text), text


# --------------------------------------------------------------------------- slow: one real search


def _trial_states(run_dir: Path) -> dict[str, str]:
    """Trial id -> status in Tune's saved experiment state (what a restore starts from)."""
    states: dict[str, str] = {}
    for path in sorted((run_dir / "tune").glob("experiment_state-*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        for trial_json, _ in data.get("trial_data", []):
            trial = json.loads(trial_json)
            states[trial["trial_id"]] = trial["status"]
    return states


def _paused_trials(run_dir: Path) -> set[str]:
    """The trials whose training has paused (test-only pause; each trial has its own faults folder)."""
    return {faults.parent.name for faults in (run_dir / "trials").glob("*/faults") if paused(str(faults))}


@pytest.mark.slow
def test_search_killed_mid_way_resumes_without_rerunning_finished_trials_and_writes_the_best_recipe(tmp_path, mlflow_server):
    """The smoke search (4 trials of up to 2 epochs, ASHA after epoch 1) of the small model (CliRun's) on the
    bundled sample, on 2 CPUs (one trial at a time).

    Every trial's worker is SIGKILLed at step 3 of epoch 2 (test-only fault injection), which Ray
    Train repairs inside the trial. In the first run every trial also pauses at its first step
    (test-only pause): the first trial is let go, and once Tune has recorded it finished while the
    second is held mid-way, the whole CLI is SIGKILLed (driver, Ray, Prefect server); the same
    command with the same --run-name (kill fault only) restores the search, leaves the finished
    trial alone and completes the other three. The best config file it names is a main-flow config
    file with model.name and the best trial's sampled recipe. Tracked in MLflow: one parent run for
    the search, one nested run per trial with one point per epoch it trained.
    """
    kill = "kill:rank=0:epoch=1:step=3"
    fault = {FAULT_ENV: f"{kill};{pause_env(epoch=0, step=0)[FAULT_ENV]}"}
    tracking = {"MLFLOW_TRACKING_URI": mlflow_server.uri}
    first = CliRun(tmp_path, "tune-killed", env=fault | tracking, module="flows.tune")
    run_dir = first.root / "runs" / "tune-killed"
    first.wait_until(lambda: _paused_trials(run_dir), "the first trial's pause", 420)
    (opener,) = _paused_trials(run_dir)
    release_pauses(str(run_dir / "trials" / opener / "faults"))
    first.wait_until(
        lambda: "TERMINATED" in _trial_states(run_dir).values() and len(_paused_trials(run_dir)) == 2,
        "the first trial finished in Tune's state and the second paused", 420,
    )
    finished = {trial for trial, status in _trial_states(run_dir).items() if status == "TERMINATED"}
    (held,) = _paused_trials(run_dir) - {opener}
    assert finished == {opener}, _trial_states(run_dir)  # killed mid-way: one trial done, one running, two to come
    pids = first.processes()
    first.kill()
    first.proc.wait(timeout=30)  # reaped: a zombie's pid would still hold the run's lease
    assert not wait_gone(pids, 30)
    before = {trial: (run_dir / "trials" / trial / "history.jsonl").read_bytes() for trial in finished}
    attempts_before = {trial: (run_dir / "trials" / trial / "train_attempts.jsonl").read_text() for trial in finished}

    resumed = CliRun(tmp_path, "tune-killed", env={FAULT_ENV: kill} | tracking, module="flows.tune")
    code, _ = resumed.finish(600)
    out = resumed.output()
    assert code == 0, out[-3000:]
    summary = resumed.summary()
    tuning = summary["tuning"]
    assert summary["status"] == "completed" and tuning["restored"] is True
    assert tuning["trials"] == 4 and tuning["errored"] == 0 and summary["config"]["model"]["name"] == SMALL_MODEL
    # Finished trials were not rerun: their Ray Train runs are byte for byte what they were.
    for trial in finished:
        assert (run_dir / "trials" / trial / "history.jsonl").read_bytes() == before[trial]
        assert (run_dir / "trials" / trial / "train_attempts.jsonl").read_text() == attempts_before[trial]
    # ASHA stopped at least one trial after its first epoch; the others ran the budget of 2.
    epochs = {p.name: len((p / "history.jsonl").read_text().splitlines()) for p in (run_dir / "trials").iterdir()}
    assert set(epochs.values()) <= {1, 2} and len(epochs) == 4 and held in epochs, epochs  # the held trial ran again
    assert tuning["stopped_early"] >= 1 and 1 in epochs.values(), epochs
    # Every trial that reached epoch 2 lost its worker there and Ray Train went on from epoch 1's checkpoint.
    for trial, count in epochs.items():
        if count == 2:
            starts = [json.loads(line)["start_epoch"] for line in (run_dir / "trials" / trial / "train_attempts.jsonl").read_text().splitlines()]
            assert starts[0] == 0 and 1 in starts, (trial, starts)
            assert list((run_dir / "trials" / trial / "faults").glob("kill-*.fired"))
    best = tuning["best_trial"]
    assert best["trial_id"] in epochs and best["val_ce"] == min(
        json.loads(line)["val_ce"] for p in (run_dir / "trials").iterdir() for line in (p / "history.jsonl").read_text().splitlines())
    assert "best trial" in out and "best config" in out
    # MLflow: the search's run and, nested in it, one run per trial with its epochs once each.
    runs = mlflow_server.runs(run_name="tune-killed")
    (parent,) = [run for run in runs if "tune_trial" not in run.data.tags]
    nested = {run.data.tags["tune_trial"]: run for run in runs if "tune_trial" in run.data.tags}
    assert set(nested) == set(epochs) and parent.data.tags["best_trial"] == best["trial_id"]
    assert all(run.data.tags["mlflow.parentRunId"] == parent.info.run_id for run in nested.values())
    assert {trial: mlflow_server.steps(run.info.run_id) for trial, run in nested.items()} == {
        trial: list(range(count)) for trial, count in epochs.items()}
    assert parent.info.status == "FINISHED" and summary["tracking"]["not_recorded"] == []

    # The best config file, as the summary names it, is a config file of the main flow that names the
    # model the trials trained and the best trial's recipe. (That such a file trains: the tune
    # deployment's `train_best` trains the best trial's recipe, built by the same `trial_train_config`;
    # `--config-file` runs are the extending guide's test; docs/testing.md, third round.)
    config_file = Path(best["config_file"])
    chosen = yaml.safe_load(config_file.read_text())
    assert chosen["model"] == {"name": SMALL_MODEL}
    config = parse_cli(["--preset", "smoke", "--config-file", str(config_file)], PipelineSettings).pipeline_config()
    sampled = best["sampled"]  # what Tune sampled for the best trial, as the trial's own Ray Train run trained it
    assert config.model.name == SMALL_MODEL
    assert (config.train.learning_rate, config.train.weight_decay, config.train.global_batch_size) == (
        sampled["learning_rate"], sampled["weight_decay"], sampled["global_batch_size"])
    assert config.train.label_smoothing == sampled["label_smoothing"]
    assert (config.transform.shift_px, config.transform.rotate_deg) == (chosen["transform"]["shift_px"], chosen["transform"]["rotate_deg"])


# --------------------------------------------------------------------------- the local Ray beside another one


@pytest.mark.slow
def test_local_ray_workers_find_their_own_cluster_beside_another_local_ray(tmp_path, monkeypatch):
    """Ray Train's placement group cleaner looks its cluster up from inside a worker without an
    address; with two local Rays on one machine that failed ("Found multiple active Ray
    instances") until the flow's Ray handed its workers RAY_ADDRESS. A second real Ray runs here."""
    import os
    import tempfile

    import ray

    from pipeline_config import RayConfig
    from runner.cluster.ray_init import local_gcs_port, ray_init_args

    other_dir = tempfile.mkdtemp(dir="/tmp", prefix="r2-")  # short: Ray's socket paths must fit in 107 bytes
    other = subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--num-cpus", "1",
                            "--port", str(free_port()), "--include-dashboard", "false", "--temp-dir", other_dir],
                           capture_output=True, text=True, timeout=120)
    other_pids = set()
    try:
        assert other.returncode == 0, other.stderr[-2000:]
        other_pids = {int(pid) for pid in subprocess.run(["pgrep", "-f", other_dir], capture_output=True, text=True).stdout.split()}
        assert other_pids
        address, kwargs = ray_init_args(RayConfig(num_cpus=1), "http://127.0.0.1:1/api")
        ray_address = kwargs["runtime_env"]["env_vars"]["RAY_ADDRESS"]
        monkeypatch.delenv("RAY_GCS_SERVER_PORT", raising=False)
        with local_gcs_port(kwargs):
            assert os.environ["RAY_GCS_SERVER_PORT"] == ray_address.rsplit(":", 1)[1]
            context = ray.init(address, **kwargs)
        assert "RAY_GCS_SERVER_PORT" not in os.environ  # only while it starts
        try:
            assert context.address_info["gcs_address"].endswith(":" + ray_address.rsplit(":", 1)[1])

            @ray.remote(num_cpus=0)
            def cluster_seen_from_a_worker() -> str:
                from ray.util.state import list_nodes  # no address: what the placement group cleaner does

                return list_nodes()[0].node_id

            assert ray.get(cluster_seen_from_a_worker.remote(), timeout=120) == ray.get_runtime_context().get_node_id()
        finally:
            ray.shutdown()
    finally:
        for pid in other_pids:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
