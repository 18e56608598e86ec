"""A promoted version as an MLflow model (`runner.tracking_model`): loaded with ``mlflow.pyfunc`` and served by
``mlflow models serve`` (a real server process on loopback, ``--env-manager local``: this venv), it answers what the
served champion and ``flows.predict`` answer on the same images (`training.serving.Scorer`, which
tests/test_serve_model.py holds to ``flows.predict``). Real parts: a ResNet-18 version in a registry on disk, MLflow's
own loader and scoring server."""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pandas as pd
import pytest

from runner.tracking_model import write_mlflow_model
from storage_io import StorageLayout
from tests.support.gate_data import sample_digits
from tests.support.parquet_hf import png
from tests.support.prefect_server import free_port
from tests.support.registry import candidate, make_dataset
from training.champion import registry
from training.champion.registry_files import version_dir
from training.serving import Scorer

ROOT = Path(__file__).resolve().parents[1]
MODEL = "mnist-resnet18"


@pytest.mark.slow
def test_a_promoted_version_as_an_mlflow_model_answers_as_the_served_champion(tmp_path):
    import mlflow.pyfunc

    layout = StorageLayout.create(str(tmp_path / "root"), "mlflow")
    assert registry.promote(layout, MODEL, candidate(layout, "run-1", 0.9, make_dataset(layout, "mnist-a"), seed=3)).promoted
    model = tmp_path / "model"
    write_mlflow_model(Path(version_dir(layout.root, MODEL, 1)), model)
    digits, _ = sample_digits(12)
    images = [png(d) for d in digits]
    scorer = Scorer(layout.root, MODEL)
    expected = scorer.probabilities(scorer.read([(f"image-{i:05d}.png", data) for i, data in enumerate(images)]))

    loaded = mlflow.pyfunc.load_model(str(model))
    assert loaded.metadata.metadata["registry_version"] == 1 and loaded.metadata.metadata["classes"] == scorer.classes
    assert loaded.metadata.metadata["preprocessing"]["image"] == [1, 28, 28]  # the transform the pyfunc applies itself
    assert [c.name for c in loaded.metadata.get_input_schema().inputs] == ["image"]
    answers = loaded.predict(pd.DataFrame({"image": images}))
    assert list(answers["index"]) == list(expected.argmax(axis=1))
    np.testing.assert_allclose(np.stack(answers["probabilities"]), expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="image-00001.png: not a readable image"):
        loaded.predict(pd.DataFrame({"image": [images[0], b"not an image"]}))

    # `mlflow models serve` of the same model: JSON in (base64 images), the same classes out.
    port, log = free_port(), tmp_path / "serve.log"
    # The venv's bin on PATH, as after `source .venv/bin/activate`: MLflow starts its server as a bare `uvicorn`.
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"file://{tmp_path / 'mlruns'}",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    command = [sys.executable, "-m", "mlflow", "models", "serve", "-m", str(model), "--env-manager", "local",
               "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    with log.open("w") as out:
        server = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert server.poll() is None, log.read_text()[-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/ping", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        body = {"dataframe_split": {"columns": ["image"], "data": [[base64.b64encode(data).decode()] for data in images]}}
        response = httpx.post(f"http://127.0.0.1:{port}/invocations", json=body, timeout=120)
        assert response.status_code == 200, response.text[-3000:]
        served = response.json()["predictions"]
        assert [row["index"] for row in served] == list(expected.argmax(axis=1))
        assert [row["class"] for row in served] == [scorer.classes[i] for i in expected.argmax(axis=1)]
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=60)
