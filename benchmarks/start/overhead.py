"""The fixed cost every run pays before any work, measured part by part in a fresh process.

    python -m benchmarks.start.overhead       # prints one JSON object (benchmarks.run calls it)

Parts, in the order a CLI run meets them: importing the flow (Prefect, Ray, torch), starting
the temporary Prefect server on 127.0.0.1 and a local Ray side by side (what ``python -m
flows.mnist`` does when ``PREFECT_API_URL`` and ``ray.address`` are unset: ``runner.cluster.runtime.cli_runtime``),
and a Ray Train worker group that runs a training function doing nothing, all with the flow's
own settings. The worker group's time is split at the worker process's start and at the training
function's start: controller and placement group, then the worker's imports and torch process
group, then reporting, shutdown and the controller noticing the end.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time


def _process_start_time() -> float:
    """Wall-clock time this process was started (Linux: /proc/self/stat field 22, after boot time).

    Not `training.checkpoint.records.process_start_time`: importing that module in the worker would add its
    imports to the time measured.
    """
    with open("/proc/self/stat") as handle:
        ticks = int(handle.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/stat") as handle:
        boot = next(int(line.split()[1]) for line in handle if line.startswith("btime"))
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def _noop_loop(config: dict) -> dict:
    import ray.train

    # When the worker process started and when the training function began (wall clock), so the
    # worker group's time splits into: controller and placement group up to the worker's process
    # start; the worker's imports and torch process group up to the function; the rest after it.
    # Returned (Result.return_value): a report without a checkpoint leaves Result.metrics empty.
    times = {"worker_process_start": _process_start_time(), "train_fn_start": time.time()}
    ray.train.report({"done": 1})
    return times


def measure() -> dict:
    seconds: dict[str, float] = {}
    start = time.perf_counter()
    # The imports are what is timed (the flow's own pull in Prefect, Ray and torch).
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from pipeline_config import RayConfig
    from runner.cluster.ray_init import ray_train_env
    from runner.cluster.runtime import cli_runtime

    seconds["imports_s"] = time.perf_counter() - start
    os.environ.update(ray_train_env())  # fit() runs here, not in a flow's Ray worker: the same settings

    # As `python -m flows.mnist` starts them: the temporary Prefect server and a local Ray, side by side.
    with cli_runtime(RayConfig(num_cpus=2)):
        seconds["prefect_server_and_ray_s"] = time.perf_counter() - start - seconds["imports_s"]
        mark, wall = time.perf_counter(), time.time()
        with tempfile.TemporaryDirectory(prefix="overhead-") as tmp:
            result = TorchTrainer(
                _noop_loop,
                scaling_config=ScalingConfig(num_workers=1, resources_per_worker={"CPU": 1}),
                run_config=RunConfig(storage_path=tmp, name="noop"),
            ).fit()
        seconds["ray_train_worker_group_s"] = time.perf_counter() - mark
        end, times = wall + seconds["ray_train_worker_group_s"], result.return_value
        parts = {  # parts of the worker group's time, not added to the total again
            "to_worker_process_s": times["worker_process_start"] - wall,
            "worker_process_to_train_fn_s": times["train_fn_start"] - times["worker_process_start"],
            "train_fn_to_fit_return_s": end - times["train_fn_start"],
        }
    seconds["total_s"] = sum(seconds.values())
    out: dict = {k: round(v, 2) for k, v in seconds.items()}
    out["worker_group_parts"] = {k: round(v, 2) for k, v in parts.items()}
    return out


if __name__ == "__main__":
    json.dump(measure(), sys.stdout)
    sys.exit(0)
