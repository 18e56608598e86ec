"""A local Ray the run starts has its workers import the stages' modules at once (runner.cluster.runtime.warm_stage_workers)."""

from __future__ import annotations

import os
import shutil
import time

from runner.cluster.runtime import warm_stage_workers
from tests.support.warm_marker import MARKERS


def test_each_cpu_of_a_fresh_local_ray_imports_the_flow_module_in_a_worker_and_a_failed_import_is_quiet(local_ray):
    shutil.rmtree(MARKERS, ignore_errors=True)
    refs = warm_stage_workers("tests.support.warm_marker")
    assert len(refs) == 2  # one per CPU of the fixture's 2-CPU Ray
    assert local_ray.get(refs, timeout=120) == [None, None]
    deadline = time.monotonic() + 30
    while len(list(MARKERS.glob("*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    pids = {int(p.name) for p in MARKERS.glob("*")}
    assert len(pids) == 2 and os.getpid() not in pids, pids  # two Ray worker processes, not this one
    # A module that does not import: the warm-up ends quietly (the stage reports it), nothing raised.
    assert local_ray.get(warm_stage_workers("tests.support.no_such_module"), timeout=120) == [None, None]
    assert warm_stage_workers(None) == [] and warm_stage_workers("") == []
