"""A local Ray the run starts has its workers import the stages' modules at once (runner.cluster.runtime.warm_stage_workers)."""

from __future__ import annotations

import os
import shutil
import time

from runner.cluster.runtime import warm_stage_workers
from tests.support.warm_marker import MARKERS


def test_a_fresh_local_ray_imports_the_flow_module_in_the_worker_the_next_stage_gets_and_a_failed_import_is_quiet(local_ray):
    """One worker imports the stages' modules; the task after it (the run's first stage, and each one after, as they
    run one at a time) gets that same process: the warm-up is not paid again, and no second worker holds the imports."""
    shutil.rmtree(MARKERS, ignore_errors=True)
    refs = warm_stage_workers("tests.support.warm_marker")
    assert len(refs) == 1
    assert local_ray.get(refs, timeout=120) == [None]
    deadline = time.monotonic() + 30
    while not list(MARKERS.glob("*")) and time.monotonic() < deadline:
        time.sleep(0.2)
    pids = {int(p.name) for p in MARKERS.glob("*")}
    assert len(pids) == 1 and os.getpid() not in pids, pids  # one Ray worker process, not this one

    @local_ray.remote(num_cpus=1)
    def stage() -> int:
        return os.getpid()

    assert [local_ray.get(stage.remote(), timeout=120) for _ in range(3)] == [*pids] * 3  # the warmed worker, each time
    # A module that does not import: the warm-up ends quietly (the stage reports it), nothing raised.
    assert local_ray.get(warm_stage_workers("tests.support.no_such_module"), timeout=120) == [None]
    assert warm_stage_workers(None) == [] and warm_stage_workers("") == []
