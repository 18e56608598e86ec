"""Serve a model's champion over HTTP with Ray Serve, following each new champion without a restart.

    python -m deployments.serve_model --model mnist-resnet18        # ./storage's champion on http://127.0.0.1:8000
    curl -s -H 'content-type: image/png' --data-binary @digit.png http://127.0.0.1:8000/predict
    curl -s http://127.0.0.1:8000/model                              # which version answers, since when

``POST /predict`` takes one PNG or JPEG image (``content-type: image/png`` or ``image/jpeg``), a batch of them as JSON
(``{"images": ["<base64>", ...]}``), or a Parquet file (``application/vnd.apache.parquet``: the dataset schema, or
encoded images in the run's image column), and answers each image's class with its probabilities
(`training.serving.Scorer.answer`). The images are read and checked as ``flows.predict`` reads a folder of them: a file
that is no image, one over the pixel limit or of another channel count or size than the model takes is answered 400
naming it; another content type 415; a body over `MAX_BODY_BYTES` 413. Requests are scored in batches
(``serve.batch``). ``GET /healthz`` answers once the replica holds a version.

Swapping: the app's one replica holds one `training.serving.Scorer`. This command looks at the champion pointer every
``--follow-every`` seconds and, when a promotion moved it, asks the running replica to swap (`ChampionEndpoint.swap`,
through the app's handle): it loads and checks the new version (checksum, ``weights_only`` load, a forward pass) in a
thread while the old one keeps answering on its event loop, then swaps with one assignment, so no request waits for the
load or fails. A version that fails its checks is refused: the old one keeps answering, ``GET /model`` says what was
refused and why, and this command's terminal says so. (Not a redeploy with a new ``user_config``: from Python, Ray Serve
2.60 replaces the replica for that, and a replacement that fails to load leaves nothing answering.)
"""

# No `from __future__ import annotations`: FastAPI reads the endpoints' annotations (a Request) at definition.
import argparse
import asyncio
import base64
import binascii
import json
import logging
import sys
import time
from datetime import datetime, timezone
from typing import Any

import numpy as np
import pyarrow as pa
import ray
from fastapi import FastAPI, HTTPException, Request
from pydantic import ValidationError
from ray import serve

from pipeline_config import DEFAULT_WORKLOAD, ModelConfig, PipelineConfig, PromoteConfig, RayConfig, registry_model_name
from runner.cluster.ray_init import local_gcs_port, ray_init_args
from storage_io import StorageLayout
from training.champion import lookup
from training.champion.registry_files import read_champion
from training.serving import Scorer

logger = logging.getLogger("ray.serve")
MAX_BODY_BYTES = 64 << 20  # one request's body: a Parquet file of about 80,000 MNIST digits
APP_NAME = "champion"
PNG, JPEG, PARQUET = b"\x89PNG", b"\xff\xd8\xff", b"PAR1"
app = FastAPI(title="Champion", description="The registry's champion, answering with class probabilities.")


# Before the class: Ray Serve pickles it when it is decorated, with the module's names defined by then.
def request_files(content_type: str, body: bytes) -> list[tuple[str, bytes]]:
    """The files a request holds, named by their kind (what `training.serving.Scorer.read` reads); HTTPException 415 for
    a content type this endpoint does not take, 400 for a JSON batch it cannot read."""
    kind = content_type.split(";")[0].strip().lower()
    if kind in ("image/png", "image/jpeg"):
        return [(f"image.{'jpg' if kind == 'image/jpeg' else 'png'}", body)]
    if kind in ("application/vnd.apache.parquet", "application/x-parquet") or (kind == "application/octet-stream" and body[:4] == PARQUET):
        return [("images.parquet", body)]
    if kind == "application/json":
        try:
            images = json.loads(body)["images"]
            decoded = [base64.b64decode(item, validate=True) for item in images]
        except (ValueError, KeyError, TypeError, binascii.Error) as exc:
            raise HTTPException(400, f'a JSON body is {{"images": ["<base64 PNG or JPEG>", ...]}} ({type(exc).__name__}: {exc})') from None
        if not decoded:
            raise HTTPException(400, "images: an empty list")
        return [(f"image-{i:05d}.{'jpg' if data[:3] == JPEG else 'png'}", data) for i, data in enumerate(decoded)]
    raise HTTPException(415, f"content-type {kind or '(none)'}: send image/png, image/jpeg, application/json "
                             '({"images": [base64, ...]}) or application/vnd.apache.parquet')


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


