"""The served champion: ``python -m deployments.serve_model`` under HTTP load, beside ``python -m flows.predict`` on
the same champion and the same images (``benchmarks.run`` calls `measure`; ``--only served`` runs this row alone).

The champion is made without training: the benchmark's model (``PIPELINE_MODEL__NAME``: resnet18, quick: the small
CNN) with seeded random weights, promoted in a fresh registry as ``mnist-<model>`` (its answers are not meant to be
right; both sides load, check and score the same weights). The images are the bundled sample's first test digits as
28x28 PNGs.

* baseline: ``python -m flows.predict`` on a folder of 32 and of 1,000 of them (the whole bundled test set) (quick: 32), each a fresh command with its
  own local Ray, as a user runs it: the command's wall seconds and images/s. Full: once before the server starts and
  once after it stopped (the two never share the cores), the median quoted;
* ours: the serving command in its own process group (its own local Ray, one replica), warmed up, then in each round
  (full: 3, quick: 1) batch 1 (one PNG per request, ``image/png``) and batch 32 (a JSON batch of 32 base64 PNGs per
  request), each sequentially from one client (latency: p50 and p99) and from 4 concurrent clients (throughput:
  requests/s and images/s); the median of the rounds quoted. The seconds until ``GET /healthz`` first answers are
  reported apart;
* ``ratio``: the served images/s at batch 32 with 4 clients over flows.predict's images/s on the largest folder;
  ``latency_ratio``: flows.predict's seconds on 32 images over the served p50 of one batch of 32;
  ``same_answers``: the served classes of the first 32 digits are flows.predict's.
"""

from __future__ import annotations

import base64
import gzip
import io
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from benchmarks import model_name
from benchmarks.serve import load

ROOT = Path(__file__).resolve().parents[2]  # the repository
SAMPLE = ROOT / "data" / "mnist-sample" / "t10k-images-idx3-ubyte.gz"
BATCH, CLIENTS = 32, 4
# Per round: (sequential requests, requests per concurrent client) at batch 1 and at batch 32.
FULL = {"sizes": (32, 1000), "rounds": 3, "batch_1": (100, 50), "batch_32": (20, 10), "predict_reps": 2}
QUICK = {"sizes": (32,), "rounds": 1, "batch_1": (20, 5), "batch_32": (5, 2), "predict_reps": 1}


def registry_name() -> str:
    from pipeline_config import registry_model_name  # the name rules of the registry, as runs name their model

    return registry_model_name("mnist", model_name())


def make_champion(root: Path) -> str:
    """A registry under ``root`` whose champion is the benchmark's model with seeded random weights; the root's path."""
    import torch  # heavy: the checkpoint only

    from storage_io import MANIFEST, StorageLayout, atomic_write_bytes, atomic_write_json, join
    from training.champion import registry, registry_files
    from training.checkpoint.files import MODEL_FILE
    from training.model.catalog import ModelSpec

    layout = StorageLayout.create(str(root), "bench-served")
    spec = ModelSpec(name=model_name(), in_channels=1, num_classes=10)
    torch.manual_seed(0)
    buffer = io.BytesIO()
    torch.save(spec.build().state_dict(), buffer)
    checkpoint = join(layout.runs_dir, "bench-served", "checkpoint_000000")
    atomic_write_bytes(join(checkpoint, MODEL_FILE), buffer.getvalue())
    dataset = join(layout.root, "datasets", "mnist-bench")
    atomic_write_json(join(dataset, MANIFEST), {"fingerprint": "mnist-bench"})
    candidate = registry.Candidate(run_name="bench-served", checkpoint=checkpoint, accuracy=0.99, passed_gate=True,
                                   data_hash=registry_files.data_hash(dataset), dataset_dir=dataset, model=spec.model_dump())
    promotion = registry.promote(layout, registry_name(), candidate)
    if not promotion.promoted:
        raise RuntimeError(f"the benchmark's champion was not promoted: {promotion.reason}")
    return layout.root


