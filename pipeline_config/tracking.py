"""Experiment tracking: where a run is recorded in MLflow, if anywhere (`runner.tracking` records it)."""

from __future__ import annotations

from urllib.parse import urlsplit

from pydantic import Field, field_validator

from pipeline_config.common import no_control_characters, Section


class TrackingConfig(Section):
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
        return None if value is None else check_tracking_uri(value, "tracking.uri")


TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"
_CREDENTIALS_GO = "MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) in the environment"


def check_tracking_uri(value: str, name: str) -> str:
    """``value`` when the tracker can use it: an MLflow server's http(s)://host[:port][/path], nothing more.

    ValueError naming ``name`` (``tracking.uri``, or ``MLFLOW_TRACKING_URI`` for the environment's)
    otherwise, without echoing a value that may hold a secret. Refused: a user or password in the
    URL, a ?query or #fragment (MLflow appends its API paths to the URI, and a token there would be
    shown and stored with it), and anything but http(s) with a host (``file:``, ``sqlite:``,
    ``databricks``: the tracker talks to a tracking server, the one place every run process reaches).
    """
    no_control_characters(value, name)
    try:
        parsed = urlsplit(value)
        parsed.port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError:
        raise ValueError(f"{name} is not a URL that can be read (its host or port); use http(s)://host:port") from None
    if "@" in parsed.netloc or ("://" not in value and "@" in value):
        raise ValueError(
            f"{name} holds credentials (user:password@): put them in {_CREDENTIALS_GO}, and set {name} to the "
            f"server's address alone, e.g. https://mlflow.internal:5000"
        )
    if parsed.query or parsed.fragment or value.rstrip().endswith(("?", "#")):
        raise ValueError(
            f"{name} has a ?query or #fragment: MLflow appends its API paths to the address, so set {name} to "
            f"the server's address alone; a token goes in MLFLOW_TRACKING_TOKEN in the environment"
        )
    if parsed.scheme not in {"http", "https"} or not parsed.hostname:
        what = f"a {parsed.scheme}: URI" if "://" in value else "not a server's address"
        unset = f", or unset {name} to run without tracking" if name == TRACKING_URI_ENV else ""
        raise ValueError(
            f"{name} is {what}: runs are tracked on an MLflow tracking server only; use its http(s)://host:port "
            f"address (file:, sqlite: and other local stores are not supported){unset}"
        )
    return value
