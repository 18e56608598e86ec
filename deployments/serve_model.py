"""Serve a model's champion over HTTP with Ray Serve, following each new champion without a restart.

    python -m deployments.serve_model --model mnist-resnet18        # ./storage's champion on http://127.0.0.1:8000
    curl -s -H 'content-type: image/png' --data-binary @data/digits/7.png http://127.0.0.1:8000/predict
    curl -s http://127.0.0.1:8000/model                              # which version answers, since when

``POST /predict`` takes one PNG or JPEG image (``content-type: image/png`` or ``image/jpeg``), a batch of them as JSON
(``{"images": ["<base64>", ...]}``), or a Parquet file (``application/vnd.apache.parquet``: the dataset schema, or
encoded images in the run's image column), and answers each image's class with its probabilities
(`training.serving.Scorer.answer`). The images are read and checked as ``flows.predict`` reads a folder of them: a file
that is no image, one over the pixel limit or of another channel count or size than the model takes is answered 400
naming it; another content type 415; a body over `MAX_BODY_BYTES` 413. Requests are scored in batches
(``serve.batch``). ``GET /healthz`` answers once the replica holds a version.

Swapping: each replica holds one `training.serving.Scorer` and, serving the champion, follows it
(`deployments.promotions.ChampionFollower`): at each ``pipeline.model.promoted`` event of its model (with a Prefect API:
``PREFECT_API_URL``, or the profile's) and every ``--follow-every`` seconds it reads the champion pointer, and when a
promotion moved it, loads and checks the new version (checksum, ``weights_only`` load, a forward pass) in a thread while
the old one keeps answering on its event loop, then swaps with one assignment, so no request waits for the load or
fails. A version that fails its checks is refused: the old one keeps answering, ``GET /model`` says what was refused and
why, and this command's terminal and a ``pipeline.model.serving-refused`` event say so (a swap:
``pipeline.model.served``). The replica follows, not this command, so an app started by ``serve run
deployments.serve_model:build`` or a KubeRay RayService (`build`) swaps alike. (Not a redeploy with a new
``user_config``: from Python, Ray Serve 2.60 replaces the replica for that, and a replacement that fails to load leaves
nothing answering.)
"""

# No `from __future__ import annotations`: FastAPI reads the endpoints' annotations (a Request) at definition.
import argparse
import asyncio
import base64
import binascii
import json
import logging
import os
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

from deployments.promotions import ChampionFollower
from pipeline_config import DEFAULT_WORKLOAD, ModelConfig, PipelineConfig, PromoteConfig, RayConfig, registry_model_name
from reporting import events
from runner.cluster.ray_init import local_gcs_port, ray_init_args
from runner.prefect_server.api import current_api_url
from storage_io import StorageLayout, redact_text, redact_url
from training.champion import lookup
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


# max_ongoing_requests: at least a full batch of requests (`score`'s max_batch_size 16); Ray Serve's default, 5, would
# cap every batch at 5 requests (it says so in the replica's log).
@serve.deployment(ray_actor_options={"num_cpus": 1}, max_ongoing_requests=32)
@serve.ingress(app)
class ChampionEndpoint:
    """One replica: the version it answers with (`Scorer`); with no version named, the champion, followed by a
    `deployments.promotions.ChampionFollower` that hands it each new one (`swap`)."""

    def __init__(self, root: str, model: str, version: int | None = None, deployed: bool = False, follow_every_s: float = 5.0):
        self.root, self.model, self.deployed = root, model, deployed
        self.scorer = Scorer(root, model, version, deployed=deployed)
        self.refused: dict[str, Any] | None = None
        self._announce(events.SERVED, self.scorer, replaced_version=None)
        self.follower = None if version is not None else ChampionFollower(root, model, self.scorer.version, self.swap, follow_every_s).start()

    def swap(self, version: int) -> None:
        """Load and check ``version`` (in the follower's thread, while the current version keeps answering on this replica's
        event loop), then swap with one assignment, so no request waits for the load or fails; a version that fails is
        refused and the current one kept. Said in the replica's log, ``GET /model`` and an event."""
        try:
            scorer = Scorer(self.root, self.model, version, deployed=self.deployed)
        except Exception as exc:  # any failure of a new version: the old one keeps answering
            self.refused = {"version": version, "reason": str(exc), "at": _now()}
            logger.warning("%s v%s refused, v%s keeps answering: %s", self.model, version, self.scorer.version, exc)
            self._announce(events.SERVING_REFUSED, None, version=version, serving_version=self.scorer.version, reason=str(exc))
        else:
            before, self.scorer = self.scorer.version, scorer  # a request in flight finishes on the version it read
            logger.warning("%s v%s answers now (was v%s)", self.model, scorer.version, before)
            self._announce(events.SERVED, scorer, replaced_version=before)

    def _announce(self, name: str, scorer: Scorer | None, **payload: Any) -> None:
        """One event about this replica's model, when the replica has a Prefect API (best effort: `reporting.events.emit`)."""
        if not os.environ.get("PREFECT_API_URL"):
            return
        card = self.scorer.card
        config = card.get("config") or {}
        resource = events.model_resource(self.model, str(config.get("workload", "")), str((config.get("model") or {}).get("name", "")))
        if scorer is not None:
            payload = {"version": scorer.version, **payload, "run": scorer.card.get("run_name"),
                       "test_accuracy": (scorer.card.get("metrics") or {}).get("test_accuracy")}
        events.emit(name, resource, {"model": self.model, **payload, "storage_root": redact_url(self.root)})

    def __del__(self) -> None:
        if getattr(self, "follower", None) is not None:
            self.follower.stop()

    @app.get("/healthz")
    def healthz(self) -> dict[str, Any]:
        return {"status": "ok", "model": self.model, "version": self.scorer.version}

    @app.get("/model")
    def model_info(self) -> dict[str, Any]:
        following = self.follower.describe() if self.follower is not None else None  # None: a version named, kept
        return {**self.scorer.describe(), "refused": self.refused, "following": following}

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
    parser.add_argument("--follow-every", type=float, default=5.0,
                        help="seconds between looks at the champion pointer (a promotion event looks at once)")
    return parser.parse_args(argv)


