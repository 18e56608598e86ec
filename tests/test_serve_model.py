"""``python -m deployments.serve_model``: the champion answers HTTP requests from a real Ray Serve app, as
``flows.predict`` scores the same images, and a promotion swaps the answering version while a client keeps asking,
without a failed request; a damaged new version is refused and the old one keeps answering; bad requests get a 4xx
naming the problem. The swaps come from Prefect's ``pipeline.model.promoted`` events (the pointer is looked at every
600 s in that test, so only an event explains a swap within its deadline), and without a Prefect API from the pointer.
Real parts: the registry on a storage root with real ResNet-18 weights, the command in its own process with its own
local Ray, HTTP on loopback, the session's Prefect server, and ``flows.predict`` on the session's Ray."""

from __future__ import annotations

import base64
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pyarrow.parquet as pq
import pytest

from deployments.promotions import ChampionFollower
from reporting import events
from storage_io import StorageLayout
from tests.support.gate_data import sample_digits
from tests.support.parquet_hf import png
from tests.support.prefect_server import api_env, free_port, using_api
from tests.support.ray_cluster import join_env
from tests.support.registry import candidate, light_candidate, make_dataset
from training.champion import registry

ROOT = Path(__file__).resolve().parents[1]
MODEL = "mnist-resnet18"


def wait_for(url: str, process: subprocess.Popen, log: Path, seconds: float = 240) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert process.poll() is None, log.read_text()[-3000:]
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise AssertionError(f"{url} did not answer within {seconds}s: {log.read_text()[-3000:]}")


