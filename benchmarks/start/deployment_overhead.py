"""Fixed overhead on the deployment path: from the flow run's start to its first training step.

    python -m benchmarks.start.deployment_overhead [runs] [--ray-cluster]   # one JSON object (benchmarks.run calls `measure`)

Scheduled and UI-started runs meet a Prefect server that is already running: nobody pays for
starting one. What they pay is measured here. A real Prefect server is started on 127.0.0.1
first (not timed), then the default flow runs in a fresh process against it, as a deployment's
flow-run process does (imports happen before the flow run starts, so they are not part of it;
the local Ray is started by the flow's task runner, so it is). Each run trains one epoch of the
bundled sample, with the evaluation gate off.

The first run finds an empty storage root (download, conversion and transform do their work);
the next ones find the data verified on storage and reuse it, which is what a nightly run meets
every night after its first. The row quotes the median of those; the first run is reported apart.

With ``ray_cluster`` the runs join a Ray cluster that is already running too (``ray start --head``
on 127.0.0.1, given as ``ray.address``), as deployments pointed at a standing cluster do: no run
starts Ray, and the cluster's worker processes outlive each run.

The time is split by what Prefect and the run's own files recorded:

* ``ray_and_runner_s``: flow run Running -> the download task's start (the local Ray and the
  Prefect task runner starting, the run's lease, the environment report);
* ``stages_before_training_s``: download start -> the train task's start (download, conversion
  and transform, reused or not, and the dataset report);
* ``worker_group_s``: train task start -> the training attempt's record (Ray Train's controller,
  the placement group, the worker process and its imports, the torch process group, the model);
* ``first_batch_s``: the attempt's record -> the first training step (epoch 0's data pipeline and
  its first batch; ``first_step_at`` in ``history.jsonl``).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository

# The flow as a deployment's flow-run process calls it, with the config a UI form would send.
RUN_CODE = """
import json, sys
from flows.mnist import mnist_pipeline
from pipeline_config import PipelineConfig
mnist_pipeline(PipelineConfig.model_validate(json.loads(sys.argv[1])))
"""


def _time(stamp: str) -> float:
    return datetime.fromisoformat(stamp).timestamp()


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def one_run(api_url: str, storage: Path, name: str, ray_address: str | None = None, env: dict | None = None) -> dict:
    """Run the flow once in a fresh process against ``api_url``; split its time to the first training step."""
    import httpx

    from benchmarks import model_name

    config = {"storage_root": str(storage), "run_name": name, "download": {"source": "sample"}, "model": {"name": model_name()},
              "train": {"epochs": 1}, "evaluate": {"min_accuracy": 0.0}, "ray": {"address": ray_address}}
    env = {k: v for k, v in (env or os.environ).items() if not k.startswith(("PREFECT_API", "PREFECT_PROFILE"))}
    env["PREFECT_API_URL"] = api_url
    run = subprocess.run([sys.executable, "-c", RUN_CODE, json.dumps(config)], check=False, cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900)
    if run.returncode != 0:
        raise RuntimeError(f"the flow run failed (exit {run.returncode}):\n{run.stderr[-3000:]}")
    run_dir = storage / "runs" / name
    summary = json.loads((run_dir / "summary.json").read_text())
    with httpx.Client(base_url=api_url, timeout=30) as client:
        flow_run = client.get(f"/flow_runs/{summary['flow_run_id']}").raise_for_status().json()
        tasks = client.post("/task_runs/filter", json={"flow_runs": {"id": {"any_": [summary["flow_run_id"]]}}}).raise_for_status().json()
    starts: dict[str, float] = {}
    for task in tasks:  # task names are "<stage>-<suffix>"
        stage = task["name"].rsplit("-", 1)[0]
        if task["start_time"]:
            starts[stage] = min(starts.get(stage, float("inf")), _time(task["start_time"]))
    flow_start = _time(flow_run["start_time"])
    attempt = _read_jsonl(run_dir / "train_attempts.jsonl")[0]["time"]
    first_step = _read_jsonl(run_dir / "history.jsonl")[0]["first_step_at"]
    parts = {
        "ray_and_runner_s": starts["download"] - flow_start,
        "stages_before_training_s": starts["train"] - starts["download"],
        "worker_group_s": attempt - starts["train"],
        "first_batch_s": first_step - attempt,
    }
    return {"to_first_step_s": round(first_step - flow_start, 2), "parts": {k: round(v, 2) for k, v in parts.items()},
            "data_reused": bool(summary["data"]["download_skipped"] and summary["data"]["conversion_skipped"]),
            "stages_s": {stage: info["seconds"] for stage, info in summary["stages"].items()}}


@contextmanager
def running_ray_cluster(temp: Path) -> Iterator[tuple[str, dict]]:
    """A Ray head node (`runner.cluster.ray_head.ray_head`: 2 CPUs, 127.0.0.1, the worker-pool settings a run's local
    Ray gets) for the block; yields (address, env). Token authentication is off in its processes and the
    runs' (it is about who may join, not what is measured here)."""
    from runner.cluster.ray_head import ray_head

    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    env |= {"RAY_AUTH_MODE": "disabled", "RAY_TMPDIR": str(temp)}
    with ray_head(temp / "head.log", num_cpus=2, env=env, auth=False) as address:
        yield address, env


def measure(reused_runs: int = 2, ray_cluster: bool = False) -> dict:
    """One row: a first run on an empty root, then ``reused_runs`` runs that reuse its data; medians of those.

    With ``reused_runs=0`` (the quick suite) the row quotes the first run itself.
    """
    from runner.prefect_server.process import owned_server_class

    server = owned_server_class()()
    server.port = server.find_available_port()
    server.start()  # already running when the runs start: not timed
    try:
        with tempfile.TemporaryDirectory(prefix="mnist-deploy-", dir="/tmp") as tmp:
            storage = Path(tmp) / "storage"
            with running_ray_cluster(Path(tmp) / "r") if ray_cluster else nullcontext((None, None)) as (address, env):
                first = one_run(server.api_url, storage, "overhead-first", address, env)
                reused = [one_run(server.api_url, storage, f"overhead-{i}", address, env) for i in range(reused_runs)]
    finally:
        server.stop()
    if not all(run["data_reused"] for run in reused):
        raise RuntimeError("a later run did not reuse the first run's data")
    quoted = reused or [first]
    median = statistics.median(run["to_first_step_s"] for run in quoted)
    parts = {key: round(statistics.median(run["parts"][key] for run in quoted), 2) for key in quoted[0]["parts"]}
    where = ", Ray cluster already running" if ray_cluster else ""
    return {"benchmark": f"deployment path{where}, flow start to first training step", "to_first_step_s": round(median, 2),
            "parts": parts, "runs_s": [run["to_first_step_s"] for run in quoted], "reused_runs": reused_runs,
            "first_run": first, "ray_cluster": ray_cluster, "goal": "<= 15 s"}


if __name__ == "__main__":
    numbers = [arg for arg in sys.argv[1:] if arg.isdigit()]
    json.dump(measure(int(numbers[0]) if numbers else 2, ray_cluster="--ray-cluster" in sys.argv), sys.stdout)
    sys.exit(0)