def resolved(model: str | None, storage_root: str, version: int | None) -> tuple[str, str, int]:
    """(storage root, registry model name, the version that will answer) from what a user gave, checked before Ray starts:
    ValueError naming a bad model name or storage root, a missing or damaged version."""
    def said(field: str, exc: ValidationError) -> ValueError:  # pydantic's message, without its dump
        return ValueError(f"{field} {exc.errors()[0]['msg'].removeprefix('Value error, ')}")

    try:
        name = PromoteConfig(model_name=model).model_name if model else registry_model_name(DEFAULT_WORKLOAD, ModelConfig().name)
    except ValidationError as exc:
        raise said("model", exc) from None
    try:
        root = StorageLayout.create(PipelineConfig(storage_root=storage_root).storage_root, "serve").root
    except ValidationError as exc:
        raise said("storage root", exc) from None
    return root, name, lookup.resolve(root, name, version)[0]


def build(args: dict[str, str]) -> serve.Application:
    """The app for Ray Serve's own entry points: ``serve run deployments.serve_model:build storage_root=s3://... model=...``
    and a RayService's ``serveConfigV2`` (deployments/kubernetes/rayservice.yaml), ``args`` being the same as the
    command's flags: ``storage_root``, ``model``, ``version`` (pinned: not followed), ``follow_every_s``. Architectures
    named ``module:function`` are held to ``PIPELINE_MODEL_MODULES`` as in every deployment (``deployed``)."""
    unknown = set(args) - {"storage_root", "model", "version", "follow_every_s"}
    if unknown:
        raise ValueError(f"serve_model args: {sorted(unknown)} unknown; it takes storage_root, model, version, follow_every_s")
    pinned = int(args["version"]) if args.get("version") not in (None, "") else None
    root, model, _ = resolved(args.get("model"), args.get("storage_root", "storage"), pinned)
    return ChampionEndpoint.bind(root, model, pinned, deployed=True, follow_every_s=float(args.get("follow_every_s", 5.0)))


def main(argv: list[str] | None = None) -> int:
    """Start (or join) Ray, run the app, say each swap and refusal until Ctrl-C."""
    args = parse_args(argv)
    try:
        root, model, version = resolved(args.model, args.storage_root, args.version)  # a missing or damaged one: exit 2
    except ValueError as exc:
        print(f"cannot serve: {exc}", file=sys.stderr)
        return 2
    api = current_api_url() or ""  # the replica follows promotion events there, and says what it serves
    address, kwargs = ray_init_args(RayConfig(address=args.ray_address), api_url=api)
    if not api:
        kwargs["runtime_env"]["env_vars"].pop("PREFECT_API_URL", None)
    kwargs["logging_level"] = logging.ERROR
    with local_gcs_port(kwargs):
        ray.init(address, **kwargs)
    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # Serve's start-up lines; a replica's warnings still show
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        app = ChampionEndpoint.bind(root, model, args.version, follow_every_s=args.follow_every)
        handle = serve.run(app, name=APP_NAME, route_prefix="/")
        said = handle.model_info.remote().result()
        url = f"http://{args.host}:{args.port}"
        print(f"Serving {model} v{said['version']} on {url}  (POST /predict, GET /model, GET /healthz; Ctrl-C stops it)", flush=True)
        print(f"  curl -s -H 'content-type: image/png' --data-binary @data/digits/7.png {url}/predict", flush=True)
        print(following_line(said.get("following"), api), flush=True)
        while True:
            time.sleep(1)
            now = handle.model_info.remote().result()
            for line in changes(said, now):
                print(line, flush=True)
            said = now
    except KeyboardInterrupt:
        return 0
    finally:
        serve.shutdown()
        ray.shutdown()


def following_line(following: dict[str, Any] | None, api: str) -> str:
    """How the app follows the champion, for the terminal."""
    if following is None:
        return "  a version named: kept, promotions not followed"
    every = f"the champion pointer every {following['pointer_every_s']:g} s"
    if api:
        return f"  following promotions: Prefect's pipeline.model.promoted events from {redact_text(api)}, and {every}"
    return f"  following promotions: {every} (set PREFECT_API_URL to swap at each pipeline.model.promoted event)"


def changes(before: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """What changed between two of the app's ``GET /model`` answers: a swap, a refusal."""
    lines = []
    if now["version"] != before["version"]:
        lines.append(f"{now['model']}: v{now['version']} answers now (was v{before['version']})")
    refused = now.get("refused")
    if refused and refused != before.get("refused"):
        lines.append(f"{now['model']}: v{refused['version']} refused, v{now['version']} keeps answering: {refused['reason']}")
    return lines


if __name__ == "__main__":
    sys.exit(main())
