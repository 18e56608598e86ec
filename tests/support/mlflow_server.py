"""A real MLflow tracking server on 127.0.0.1 (``mlflow server``, SQLite backend, artifacts proxied to a
folder), started by the tests that check what a run records in MLflow; and reading it back."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.support.prefect_server import free_port


class MlflowServer:
    """``mlflow server`` in its own process group, its state under ``folder``; ``uri`` answers /health."""

    def __init__(self, folder: Path):
        folder.mkdir(parents=True, exist_ok=True)
        self.folder, self.port = folder, free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.log = folder / "server.log"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 90) -> MlflowServer:
        command = [
            sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
            "--backend-store-uri", f"sqlite:///{self.folder / 'mlflow.db'}", "--artifacts-destination", str(self.folder / "artifacts"),
        ]
        # MLflow 3's job runner (8 more processes: a runner and 7 huey consumers, each importing mlflow) is
        # for server-side jobs the pipeline never asks for. Measured on a 2-core AMD EPYC (Zen 3): with it,
        # 10 processes and 46-50 s of CPU in the first 25 s, beside the run under test; without it, 2
        # processes and 11-13 s, the same time to answer /health.
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=self.folder,
                                         env=env)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.uri}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"mlflow server did not answer in {timeout_s:.0f} s: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        """SIGKILL the server with its workers (an outage, as far as a client can tell)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def client(self):
        from mlflow import MlflowClient

        return MlflowClient(tracking_uri=self.uri, registry_uri=self.uri)

    def runs(self, experiment: str = "mnist", run_name: str | None = None) -> list:
        """The experiment's runs (of pipeline run ``run_name``: its own and its trials')."""
        client = self.client()
        found = client.get_experiment_by_name(experiment)
        if found is None:
            return []
        query = f"tags.pipeline_run = '{run_name}'" if run_name else ""
        return client.search_runs([found.experiment_id], filter_string=query, max_results=1000)

    def steps(self, run_id: str, key: str = "val_accuracy") -> list[int]:
        """The steps of every point of ``key`` in the run, in order (a repeat shows as a repeated step)."""
        return sorted(int(point.step) for point in self.client().get_metric_history(run_id, key))

    def wait_for_epoch(self, run_name: str, timeout_s: float, alive=None) -> None:
        """Until pipeline run ``run_name`` has its first epoch in this server (``alive``: the run still runs)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            runs = self.runs(run_name=run_name)
            if runs and self.steps(runs[0].info.run_id):
                return
            if alive is not None and not alive():
                raise AssertionError(f"run {run_name} ended before its first epoch reached MLflow")
            time.sleep(1)
        raise TimeoutError(f"run {run_name}'s first epoch did not reach MLflow in {timeout_s:.0f} s")

    def champion_sha256(self, model: str) -> str:
        """sha256 of the model.pt that ``models:/<model>@champion`` downloads."""
        import mlflow
        import mlflow.artifacts

        # models:/ is resolved through the registry URI, set as a user sets it. mlflow's setters also
        # write MLFLOW_TRACKING_URI/MLFLOW_REGISTRY_URI into os.environ, where every later run this
        # process starts would inherit them: both are put back exactly as they were.
        saved = {name: os.environ.get(name) for name in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")}
        mlflow.set_tracking_uri(self.uri)
        mlflow.set_registry_uri(self.uri)
        try:
            local = mlflow.artifacts.download_artifacts(f"models:/{model}@champion")
        finally:
            mlflow.set_tracking_uri(None)
            mlflow.set_registry_uri(None)
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
        # An MLflow pyfunc model (runner.tracking_model) whose artifact "version" is our registry's version folder.
        return hashlib.sha256((Path(local) / "artifacts" / "version" / "model.pt").read_bytes()).hexdigest()
