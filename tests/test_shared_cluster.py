"""Runs that share a Ray cluster queue for it (runner.cluster.cluster_slot): one run at a time, the others waiting and saying so.

Before, two runs joining one 2-CPU cluster each planned its training placement group from the cluster's
total CPUs, both were placed, and neither run's Ray Data tasks could start: both stayed at "[4/7] train"
until killed (issue 66). The fast tests hold the slot on a real local Ray (`local_ray`), one from another
process that is then SIGKILLed; the slow one runs two `flows.train` runs at once on the session's 2-CPU
head (`shared_ray`), as a scheduled and a UI run of one serving process do.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from runner.cluster import cluster_slot
from runner.cluster.ray_init import SignalKeepingRayTaskRunner
from runner.stopping import STOP, RunStopped
from tests.support.cli import CliRun
from tests.support.digits import real_digits_mirror
from tests.support.prefect_server import api_env, far_cron, serve_deployments, smoke_config, stop_group, ui_run_body
from tests.support.ray_cluster import join_env

ROOT = Path(__file__).resolve().parent.parent


def take_in_thread(run: str, lines: list[str], every_s: float) -> tuple[threading.Thread, dict]:
    """``cluster_slot.take(run)`` in a thread of its own; its slot (or error) lands in the dict it returns."""
    got: dict = {}

    def take() -> None:
        try:
            got["slot"] = cluster_slot.take(run, "the test's Ray", say=lines.append, every_s=every_s)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            got["error"] = exc

    thread = threading.Thread(target=take, daemon=True)
    thread.start()
    return thread, got


def wait_until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"no {what} within {timeout_s}s"
        time.sleep(0.1)


def test_a_second_run_waits_saying_whose_run_holds_the_cluster_and_how_long_then_starts_when_it_frees(local_ray):
    first = cluster_slot.take("nightly-1", "the test's Ray", say=pytest.fail)  # free: taken at once, nothing said
    lines: list[str] = []
    thread, got = take_in_thread("manual-2", lines, every_s=1.0)
    try:
        wait_until(lambda: len(lines) >= 3, 60, "third waiting line")
        assert thread.is_alive() and "slot" not in got  # still waiting: the slot is the first run's
        assert cluster_slot.holder()["run"] == "nightly-1"
        for line in lines[:3]:
            assert line.startswith("waiting for the Ray cluster at the test's Ray: run nightly-1 holds it since "), line
        waited = [float(line.rsplit("waited ", 1)[1].rstrip("s")) for line in lines[:3]]
        assert waited == sorted(waited) and waited[2] - waited[0] >= 1.5, lines  # said again, each with how long
    finally:
        cluster_slot.free(first)
    thread.join(60)
    assert "slot" in got, got
    assert lines[-1].startswith("the Ray cluster at the test's Ray is free: run manual-2 starts after waiting "), lines
    assert cluster_slot.holder()["run"] == "manual-2"
    cluster_slot.free(got["slot"])
    wait_until(lambda: cluster_slot.holder() is None, 30, "free slot")


def test_a_stop_request_ends_the_wait(local_ray):
    first = cluster_slot.take("holder", "the test's Ray")
    lines: list[str] = []
    try:
        thread, got = take_in_thread("stopped", lines, every_s=30)
        wait_until(lambda: lines, 60, "waiting line")
        STOP.request("stopped by Ctrl-C (SIGINT)")
        thread.join(30)
    finally:
        STOP.reset()
        cluster_slot.free(first)
    assert isinstance(got.get("error"), RunStopped), got
    assert str(got["error"]) == "stopped by Ctrl-C (SIGINT) while waiting for the Ray cluster"


HOLD_AND_SLEEP = """
import sys, time, ray
ray.init(address=sys.argv[1], logging_level="ERROR")
from runner.cluster import cluster_slot
slot = cluster_slot.take("killed-run", sys.argv[1])  # kept: Ray ends an actor whose last handle goes
print("holding", flush=True)
time.sleep(600)
"""


def test_a_run_killed_while_it_holds_the_cluster_frees_it(local_ray):
    """The slot is an actor its run's driver owns: Ray ends it with a driver killed by SIGKILL (no finally ran)."""
    address = local_ray.get_runtime_context().gcs_address
    driver = subprocess.Popen([sys.executable, "-c", HOLD_AND_SLEEP, address], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert driver.stdout.readline().strip() == "holding"
        assert cluster_slot.holder()["run"] == "killed-run"
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait(30)
    lines: list[str] = []
    start = time.monotonic()
    slot = cluster_slot.take("next-run", "the test's Ray", say=lines.append, every_s=5)
    try:
        assert time.monotonic() - start < 60, lines
        assert cluster_slot.holder()["run"] == "next-run"
    finally:
        cluster_slot.free(slot)


def test_a_run_on_its_own_local_ray_takes_no_slot(local_ray):
    runner = SignalKeepingRayTaskRunner(address="local")
    runner.hold_cluster()
    assert runner._slot is None and cluster_slot.holder() is None


@pytest.mark.slow
@pytest.mark.spine
def test_two_runs_at_once_on_one_2_cpu_cluster_queue_and_both_complete(tmp_path, shared_server, shared_ray):
    """A scheduled and a manual run of `flows.train` joining the session's 2-CPU head, the second started while the
    first runs (same storage root, as one serving process's runs): the second waits, saying for whom, and runs
    once the first has ended. Before the slot both stayed at "[4/7] train" until killed.

    The first is started alone until it holds the cluster (its first stage's line), so the order is known."""
    flags = real_digits_mirror(tmp_path / "mirror", train_per_class=60, test_per_class=20)
    env = api_env(shared_server.api, **join_env(shared_ray))
    args = [*flags, "--train.global-batch-size", "64", "--evaluate.min-accuracy", "0", "--no-promote.enabled"]
    first = CliRun(tmp_path, "scheduled", *args, env=env, module="flows.train")
    try:
        first.wait_for_line("[1/7] download ...", 300)
        second = CliRun(tmp_path, "manual", *args, env=env, module="flows.train")
        try:
            second.wait_for_line(f"waiting for the Ray cluster at {shared_ray.address}: run scheduled holds it since", 300)
            codes = {run.run_name: run.finish(600)[0] for run in (first, second)}
        finally:
            second.kill()
    finally:
        first.kill()
    assert codes == {"scheduled": 0, "manual": 0}, second.output()[-3000:]
    summaries = {run.run_name: run.summary() for run in (first, second)}
    assert {name: s["status"] for name, s in summaries.items()} == {"scheduled": "completed", "manual": "completed"}
    assert "waiting for the Ray cluster" not in first.output()  # the first found it free
    assert f"the Ray cluster at {shared_ray.address} is free: run manual starts after waiting " in second.output()
    # One after the other: the second's first stage began after the first's last one ended (the Prefect API's log times).
    ended = stage_line_time(shared_server, summaries["scheduled"], "[7/7] cleanup done", "TIMESTAMP_DESC")
    began = stage_line_time(shared_server, summaries["manual"], "[1/7] download ...", "TIMESTAMP_ASC")
    assert began > ended, (began, ended)
    # The wait is no stage's time: the second's download took about what the first's did, not the first's whole run.
    assert summaries["manual"]["stages"]["download"]["seconds"] < 60, summaries["manual"]["stages"]
    assert summaries["manual"]["data"]["conversion_skipped"] is True  # it reused the dataset the first built


def stage_line_time(server, summary: dict, line: str, order: str) -> str:
    """When the run's log (the Prefect API's) got ``line``: its last one when ``order`` is newest first."""
    logs = server.post("/logs/filter", {"logs": {"flow_run_id": {"any_": [summary["flow_run_id"]]}}, "sort": order, "limit": 200})
    return next(log["timestamp"] for log in logs if log["message"].startswith(line))


def mirror_config(flags: list[str]) -> dict:
    """`real_digits_mirror`'s CLI flags as the ``download`` section of a run's config."""
    values = dict(zip(flags[::2], flags[1::2]))
    checksums = {key.rsplit(".", 1)[1].replace("-", "_"): value for key, value in values.items() if "mirror-sha256" in key}
    return {"source": "mirror", "mirror_url": values["--download.mirror-url"], "mirror_sha256": checksums}


@pytest.mark.slow
def test_served_with_limit_2_a_scheduled_and_a_ui_run_take_turns_on_the_cluster(tmp_path, shared_server, shared_ray):
    """`deployments.serve --limit 2` on the session's 2-CPU head: two `train/manual` runs created through the API
    a few seconds apart both start (limit 2), the later one waits for the cluster in its log, and both complete."""
    flags = real_digits_mirror(tmp_path / "mirror", train_per_class=60, test_per_class=20)
    proc = serve_deployments(shared_server, tmp_path, "--cron", far_cron(), "--limit", "2", ray=shared_ray)
    try:
        deployment = shared_server.deployment("manual", flow="train")

        def create(name: str) -> str:
            config = smoke_config(tmp_path / "storage", name, global_batch_size=64)
            config["download"] = config["download"] | mirror_config(flags)
            config["evaluate"]["min_accuracy"], config["promote"]["enabled"] = 0.0, False
            return shared_server.post(f"/deployments/{deployment['id']}/create_flow_run", ui_run_body(deployment, {"config": config}, name))["id"]

        ids = {"served-first": create("served-first")}
        # The first holds the cluster (its first stage began) before the second is created.
        wait_until(lambda: any(log["message"].startswith("[1/7] download ...") for log in shared_server.logs(ids["served-first"])),
                   300, "first stage of the first run")
        ids["served-second"] = create("served-second")
        runs = {name: shared_server.wait_final(run_id, tmp_path / "serve.log", timeout_s=600) for name, run_id in ids.items()}
    finally:
        stop_group(proc)
    assert {name: run["state_type"] for name, run in runs.items()} == {"served-first": "COMPLETED", "served-second": "COMPLETED"}
    said = [log["message"] for log in shared_server.logs(ids["served-second"])]
    assert any(line.startswith(f"waiting for the Ray cluster at {shared_ray.address}: run served-first holds it since") for line in said), said
    assert not any("waiting for the Ray cluster" in log["message"] for log in shared_server.logs(ids["served-first"]))
    ended = stage_line_time(shared_server, {"flow_run_id": ids["served-first"]}, "[7/7] cleanup done", "TIMESTAMP_DESC")
    began = stage_line_time(shared_server, {"flow_run_id": ids["served-second"]}, "[1/7] download ...", "TIMESTAMP_ASC")
    assert began > ended, (began, ended)
