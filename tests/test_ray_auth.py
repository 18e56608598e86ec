"""Joining a Ray cluster with token authentication without its token (issue 66): one line naming the address and
how to pass the token, exit 2, before any work.

Real parts: the session's Ray head (`shared_ray`: ``ray start --head`` with ``RAY_AUTH_MODE=token``) and
``python -m flows.train`` as a user types it, with an environment that presents no token, or a wrong one.
Before, the run printed a line of ``InvalidAuthToken`` a second for 20 seconds, then failed with a
ConnectionError naming another address and a hint to resume it, exit 1.
"""

from __future__ import annotations

import subprocess
import sys

from runner.cluster.ray_auth import token_problem
from tests.support.cli import ROOT
from tests.support.ray_cluster import head_base_env


def test_a_run_joining_a_token_head_without_the_token_is_refused_in_one_line_with_exit_2(shared_ray, tmp_path):
    storage = tmp_path / "storage"
    out = subprocess.run(
        [sys.executable, "-m", "flows.train", "--ray.address", shared_ray.address, "--storage-root", str(storage),
         "--run-name", "no-token"],
        cwd=ROOT, env=head_base_env() | {"PREFECT_API_URL": ""}, capture_output=True, text=True, timeout=300, check=False,
    )
    said = out.stdout + out.stderr
    assert out.returncode == 2, said[-3000:]
    assert (f"ray.address {shared_ray.address}: that Ray cluster asks for an authentication token and this process "
            "presents none: set RAY_AUTH_MODE=token") in out.stderr
    assert "InvalidAuthToken" not in said and "resume" not in said and "Traceback" not in said
    assert not (storage / "runs" / "no-token").exists()  # nothing of the run written


def test_a_wrong_token_is_named_by_where_it_came_from(shared_ray):
    """In a fresh interpreter, as the CLI asks: Ray reads its authentication mode once a process, so a test
    process that met Ray earlier would keep the mode it read then."""
    env = head_base_env() | {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "not-the-cluster-token-0123456789abcdef"}
    asked = subprocess.run(
        [sys.executable, "-c", f"from runner.cluster.ray_auth import token_problem; print(token_problem({shared_ray.address!r}))"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False,
    )
    assert asked.returncode == 0, asked.stderr[-3000:]
    problem = asked.stdout.strip().splitlines()[-1]
    assert problem is not None and problem.startswith(f"ray.address {shared_ray.address}: that Ray cluster refused")
    assert "(from RAY_AUTH_TOKEN)" in problem and "not-the-cluster-token" not in problem
    assert token_problem("auto") is None and token_problem("ray://127.0.0.1:10001") is None and token_problem(None) is None


def test_predict_joining_a_token_head_without_the_token_is_refused_naming_its_flag(shared_ray, tmp_path):
    """``flows.predict --ray-address``: the same one line, naming the flag, exit 2, before Ray starts."""
    from storage_io import StorageLayout
    from tests.support.registry import candidate, make_dataset
    from training.champion import registry

    layout = StorageLayout.create(str(tmp_path / "root"), "unused")
    assert registry.promote(layout, "mnist-resnet18", candidate(layout, "good", 0.97, make_dataset(layout, "mnist-a"))).promoted
    out = subprocess.run(
        [sys.executable, "-m", "flows.predict", "--storage-root", layout.root, "--input", str(ROOT / "data" / "mnist-sample"),
         "--ray-address", shared_ray.address],
        cwd=ROOT, env=head_base_env(), capture_output=True, text=True, timeout=300, check=False,
    )
    assert out.returncode == 2, (out.stdout + out.stderr)[-3000:]
    assert f"--ray-address {shared_ray.address}: that Ray cluster asks for an authentication token" in out.stderr
    assert "InvalidAuthToken" not in out.stdout + out.stderr
