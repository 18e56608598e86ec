"""The run summary as a type: what a flow returns, what ``summary.json`` holds, what the CLI prints.

`StageRecorder` builds a `RunSummary` and writes it as ``<run>/summary.json`` however the run ends.
The flow returns it (a stopped run's Cancelled state carries it as data; a failed run's exception
carries it, `attach`), so the CLI, the failure hook and the lost-API watch read it from the run
itself, never back from storage. ``summary.json`` keeps the fields it always had: `to_json`.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from pipeline_config import DEFAULT_WORKLOAD
from storage_io import redact_text

SEARCH_MODULE = "flows.tune"  # a search's summary has a ``tuning`` section, even an empty one


class StageRecord(BaseModel):
    """One stage's status (running, completed, failed, interrupted, cancelled), seconds, and error when it failed."""

    status: str = "running"
    seconds: float | None = None
    error: str | None = None


class StopRecord(BaseModel):
    """How a run stopped on request: interrupted (Ctrl-C, SIGTERM) or cancelled (Prefect), in which stage, what it kept."""

    status: str
    stage: str | None = None
    reason: str | None = None
    checkpoint_kept: dict[str, Any] | None = None  # path, epoch, mid_epoch, step (`training.manifests.latest_checkpoint`)


class DataRecord(BaseModel):
    """Where the run's data is and whether its stages were skipped as already verified."""

    raw_dir: str | None = None
    download_skipped: bool | None = None
    dataset_dir: str | None = None
    conversion_skipped: bool | None = None
    rows: dict[str, int] | None = None


class RunSummary(BaseModel):
    """A run's account: where it is, how each stage ended, what it trained, scored and promoted."""

    run_name: str | None = None
    module: str = "flows.mnist"  # the CLI module that resumes it: python -m <module>
    workload: str = DEFAULT_WORKLOAD
    flow_run_id: str | None = None
    storage_root: str | None = None
    run_dir: str | None = None
    data_source: str | None = None
    data: DataRecord = DataRecord()
    status: str = "failed"  # completed, failed, interrupted or cancelled
    stopped: StopRecord | None = None
    stages: dict[str, StageRecord] = {}
    epochs: int | None = None
    best_checkpoint: str | None = None
    best_val_accuracy: float | None = None
    training_attempts: list[dict[str, Any]] | None = None  # one per attempt: start_epoch, world_size
    resumed_from_epoch: int | None = None
    weights: dict[str, str] | None = None  # model.weights training started from: source, file, sha256 (`training.model.weights`)
    test_accuracy: float | None = None
    gate: dict[str, Any] | None = None  # what the test accuracy was held to: ``min_accuracy`` and where it came ``from`` (`tasks.gate`)
    promotion: dict[str, Any] | None = None  # `training.champion.registry.Promotion` as metrics.json holds it
    evaluation: dict[str, Any] = {}  # evaluation/metrics.json
    tuning: dict[str, Any] | None = None  # a search's (`training.tuning`)
    tracking: dict[str, Any] | None = None  # the MLflow run (`runner.tracking`); None: tracking is off
    warnings: list[str] = []  # what the run was warned of before training (too few optimizer steps)
    nothing_new: str | None = None  # why the run ended before training: its data, model and recipe are the champion's
    config: dict[str, Any] = {}
    environment: dict[str, Any] = {}

    def failed_stage(self) -> tuple[str | None, str | None]:
        """(stage name, error) of the first failed stage, or (None, None)."""
        for name, stage in self.stages.items():
            if stage.status == "failed":
                return name, stage.error
        return None, None

    def completed_stages(self) -> list[str]:
        return [name for name, stage in self.stages.items() if stage.status == "completed"]

    @property
    def path(self) -> str | None:
        """Where summary.json is: ``<run_dir>/summary.json``."""
        return f"{self.run_dir.rstrip('/')}/summary.json" if self.run_dir else None

    def to_json(self, config: bool = True) -> dict[str, Any]:
        """The summary.json fields: a stage's ``error`` only when it failed, ``tuning`` only for a search,
        ``tracking`` only when MLflow tracking is on; URLs in errors and tracking without their credentials;
        without ``config``, what the CLI prints (``--json``, ``--summary-out``)."""
        data = self.model_dump(mode="json", exclude=None if config else {"config"})
        for stage in data["stages"].values():
            if stage["error"] is None:
                del stage["error"]
            else:
                stage["error"] = redact_text(stage["error"])
        if self.tuning is None and self.module != SEARCH_MODULE:
            del data["tuning"]
        if self.tracking is None:
            del data["tracking"]
        else:
            data["tracking"] = {key: redact_text(value) if isinstance(value, str) else value for key, value in self.tracking.items()}
        return data


def attach(error: BaseException, summary: RunSummary | None) -> None:
    """Let the exception that ends a run carry its summary to the CLI and the failure hook."""
    if summary is not None:
        error.run_summary = summary  # type: ignore[attr-defined]


def carried_by(error: object) -> RunSummary | None:
    """The summary a run's exception carries (`attach`), if any."""
    summary = getattr(error, "run_summary", None)
    return summary if isinstance(summary, RunSummary) else None


def outcome_of(state: Any) -> tuple[RunSummary | None, BaseException | None]:
    """(summary, error) from a flow run's final state: a completed run's returned summary, a stopped
    run's (its Cancelled state's data), or a failed run's exception and the summary it carries."""
    try:
        result = state.result(raise_on_failure=False)
    except Exception as exc:  # noqa: BLE001 - a result that cannot be read is the run's error
        return None, exc
    if isinstance(result, BaseException):
        return carried_by(result), result
    summary = result if isinstance(result, RunSummary) else None
    error = None if state.is_completed() else RuntimeError(state.message or state.name)
    return summary, error