@pytest.mark.slow
@pytest.mark.spine
def test_the_champion_answers_and_each_promotion_swaps_it_without_a_failed_request(tmp_path, shared_ray, shared_server):
    layout = StorageLayout.create(str(tmp_path / "root"), "serve")
    dataset = make_dataset(layout, "mnist-a")
    assert registry.promote(layout, MODEL, candidate(layout, "run-1", 0.90, dataset, seed=1)).promoted
    digits, labels = sample_digits(24)
    port, log = free_port(), tmp_path / "serve.log"
    url = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in api_env(shared_server.api).items() if not k.startswith(("PIPELINE_", "RAY_ADDRESS"))}
    command = [sys.executable, "-m", "deployments.serve_model", "--model", MODEL, "--storage-root", layout.root,
               "--port", str(port), "--follow-every", "600"]
    with log.open("w") as out:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(f"{url}/healthz", process, log)
        deadline = time.monotonic() + 30  # the command's line comes once serve.run returns, after the app answers
        while f"Serving {MODEL} v1 on {url}" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert f"Serving {MODEL} v1 on {url}" in log.read_text(), log.read_text()
        info = httpx.get(f"{url}/model", timeout=30).json()
        assert info["version"] == 1 and info["following"]["events"] and info["following"]["pointer_every_s"] == 600, info
        assert "following promotions: Prefect's pipeline.model.promoted events from" in log.read_text()
        deadline = time.monotonic() + 60
        while not httpx.get(f"{url}/model", timeout=30).json()["following"]["events_connected"] and time.monotonic() < deadline:
            time.sleep(0.5)

        # The served answers are flows.predict's on the same images (its run: the session's Ray).
        batch = {"images": [base64.b64encode(png(d)).decode() for d in digits]}
        served = httpx.post(f"{url}/predict", json=batch, timeout=120)
        assert served.status_code == 200, served.text
        answers = served.json()["predictions"]
        assert len(answers) == len(digits)
        for a in answers:  # the class is the most probable; up to five classes, most probable first
            probabilities = [t["probability"] for t in a["top"]]
            assert a["class"] == a["top"][0]["class"] and probabilities == sorted(probabilities, reverse=True)
            assert len(a["top"]) == 5 and 0 < sum(probabilities) <= 1.0001 and a["class"] == str(a["index"])
        folder = tmp_path / "digits"
        folder.mkdir()
        for i, d in enumerate(digits):
            (folder / f"digit-{i:03d}.png").write_bytes(png(d))
        predictions = tmp_path / "predictions.parquet"
        out = subprocess.run([sys.executable, "-m", "flows.predict", "--model", MODEL, "--storage-root", layout.root,
                              "--input", str(folder), "--output", str(predictions)],
                             cwd=ROOT, env=env | join_env(shared_ray), capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        by_file = pq.read_table(predictions).sort_by("row_id").column("pred").to_pylist()  # row ids: file order
        assert [a["index"] for a in answers] == by_file

        # Bad requests: named, 4xx, never a trace.
        refused = httpx.post(f"{url}/predict", content=b"not an image", headers={"content-type": "image/png"})
        assert refused.status_code == 400 and "image.png: not a readable image" in refused.json()["detail"]
        assert httpx.post(f"{url}/predict", content=b"x", headers={"content-type": "text/plain"}).status_code == 415
        big = httpx.post(f"{url}/predict", content=png(np.zeros((20, 20), np.uint8)) + b"\0" * (65 << 20),
                         headers={"content-type": "image/png"}, timeout=60)
        assert big.status_code == 413 and "more than the" in big.json()["detail"]

        # A promotion while a client keeps asking: no request fails, the answers change version once.
        seen, failures, stop = [], [], threading.Event()

        def ask() -> None:
            one = {"images": [batch["images"][0]]}
            while not stop.is_set():
                response = httpx.post(f"{url}/predict", json=one, timeout=60)
                (seen if response.status_code == 200 else failures).append(
                    response.json()["version"] if response.status_code == 200 else response.text)

        client = threading.Thread(target=ask)
        client.start()
        try:
            time.sleep(1)
            assert registry.promote(layout, MODEL, candidate(layout, "run-2", 0.95, dataset, seed=2)).promoted
            promoted(shared_server, layout, 2)
            deadline = time.monotonic() + 60
            while httpx.get(f"{url}/model", timeout=30).json()["version"] != 2 and time.monotonic() < deadline:
                time.sleep(0.5)
            time.sleep(1)
        finally:
            stop.set()
            client.join()
        assert failures == [] and seen[0] == 1 and seen[-1] == 2, (failures, seen)
        assert seen == sorted(seen) and len(seen) > 5  # one change, from 1 to 2, while requests kept coming

        # A new champion whose model.pt is no weights (its checksum is right: it is what the run left): refused, the
        # old one keeps answering.
        assert registry.promote(layout, MODEL, light_candidate(layout, "run-3", 0.97, dataset)).promoted
        promoted(shared_server, layout, 3)
        deadline = time.monotonic() + 60
        while (httpx.get(f"{url}/model", timeout=30).json().get("refused") or {}).get("version") != 3 and time.monotonic() < deadline:
            time.sleep(0.5)
        now = httpx.get(f"{url}/model", timeout=30).json()
        assert now["version"] == 2 and now["refused"]["version"] == 3 and "v3" in now["refused"]["reason"], now
        assert "weights do not load" in now["refused"]["reason"], now
        still = httpx.post(f"{url}/predict", json={"images": batch["images"][:2]}, timeout=60)
        assert still.status_code == 200 and still.json()["version"] == 2
        deadline = time.monotonic() + 10  # the command says what GET /model says within its one-second look
        while "v3 refused" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
    assert process.returncode == 0, log.read_text()[-3000:]
    said = log.read_text()
    assert f"{MODEL}: v2 answers now (was v1)" in said and f"{MODEL}: v3 refused, v2 keeps answering: " in said, said[-3000:]
    # The replica said so as events: v1 and v2 served, v3 refused (sent by the replica, best effort: the server has them).
    body = {"filter": {"event": {"name": [events.SERVED, events.SERVING_REFUSED]}, "resource": {"id": [f"pipeline.model.{MODEL}"]},
                       "order": "ASC"}, "limit": 50}
    mine = [(e["event"], e["payload"]["version"]) for e in shared_server.post("/events/filter", body)["events"]
            if e["payload"].get("storage_root") == layout.root]
    assert mine == [(events.SERVED, 1), (events.SERVED, 2), (events.SERVING_REFUSED, 3)], mine


def promoted(server, layout: StorageLayout, version: int) -> None:
    """The event the promote stage sends after it moved the pointer (`flows.stages.announce_promotion`), to ``server``."""
    with using_api(server.api):
        sent, why = events.send(events.PROMOTED, events.model_resource(MODEL, "mnist", "resnet18"),
                                {"model": MODEL, "version": version, "storage_root": layout.root})
    assert sent, why


def test_without_a_prefect_api_the_follower_reads_the_pointer_and_hands_each_new_version_once(tmp_path):
    layout = StorageLayout.create(str(tmp_path / "root"), "serve")
    dataset = make_dataset(layout, "mnist-a")
    assert registry.promote(layout, MODEL, light_candidate(layout, "run-1", 0.90, dataset)).promoted
    handed: list[int] = []
    follower = ChampionFollower(layout.root, MODEL, 1, handed.append, every_s=0.1, api_url="").start()
    try:
        time.sleep(0.5)
        assert handed == [] and follower.describe()["events"] is False  # the same champion: nothing handed
        assert registry.promote(layout, MODEL, light_candidate(layout, "run-2", 0.95, dataset)).promoted
        deadline = time.monotonic() + 10
        while not handed and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        assert handed == [2]  # once, not at every look
    finally:
        follower.stop()


def test_serve_run_and_a_rayservice_build_the_app_from_args_checked_before_ray(tmp_path):
    """``serve run deployments.serve_model:build storage_root=... model=...`` and a RayService's serveConfigV2 build
    the app with `build`: a champion that is not there, an unknown arg or a bad model name is named before any replica."""
    from ray.serve import Application

    from deployments.serve_model import build

    layout = StorageLayout.create(str(tmp_path / "root"), "serve")
    with pytest.raises(ValueError, match=f"{MODEL}"):
        build({"storage_root": layout.root, "model": MODEL})  # no champion yet
    assert registry.promote(layout, MODEL, light_candidate(layout, "run-1", 0.90, make_dataset(layout, "mnist-a"))).promoted
    assert isinstance(build({"storage_root": layout.root, "model": MODEL, "follow_every_s": "2"}), Application)
    with pytest.raises(ValueError, match="follow_every"):
        build({"storage_root": layout.root, "follow_every": "2"})
    with pytest.raises(ValueError, match="model"):
        build({"storage_root": layout.root, "model": "no/such name"})


def test_the_digits_the_readme_sends_are_the_bundled_samples_first_of_each_class():
    from PIL import Image

    digits, labels = sample_digits(1000)
    for label in range(10):
        first = digits[int(np.flatnonzero(labels == label)[0])]
        assert np.array_equal(np.asarray(Image.open(ROOT / "data" / "digits" / f"{label}.png")), first), label
