"""Every run in MLflow: one tracked run per pipeline run, kept up to date from what the run has on storage.

Off unless ``MLFLOW_TRACKING_URI`` (or ``tracking.uri``) names a server. The flow's process is the
only one that talks to MLflow: after each stage, `Tracker.sync` brings the MLflow run up to what
the pipeline run has recorded on its storage root (rank 0's per-epoch rows in ``history.jsonl``,
``evaluation/metrics.json``, the registry's decision), and only what MLflow does not have yet.
That makes every repair safe by construction:

- the MLflow run is found again by its pipeline run name (tag ``pipeline_run``), so a Ray Train
  worker restart, a Prefect retry of a stage and a resume with the same ``--run-name`` all continue
  the one MLflow run;
- an epoch is logged only when its step (the global epoch) is not in MLflow yet, so a resumed
  attempt that trains epoch 5 again after a restart adds no second point;
- a promoted model becomes a version of the registered model of the registry's name once, an MLflow model that
  ``mlflow models serve`` serves (`runner.tracking_model`), the alias ``champion`` moved to it (not deprecated stages).

A tracking server that is down or slow never fails the run: the first failed request is warned
about once, the tracker stops asking for the rest of the run, and the summary lists what was not
recorded (``tracking.not_recorded``). A later resume of the same run fills the gap.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline_config import PipelineConfig
from runner.summary import RunSummary
from runner.tracking_model import write_mlflow_model
from runner.tracking_records import (
    epoch_rows,
    evaluation_files,
    flat_params,
    link_in_prefect,
    prefect_ui_url,
    stored_files,
    tracking_uri,
    trial_ids,
)
from storage_io import StorageLayout, join, read_bytes, redact_error, redact_url
from training.checkpoint.records import HISTORY_FILE

logger = logging.getLogger(__name__)

RUN_TAG = "pipeline_run"  # the pipeline run's name: how a retry or resume finds its MLflow run
TRIAL_TAG = "tune_trial"  # a nested run's Ray Tune trial id
VERSION_TAG = "registry_version"  # our registry's version number of an MLflow model version
WEIGHTS_TAG = "model.weights_sha256"  # the sha256 of the model.weights file training started from
ALIAS = "champion"
EPOCH_METRICS = ("train_loss", "train_accuracy", "val_loss", "val_ce", "val_accuracy", "images_per_s", "lr", "epoch_seconds")
TEST_METRICS = ("accuracy", "accuracy_without_tta")
MAX_PARAMS = 100  # MLflow's limit of params in one log_batch call


class Tracker:
    """The MLflow side of one pipeline run (a no-op when tracking is off); see the module docstring."""

    def __init__(self, config: PipelineConfig, layout: StorageLayout, env: dict[str, Any]):
        self.config, self.layout, self.env = config, layout, env
        self.uri = tracking_uri(config)
        self.experiment = config.tracking.experiment or config.workload
        self.run_id: str | None = None
        self.run_url: str | None = None
        self.given_up = False  # the server failed once: no more requests in this run
        self.not_recorded: list[str] = []
        self.error: str | None = None  # the failure that made the tracker give up, redacted
        self._recorded: set[str] = set()  # what this process recorded already and never changes (artifacts, the version)
        self._client = None
        if self.uri:
            # Bound every request: MLflow's default is 120 s and 7 retries, minutes of a run spent waiting.
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(max(1, round(config.tracking.timeout_s))))
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
            os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")  # the closing summary names the run

    @property
    def enabled(self) -> bool:
        return self.uri is not None

    def record(self) -> dict[str, Any] | None:
        """What summary.json says about tracking (None when it is off)."""
        if not self.enabled:
            return None
        return {
            "uri": redact_url(self.uri), "experiment": self.experiment, "run_id": self.run_id,
            "url": redact_url(self.run_url) if self.run_url else None,
            "not_recorded": sorted(set(self.not_recorded)), "error": self.error,
        }

    def _do(self, what: str, action: Callable[[], Any]) -> Any:
        """Run one MLflow step; on the first failure warn once and give up on the server for this run."""
        if not self.enabled:
            return None
        if self.given_up:
            self.not_recorded.append(what)
            return None
        try:
            return action()
        except Exception as exc:  # noqa: BLE001 - a tracker outage must never fail training
            self.given_up = True
            self.not_recorded.append(what)
            said = redact_error(exc)  # redacted first, shortened after
            self.error = f"{type(exc).__name__}: {said.splitlines()[0][:160] if said else ''}"
            logger.warning(
                "MLflow at %s failed (%s) while recording %s; the run goes on without tracking, and its summary "
                "lists what was not recorded (a resume of the same run records it)", redact_url(self.uri), self.error, what,
            )
            return None

    def client(self):
        if self._client is None:
            from mlflow import MlflowClient  # MLflow: only when a run is tracked

            self._client = MlflowClient(tracking_uri=self.uri, registry_uri=self.uri)
        return self._client

    # The steps, in the order `sync` runs them; each records only what MLflow does not have yet.

    def sync(self, summary: RunSummary, final: bool = False) -> None:
        """Bring the MLflow run up to ``summary`` and the run's files; ``final``: the run ended, close it."""
        if not self.enabled:
            return
        if self.run_id is None:
            self._do("the MLflow run", self._open)
        evaluated = summary.evaluation.get("accuracy") is not None
        promotion = summary.promotion or {}
        if self.run_id is None:  # no MLflow run to record into: everything this sync had to record is missing
            self.not_recorded += ["epoch metrics", *(["test metrics", "artifacts"] if evaluated else []),
                                  *(["the registered model version"] if promotion.get("promoted") else [])]
            return
        self._do("epoch metrics", self._log_epochs)
        if summary.weights:  # model.weights: the source is a param (the config), its checksum a tag
            self._once("the weights' sha256", lambda: self.client().set_tag(self.run_id, WEIGHTS_TAG, summary.weights["sha256"]))
        if evaluated:
            self._do("test metrics", lambda: self._log_test(summary.evaluation))
            self._once("artifacts", lambda: self._log_artifacts(summary))
        if promotion.get("promoted"):
            self._once("the registered model version", lambda: self._register(promotion))
        if summary.tuning:
            self._do("the trials", lambda: self._log_trials(summary.tuning))
        if final:
            status = {"completed": "FINISHED", "interrupted": "KILLED", "cancelled": "KILLED"}.get(summary.status, "FAILED")
            self._do("the run's end", lambda: self.client().set_terminated(self.run_id, status))

    def _once(self, what: str, action: Callable[[], Any]) -> None:
        """`_do`, for a step whose result does not change once it succeeded in this process."""
        if what not in self._recorded:
            self._do(what, action)
            if not self.given_up:
                self._recorded.add(what)

    def sync_epochs(self) -> None:
        """Only the new epochs (while training runs: `runner.watchers.EpochWatcher` calls it)."""
        if self.run_id is None:
            self._do("the MLflow run", self._open)
        if self.run_id is not None:
            self._do("epoch metrics", self._log_epochs)

    def _open(self) -> None:
        """Find this pipeline run's MLflow run (a retry, a resume) or start it; params and tags."""
        client = self.client()
        experiment = client.get_experiment_by_name(self.experiment)
        experiment_id = experiment.experiment_id if experiment else client.create_experiment(self.experiment)
        found = [  # the pipeline run's own, not one of its trials'
            run for run in client.search_runs([experiment_id], filter_string=f"tags.{RUN_TAG} = '{self.layout.run_name}'")
            if TRIAL_TAG not in run.data.tags
        ]
        if found:
            run = found[0]
            if run.info.status != "RUNNING":
                client.update_run(run.info.run_id, status="RUNNING")
        else:
            run = client.create_run(experiment_id, tags={RUN_TAG: self.layout.run_name}, run_name=self.layout.run_name)
        self.run_id = run.info.run_id
        self.run_url = f"{redact_url(self.uri).rstrip('/')}/#/experiments/{experiment_id}/runs/{self.run_id}"
        self._log_params(run.data.params)
        self._set_tags()
        link_in_prefect(self.run_url, self.config.workload)

    def _log_params(self, known: dict[str, str]) -> None:
        from mlflow.entities import Param  # MLflow: only when a run is tracked

        params = flat_params(self.config.model_dump(mode="json"))
        new = [Param(key, value[:6000]) for key, value in params.items() if key not in known]  # a resume keeps the first values
        for start in range(0, len(new), MAX_PARAMS):
            self.client().log_batch(self.run_id, params=new[start : start + MAX_PARAMS])

    def _set_tags(self) -> None:
        from mlflow.entities import RunTag  # MLflow: only when a run is tracked
        from prefect.runtime import flow_run  # only when MLflow tracks the run

        env = self.env
        tags = {
            "workload": self.config.workload,
            "model": self.config.model.name,
            "git_commit": env.get("git_commit") or "unknown",
            "python": env.get("python") or "?",
            "cpu": env.get("cpu_model") or "?",
            "cpu_cores": str(env.get("cpu_cores") or "?"),
            "requirements_lock_sha256": env.get("requirements_lock_sha256") or "?",
            **{f"version.{name}": version or "not installed" for name, version in (env.get("packages") or {}).items()},
        }
        if flow_run.id:  # the latest attempt's flow run (a resume is a new one)
            tags["prefect_flow_run_id"] = str(flow_run.id)
            ui = prefect_ui_url()
            if ui:
                tags["prefect_flow_run_url"] = redact_url(f"{ui.rstrip('/')}/runs/flow-run/{flow_run.id}")
        self.client().log_batch(self.run_id, tags=[RunTag(key, value) for key, value in tags.items()])

    def _log_epochs(self) -> None:
        rows = epoch_rows(join(self.layout.run_dir, HISTORY_FILE))
        self._log_rows(self.run_id, rows)

    def _log_rows(self, run_id: str, rows: dict[int, dict[str, Any]]) -> None:
        """One point per epoch and metric, step = the global epoch; steps MLflow has are left alone."""
        from mlflow.entities import Metric  # MLflow: only when a run is tracked

        if not rows:
            return
        client = self.client()
        have = {int(point.step) for point in client.get_metric_history(run_id, "val_accuracy")}
        now = int(time.time() * 1000)
        points = [
            Metric(key, float(row[key]), int(row.get("finished_at", now / 1000) * 1000), epoch)
            for epoch, row in sorted(rows.items()) if epoch not in have
            for key in EPOCH_METRICS if isinstance(row.get(key), (int, float))
        ]
        for start in range(0, len(points), 1000):
            client.log_batch(run_id, metrics=points[start : start + 1000])

    def _log_test(self, evaluation: dict[str, Any]) -> None:
        from mlflow.entities import Metric  # MLflow: only when a run is tracked

        known = self.client().get_run(self.run_id).data.metrics
        now = int(time.time() * 1000)
        metrics = [Metric(f"test_{key}", float(evaluation[key]), now, 0) for key in TEST_METRICS
                   if isinstance(evaluation.get(key), (int, float)) and f"test_{key}" not in known]
        if metrics:
            self.client().log_batch(self.run_id, metrics=metrics)

    def _log_artifacts(self, summary: RunSummary) -> None:
        """The confusion matrix, curves and metrics.json (a model card: with its model version); rewritten, they replace themselves."""
        history = list(epoch_rows(join(self.layout.run_dir, HISTORY_FILE)).values())
        with tempfile.TemporaryDirectory(prefix="mlflow-") as folder:
            evaluation_files(Path(folder), summary.evaluation, history)
            self.client().log_artifacts(self.run_id, folder, "evaluation")

    def _register(self, promotion: dict[str, Any]) -> None:
        """The promoted version as an MLflow model version with the alias ``champion``, once."""
        from mlflow.exceptions import MlflowException  # MLflow: only when a run is tracked

        client, name, ours = self.client(), promotion["model"], str(promotion["version"])
        try:
            client.get_registered_model(name)
        except MlflowException:
            client.create_registered_model(name, description=f"Promoted by the pipeline's registry: models/{name}/ on its storage root")
        versions = client.search_model_versions(f"name = '{name}'")
        mine = next((v for v in versions if v.tags.get(VERSION_TAG) == ours and v.run_id == self.run_id), None)
        if mine is None:
            self._log_version_folder(promotion["version_dir"])
            source = f"{client.get_run(self.run_id).info.artifact_uri}/model"
            mine = client.create_model_version(name, source, run_id=self.run_id, tags={VERSION_TAG: ours}, await_creation_for=0)
        client.set_registered_model_alias(name, ALIAS, mine.version)

    def _log_version_folder(self, version_dir: str) -> None:
        """Our registry version as an MLflow model, the run's ``model/`` (`runner.tracking_model`)."""
        folder = version_dir if "://" in version_dir or Path(version_dir).is_absolute() else join(self.layout.root, version_dir)
        with tempfile.TemporaryDirectory(prefix="mlflow-model-") as local:  # our files, then the MLflow model of them
            (files := Path(local) / "version").mkdir()
            for path in stored_files(folder):
                (files / Path(path).name).write_bytes(read_bytes(path))
            write_mlflow_model(files, Path(local) / "model")
            self.client().log_artifacts(self.run_id, str(Path(local) / "model"), "model")

    def _log_trials(self, tuning: dict[str, Any]) -> None:
        """One nested run per Ray Tune trial: its sampled recipe and its epochs."""
        client = self.client()
        experiment_id = client.get_run(self.run_id).info.experiment_id
        trials_dir = join(self.layout.run_dir, "trials")
        existing = {
            run.data.tags.get(TRIAL_TAG): run.info.run_id
            for run in client.search_runs([experiment_id], filter_string=f"tags.{RUN_TAG} = '{self.layout.run_name}'")
            if TRIAL_TAG in run.data.tags
        }
        for trial in trial_ids(trials_dir):
            run_id = existing.get(trial)
            if run_id is None:
                tags = {RUN_TAG: self.layout.run_name, TRIAL_TAG: trial, "mlflow.parentRunId": self.run_id}
                run_id = client.create_run(experiment_id, tags=tags, run_name=f"{self.layout.run_name}/{trial}").info.run_id
            self._log_rows(run_id, epoch_rows(join(trials_dir, trial, HISTORY_FILE)))
            client.set_terminated(run_id, "FINISHED")
        best = (tuning.get("best_trial") or {}).get("trial_id")
        if best:
            client.set_tag(self.run_id, "best_trial", best)