def digit_pngs(count: int) -> list[bytes]:
    """The bundled sample's first ``count`` test digits as PNG files' bytes."""
    from PIL import Image  # only to write the PNGs

    pixels = np.frombuffer(gzip.decompress(SAMPLE.read_bytes())[16:], dtype=np.uint8).reshape(-1, 28, 28)[:count]
    out = []
    for digit in pixels:
        buffer = io.BytesIO()
        Image.fromarray(digit).save(buffer, format="PNG")
        out.append(buffer.getvalue())
    return out


def clean_env(home: Path) -> dict[str, str]:
    """This environment without the pipeline's, Prefect's, MLflow's and Ray's settings (no Prefect API: the replica
    follows the pointer only), with its own HOME: what a user's shell hands both commands."""
    home.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIPELINE_", "MNIST_", "PREFECT_", "MLFLOW_", "RAY_ADDRESS"))}
    return env | {"HOME": str(home), "PYTHONUNBUFFERED": "1"}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def stop(process: subprocess.Popen, grace_s: float = 60) -> None:
    """SIGINT the serving command's process group (Ctrl-C: it shuts Ray Serve and its Ray down), SIGKILL what is
    left of it after ``grace_s``."""
    for sig, wait_s in ((signal.SIGINT, grace_s), (signal.SIGKILL, 10)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(wait_s)
        except subprocess.TimeoutExpired:
            continue
        try:  # the command is gone; a process of its group it left behind is not kept
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return


@contextmanager
def serving(root: str, work: Path, timeout_s: float = 300) -> Iterator[tuple[str, float]]:
    """``python -m deployments.serve_model`` on ``root``'s champion, in its own process group: (its URL, the seconds
    from its start to the first answer of ``GET /healthz``). Always stopped (`stop`)."""
    port, log = free_port(), work / "serve.log"
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "deployments.serve_model", "--model", registry_name(), "--storage-root", root,
               "--port", str(port), "--follow-every", "3600"]
    start = time.perf_counter()
    with log.open("w") as out:
        process = subprocess.Popen(command, cwd=ROOT, env=clean_env(work / "home"), stdout=out, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"deployments.serve_model exited ({process.returncode}): {log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{url}/healthz", timeout=5) as answer:
                    if answer.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.perf_counter() - start > timeout_s:
                raise RuntimeError(f"{url}/healthz did not answer within {timeout_s} s: {log.read_text()[-3000:]}")
            time.sleep(0.25)
        yield url, time.perf_counter() - start
    finally:
        stop(process)


def predict(root: str, folder: Path, output: Path, work: Path) -> tuple[float, list[int]]:
    """``python -m flows.predict`` on ``folder``: (its wall seconds, the predicted class of each image in file order)."""
    import pyarrow.parquet as pq  # the predictions only

    command = [sys.executable, "-m", "flows.predict", "--model", registry_name(), "--storage-root", root,
               "--input", str(folder), "--output", str(output), "--overwrite"]
    start = time.perf_counter()
    run = subprocess.run(command, cwd=ROOT, env=clean_env(work / "home"), capture_output=True, text=True, timeout=900,
                         check=False)
    seconds = time.perf_counter() - start
    if run.returncode != 0:
        raise RuntimeError(f"flows.predict failed (exit {run.returncode}): {run.stderr[-3000:]}")
    return seconds, pq.read_table(output).sort_by("row_id").column("pred").to_pylist()


def json_batches(pngs: list[bytes], batch: int = BATCH) -> list[bytes]:
    """``pngs`` in request bodies of ``batch`` images each, ``{"images": [base64 PNG, ...]}``."""
    return [json.dumps({"images": [base64.b64encode(p).decode() for p in pngs[i:i + batch]]}).encode()
            for i in range(0, len(pngs) - batch + 1, batch)]


