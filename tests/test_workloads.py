"""Names follow the workload: a run started without ``run_name`` is named after its Prefect flow run.

The generic entry point's CLI run with another workload (``python -m flows.train``: the run's
default name, the flow run's name, every artifact key and the champion's folder carry the
workload's name) is ``tests/test_image_folder.py::test_the_extending_guide_runs_as_written``; a
deployment's run of it is in ``tests/test_deployments.py``. MNIST's own names (the defaults) are
checked without a run in ``test_config.py``.
"""

from __future__ import annotations

import re

import pytest
from prefect import flow
from prefect.logging.handlers import APILogWorker
from prefect.settings import PREFECT_API_URL, temporary_settings

from pipeline_config import PipelineConfig, TunePipelineConfig
from runner.pipeline_run import _named_run, flow_run_name

pytestmark = pytest.mark.slow
WORKLOAD = "shapes-demo"


@flow(name="workload-name-probe", flow_run_name=flow_run_name)
def probe(config: PipelineConfig = PipelineConfig()) -> str:
    """A flow named like the pipeline's: what PipelineRun names the run folder when run_name is unset."""
    return _named_run(config)


def test_a_run_started_without_a_run_name_is_named_after_its_flow_run(shared_server):
    """A deployment's run (no run_name): `flow_run_name` names the Prefect flow run from the workload,
    and the run folder takes that name; a search's is <workload>-tune-..."""
    with temporary_settings({PREFECT_API_URL: shared_server.api}):
        for config, prefix in (
            (PipelineConfig(workload=WORKLOAD), WORKLOAD), (TunePipelineConfig(workload=WORKLOAD), f"{WORKLOAD}-tune"),
            (PipelineConfig(), "mnist"), (PipelineConfig(workload=WORKLOAD, run_name="chosen"), None),
        ):
            state = probe(config, return_state=True)
            folder = state.result()
            flow_run = shared_server.flow_run(str(state.state_details.flow_run_id))
            if prefix is None:  # a run name given: the flow run takes it (PipelineRun uses it, not _named_run)
                assert flow_run["name"] == "chosen"
                continue
            assert flow_run["name"] == folder, (flow_run["name"], folder)
            assert re.fullmatch(rf"{prefix}-\d{{8}}-\d{{6}}-[0-9a-f]{{6}}", folder), folder
        APILogWorker.drain_all(timeout=5)  # the probe's log lines reach the server before it stops with the module
