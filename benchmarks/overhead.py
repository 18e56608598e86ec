"""The fixed cost every run pays before any work, measured part by part in a fresh process.

    python -m benchmarks.overhead       # prints one JSON object (benchmarks.run calls it)

Parts, in the order a CLI run meets them: importing the flow (Prefect, Ray, torch), starting
the temporary Prefect server on 127.0.0.1 (what ``python -m flows.mnist`` does when
``PREFECT_API_URL`` is unset), starting a local Ray, and a Ray Train worker group that runs a
training function doing nothing (controller, placement group, worker process, torch process
group), all with the flow's own settings.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time


def _noop_loop(config: dict) -> None:
    import ray.train

    ray.train.report({"done": 1})


def measure() -> dict[str, float]:
    seconds: dict[str, float] = {}
    start = time.perf_counter()
    from flows.runtime import prefect_api, ray_task_runner  # noqa: F401 - the imports are what is timed
    from pipeline_config import RayConfig

    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    seconds["imports_s"] = time.perf_counter() - start

    with prefect_api():
        seconds["prefect_server_s"] = time.perf_counter() - start - seconds["imports_s"]
        mark = time.perf_counter()
        runner = ray_task_runner(RayConfig(num_cpus=2))
        ray.init(address="local", **runner.init_kwargs)
        seconds["ray_start_s"] = time.perf_counter() - mark
        try:
            mark = time.perf_counter()
            with tempfile.TemporaryDirectory(prefix="overhead-") as tmp:
                TorchTrainer(
                    _noop_loop,
                    scaling_config=ScalingConfig(num_workers=1, resources_per_worker={"CPU": 1}),
                    run_config=RunConfig(storage_path=tmp, name="noop"),
                ).fit()
            seconds["ray_train_worker_group_s"] = time.perf_counter() - mark
        finally:
            ray.shutdown()
    seconds["total_s"] = sum(seconds.values())
    return {k: round(v, 2) for k, v in seconds.items()}


if __name__ == "__main__":
    json.dump(measure(), sys.stdout)
    sys.exit(0)
