"""One Ray cluster for the test session, which end-to-end runs join as runs of a deployment do.

A CLI run with no ``ray.address`` starts a Ray of its own (a GCS, a raylet, a dashboard and its
agents: seconds of start-up and of CPU each time) and stops it at its end. A real deployment
keeps one cluster and every run joins it (`deployments.serve`, `runner.cluster.ray_head`). The session's
cluster is that: `shared_cluster` starts one ``ray start --head`` with `runner.cluster.ray_head.ray_head`
(token authentication, the worker-pool settings of a run's own local Ray, dies with the test
process), and a run joins it through its configuration, not its command line:

- a CLI run gets `join_env` in its environment (``PIPELINE_RAY__ADDRESS``, what every entry point reads: the
  environment form of ``--ray.address``; ``PIPELINE_PREDICT_RAY_ADDRESS`` for ``flows.predict``'s
  ``--ray-address``; ``RAY_AUTH_MODE=token`` so the
  driver presents the token of ``~/.ray/auth_token``), so the commands stay as a user types them;
- ``python -m deployments.serve`` gets ``--ray-address`` (`serve_args`) and ``RAY_AUTH_MODE=token``
  (`serve_env`), and its runs join it (`tests.support.prefect_server.serve_deployments`'s ``ray``).

Nothing of one test reaches the next through the cluster:

- the head's environment is this process's without any test setting (`head_base_env`: no Prefect
  API, no fault hook, no S3 credentials, no MLflow, no run configuration), so its workers inherit
  none; what a run hands its workers goes in its job's runtime env (`runner.cluster.ray_init.ray_init_args`);
- Ray worker processes belong to one job (one driver): a run's workers, with the modules they
  imported (a test's own model module among them) and the driver's folder on their ``sys.path``,
  end with the run and are never given to the next one (`check_workers_not_shared` proves it);
- the workers' working folder is the head's, an empty folder of its own: a file a run writes
  relative to the working folder instead of its storage root lands there, and the session fails
  at its end (`SharedRay.stray_files`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import chdir, contextmanager
from dataclasses import dataclass
from pathlib import Path

# What no test's run may leave in the head's environment (and so in every worker's).
TEST_SETTING_PREFIXES = ("PREFECT_", "MNIST_", "PIPELINE_", "AWS_", "MLFLOW_", "RAY_")


@dataclass(frozen=True)
class SharedRay:
    """The session's Ray head: its address, the folder its workers run in, its log, its Prometheus metrics' port."""

    address: str
    cwd: Path
    log: Path
    metrics_port: int

    def stray_files(self) -> list[str]:
        """What Ray workers wrote into their working folder (a path that was not under a storage root)."""
        return sorted(str(path.relative_to(self.cwd)) for path in self.cwd.rglob("*"))


def head_base_env() -> dict[str, str]:
    """This process's environment without any test or run setting: the head's, so its workers inherit none."""
    from storage_io import S3_ENV_VARS
    from training.worker.faults import TEST_HOOK_ENVS

    drop = set(S3_ENV_VARS) | set(TEST_HOOK_ENVS)
    return {k: v for k, v in os.environ.items() if k not in drop and not k.startswith(TEST_SETTING_PREFIXES)}


@contextmanager
def shared_cluster(folder: Path, num_cpus: int | None = None) -> Iterator[SharedRay]:
    """A Ray head on 127.0.0.1 for the block (`runner.cluster.ray_head.ray_head`), its workers in an empty ``folder/cwd``.

    ``num_cpus``: its logical CPUs (default: the machine's, as `deployments.serve`'s head and each
    run's own local Ray have).
    """
    from runner.cluster.ray_head import ray_head
    from tests.support.prefect_server import free_port  # as ray_head: imported where the cluster starts

    cwd = folder / "cwd"
    cwd.mkdir(parents=True, exist_ok=True)
    log = folder / "ray-head.log"
    with chdir(cwd):  # `ray start` runs here: its raylet, and every worker the raylet starts, work in this folder
        metrics_port = free_port()
        started = ray_head(log, num_cpus=num_cpus or os.cpu_count(), env=head_base_env(), metrics_port=metrics_port)
        address = started.__enter__()
    try:
        yield SharedRay(address, cwd, log, metrics_port)
    finally:
        started.__exit__(None, None, None)


def join_env(cluster: SharedRay) -> dict[str, str]:
    """The environment entries that make a CLI run (flows.mnist, flows.tune, flows.train, flows.predict) join ``cluster``."""
    return {"PIPELINE_RAY__ADDRESS": cluster.address, "PIPELINE_PREDICT_RAY_ADDRESS": cluster.address, "RAY_AUTH_MODE": "token"}


def serve_args(cluster: SharedRay) -> tuple[str, ...]:
    """``deployments.serve``'s option that makes its runs join ``cluster`` instead of a head of its own."""
    return ("--ray-address", cluster.address)


def serve_env(cluster: SharedRay) -> dict[str, str]:
    """The serving process's environment for ``cluster``: token authentication, which its runs inherit.

    ``deployments.serve`` sets it only for a head it starts itself; with ``--ray-address`` the
    cluster's authentication is the operator's to give (without it every run's driver was refused:
    "InvalidAuthToken")."""
    return {"RAY_AUTH_MODE": "token"}


WORKER_PIDS = """
import os, sys, ray
ray.init(address=sys.argv[1], logging_level="ERROR")
@ray.remote(num_cpus=0)
def where():
    return os.getpid(), os.getcwd()
print(*{ray.get(where.remote()) for _ in range(8)}, sep="\\n")
"""


def check_workers_not_shared(cluster: SharedRay) -> None:
    """Two drivers in a row on ``cluster`` get disjoint worker processes, working in the head's folder."""
    env = {**head_base_env(), "RAY_AUTH_MODE": "token"}
    seen = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", WORKER_PIDS, cluster.address], env=env, cwd=cluster.cwd.parent,
                              capture_output=True, text=True, timeout=180, check=False)
        assert done.returncode == 0, done.stderr[-3000:]
        rows = [eval(line) for line in done.stdout.splitlines() if line.startswith("(")]  # our own script's output
        assert rows and all(cwd == str(cluster.cwd) for _, cwd in rows), rows
        seen.append({pid for pid, _ in rows})
    assert not seen[0] & seen[1], seen