def measure(work: Path, quick: bool = False) -> dict:
    """The served champion's row (see the module doc)."""
    plan = QUICK if quick else FULL
    work.mkdir(parents=True, exist_ok=True)
    root = make_champion(work / "storage")
    sizes = plan["sizes"]
    pngs = digit_pngs(max(sizes))
    folders = {}
    for n in sizes:
        folders[n] = work / f"images-{n}"
        folders[n].mkdir(exist_ok=True)
        for i, data in enumerate(pngs[:n]):
            (folders[n] / f"digit-{i:04d}.png").write_bytes(data)
    batches = json_batches(pngs)
    predict_runs: dict[int, list[float]] = {n: [] for n in sizes}
    predicted: list[int] = []

    def baseline() -> None:
        nonlocal predicted
        for n in sizes:
            seconds, classes = predict(root, folders[n], work / f"predictions-{n}.parquet", work)
            predict_runs[n].append(seconds)
            predicted = predicted or classes[:BATCH]

    baseline()
    rounds: dict[str, dict[str, list[dict]]] = {b: {"sequential": [], "concurrent": []} for b in ("batch_1", "batch_32")}
    with serving(root, work) as (url, start_s):
        client = load.Client(url)
        try:  # warm-up: the replica's first requests, one answer kept to compare with flows.predict's
            for body in pngs[:4]:
                client.post("/predict", body, "image/png")
            for body in batches[:2]:
                client.post("/predict", body, "application/json")
            served = [a["index"] for a in json.loads(client.post("/predict", batches[0], "application/json")[1])["predictions"]]
        finally:
            client.close()
        for _ in range(plan["rounds"]):
            for name, bodies, kind in (("batch_1", pngs, "image/png"), ("batch_32", batches, "application/json")):
                requests, per_client = plan[name]
                rounds[name]["sequential"].append(load.sequential(url, bodies, kind, requests))
                rounds[name]["concurrent"].append(load.concurrent(url, bodies, kind, CLIENTS, per_client))
    for _ in range(plan["predict_reps"] - 1):  # after the server stopped: baseline, ours, baseline
        baseline()
    served_out = {name: {mode: load.medians(results, 1 if name == "batch_1" else BATCH) for mode, results in modes.items()}
                  for name, modes in rounds.items()}
    baseline_s = {str(n): round(statistics.median(runs), 2) for n, runs in predict_runs.items()}
    baseline_ips = {str(n): round(n / statistics.median(runs), 1) for n, runs in predict_runs.items()}
    largest, ours = str(max(sizes)), served_out["batch_32"]["concurrent"]["images_per_s"]
    marginal = None
    if len(sizes) > 1:  # images/s beyond the command's fixed cost (imports, Ray): the slope between the two folders
        extra_s = statistics.median(predict_runs[sizes[-1]]) - statistics.median(predict_runs[sizes[0]])
        marginal = round((sizes[-1] - sizes[0]) / extra_s, 1) if extra_s > 0 else None
    return {
        "benchmark": "served champion", "model": model_name(), "registry_model": registry_name(), "clients": CLIENTS,
        "batch": BATCH, "rounds": plan["rounds"], "images": len(pngs),
        "baseline": "python -m flows.predict (a fresh command, its own local Ray), same champion and images",
        "baseline_s": baseline_s, "baseline_images_per_s": baseline_ips,
        "baseline_runs": {str(n): [round(s, 2) for s in runs] for n, runs in predict_runs.items()},
        "baseline_marginal_images_per_s": marginal,
        "server_start_s": round(start_s, 2), "served": served_out, "ours_images_per_s": ours,
        "ratio": round(ours / baseline_ips[largest], 2),
        "latency_ratio": round(baseline_s[str(BATCH)] / (served_out["batch_32"]["sequential"]["p50_ms"] / 1000), 1),
        "same_answers": served == predicted, "goal": "(reported)",
    }
