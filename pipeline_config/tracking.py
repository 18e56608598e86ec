"""Experiment tracking: where a run is recorded in MLflow, if anywhere (`runner.tracking` records it)."""

from __future__ import annotations

from urllib.parse import urlparse

from pydantic import Field, field_validator

from pipeline_config.common import _no_control_characters, _Section


class TrackingConfig(_Section):
    """MLflow tracking: off unless MLFLOW_TRACKING_URI is set (in the environment of the process that
    runs the flow) or uri is given. Credentials come from MLflow's own environment variables, never from here."""

    uri: str | None = Field(
        None,
        description=(
            "MLflow tracking server, e.g. http://mlflow.internal:5000. Unset: MLFLOW_TRACKING_URI from the environment; "
            "neither: tracking is off. Credentials: MLFLOW_TRACKING_USERNAME/PASSWORD or MLFLOW_TRACKING_TOKEN in the "
            "environment, never in this URI."
        ),
    )
    experiment: str | None = Field(None, description="MLflow experiment the run goes into. Unset: the workload's name (mnist).")
    timeout_s: float = Field(
        10.0,
        gt=0,
        le=300,
        description=(
            "Seconds one MLflow request may take (two retries). A server that does not answer in time is given up "
            "on for the rest of the run: training goes on, and the summary lists what was not recorded."
        ),
    )

    @field_validator("uri")
    @classmethod
    def _check_uri(cls, value: str | None) -> str | None:
        if value is None:
            return value
        _no_control_characters(value, "tracking.uri")
        parsed = urlparse(value)
        if parsed.scheme not in {"http", "https"} or not parsed.hostname:
            raise ValueError(f"tracking.uri {value!r}: use the MLflow server's http(s)://host:port address")
        if parsed.username or parsed.password:
            raise ValueError(
                "tracking.uri holds credentials: put them in MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD "
                "(or MLFLOW_TRACKING_TOKEN) in the environment, where flow parameters never keep them"
            )
        return value