@serve.deployment(ray_actor_options={"num_cpus": 1})
@serve.ingress(app)
class ChampionEndpoint:
    """One replica: the version it answers with (`Scorer`), replaced by `swap`."""

    def __init__(self, root: str, model: str, version: int | None = None, deployed: bool = False):
        self.root, self.model, self.deployed = root, model, deployed
        self.scorer = Scorer(root, model, version, deployed=deployed)
        self.refused: dict[str, Any] | None = None

    async def swap(self, version: int | None) -> dict[str, Any]:
        """Load and check ``version`` (None: the champion) in a thread, while the current version keeps answering on this
        replica's event loop; then swap. A version that fails is refused and the current one kept. What ``GET /model``
        then says."""
        try:
            scorer = await asyncio.to_thread(Scorer, self.root, self.model, version, deployed=self.deployed)
        except Exception as exc:  # any failure of a new version: the old one keeps answering
            self.refused = {"version": version, "reason": str(exc), "at": _now()}
            logger.warning("%s v%s refused, v%s keeps answering: %s", self.model, version, self.scorer.version, exc)
        else:
            self.scorer = scorer  # one assignment: a request in flight finishes on the version it read
            logger.warning("%s v%s answers now", self.model, scorer.version)
        return self.model_info()

    @app.get("/healthz")
    def healthz(self) -> dict[str, Any]:
        return {"status": "ok", "model": self.model, "version": self.scorer.version}

    @app.get("/model")
    def model_info(self) -> dict[str, Any]:
        return {**self.scorer.describe(), "refused": self.refused}

    @app.post("/predict")
    async def predict(self, request: Request) -> dict[str, Any]:
        scorer = self.scorer  # the version this request is answered by, whatever a swap does meanwhile
        body = await request.body()
        if len(body) > MAX_BODY_BYTES:
            raise HTTPException(413, f"the request holds {len(body):,} bytes, more than the {MAX_BODY_BYTES:,} one request may")
        files = request_files(request.headers.get("content-type", ""), body)
        try:
            table = await asyncio.to_thread(scorer.read, files)
        except ValueError as exc:  # flows.predict's checks: named, never a trace
            raise HTTPException(400, str(exc)) from None
        probabilities = await self.score((scorer, table))
        return {"model": self.model, "version": scorer.version, "predictions": scorer.answer(probabilities)}

    @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.005)
    async def score(self, requests: list[tuple[Scorer, pa.Table]]) -> list[np.ndarray]:
        """The requests of one batch scored together, each with the version it was read by."""
        out: list[np.ndarray | None] = [None] * len(requests)
        for scorer in {id(s): s for s, _ in requests}.values():
            mine = [i for i, (s, _) in enumerate(requests) if s is scorer]
            images = [scorer.prepared(requests[i][1]) for i in mine]  # tables of any input kind: their images alike
            probabilities = await asyncio.to_thread(scorer.predictor.probabilities, np.concatenate(images))
            start = 0
            for i, batch in zip(mine, images):
                out[i], start = probabilities[start : start + len(batch)], start + len(batch)
        return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m deployments.serve_model", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="the registry's model name (default: the MNIST workload's, mnist-resnet18)")
    parser.add_argument("--storage-root", default="storage", help="the storage root holding models/ (a folder or s3://bucket/prefix)")
    parser.add_argument("--version", type=int, default=None, help="serve this version, not the champion (and follow nothing)")
    parser.add_argument("--host", default="127.0.0.1", help="the address the HTTP endpoint binds (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=8000, help="the HTTP endpoint's port")
    parser.add_argument("--ray-address", default=None, help="join this Ray cluster (default: start a local one)")
    parser.add_argument("--follow-every", type=float, default=5.0, help="seconds between looks at the champion pointer")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Start (or join) Ray, run the app, follow the champion until Ctrl-C."""
    args = parse_args(argv)
    try:
        model = PromoteConfig(model_name=args.model).model_name if args.model else registry_model_name(DEFAULT_WORKLOAD, ModelConfig().name)
        root = StorageLayout.create(PipelineConfig(storage_root=args.storage_root).storage_root, "serve").root
        version = lookup.resolve(root, model, args.version)[0]  # before Ray starts: a missing or damaged one named, exit 2
    except ValidationError as exc:  # --model or --storage-root: pydantic's message, without its dump
        print(f"cannot serve: {exc.errors()[0]['msg'].removeprefix('Value error, ')}", file=sys.stderr)
        return 2
    except ValueError as exc:  # no such model or version, a damaged registry: named by the registry
        print(f"cannot serve: {exc}", file=sys.stderr)
        return 2
    address, kwargs = ray_init_args(RayConfig(address=args.ray_address), api_url="")
    kwargs["runtime_env"]["env_vars"].pop("PREFECT_API_URL", None)  # no Prefect here
    kwargs["logging_level"] = logging.ERROR
    with local_gcs_port(kwargs):
        ray.init(address, **kwargs)
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        handle = serve.run(ChampionEndpoint.bind(root, model, version), name=APP_NAME, route_prefix="/")
        url = f"http://{args.host}:{args.port}"
        print(f"Serving {model} v{version} on {url}  (POST /predict, GET /model, GET /healthz; Ctrl-C stops it)", flush=True)
        print(f"  curl -s -H 'content-type: image/png' --data-binary @digit.png {url}/predict", flush=True)
        while True:
            time.sleep(args.follow_every)
            now = _champion(root, model) if args.version is None else version
            if now is not None and now != version:
                print(f"{model}: champion v{now} promoted, swapping from v{version}", flush=True)
                print(swap_outcome(handle.swap.remote(now).result(), now), flush=True)
                version = now
    except KeyboardInterrupt:
        return 0
    finally:
        serve.shutdown()
        ray.shutdown()


def swap_outcome(info: dict[str, Any], wanted: int) -> str:
    """What a swap to ``wanted`` did, from the app's ``GET /model``: the version that answers, or why it was refused."""
    refused = info.get("refused") or {}
    if info["version"] != wanted and refused.get("version") == wanted:
        return f"{info['model']}: v{wanted} refused, v{info['version']} keeps answering: {refused['reason']}"
    return f"{info['model']}: v{info['version']} answers now"


def _champion(root: str, model: str) -> int | None:
    """The champion pointer's version now (None when it is missing)."""
    pointer = read_champion(root, model)
    return pointer["version"] if pointer else None


if __name__ == "__main__":
    sys.exit(main())
