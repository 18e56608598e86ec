"""What a failed run tells people: one paragraph in the flow run log and, optionally, a webhook POST.

The paragraph names the stage that failed, the cause, and how to resume (start the run again
with the same run name and storage root: finished download and conversion are skipped and Ray
Train resumes from the run's latest checkpoint).

The webhook URL comes from the environment of the process that runs the flow
(``PIPELINE_FAILURE_WEBHOOK_URL``, or the deprecated ``MNIST_FAILURE_WEBHOOK_URL``: the serve process, the worker, or the CLI's shell), never
from a flow parameter: a URL with a token in it must not be stored with every flow run or shown
in the run form. The POST body is JSON with the paragraph under ``text`` (what Slack-style
incoming webhooks display) plus the fields it was built from.
"""

from __future__ import annotations

import json
import os
from typing import Any
from urllib.parse import urlsplit

import httpx
from pydantic import ValidationError

from pipeline_config import DEFAULT_WORKLOAD
from reporting.artifacts import artifact_keys
from reporting.report_text import gate_verdict
from runner.console import resume_command
from runner.summary import SEARCH_MODULE, RunSummary, outcome_of
from storage_io import redact_error, redact_text, redact_value

WEBHOOK_ENV = "PIPELINE_FAILURE_WEBHOOK_URL"
OLD_WEBHOOK_ENV = "MNIST_FAILURE_WEBHOOK_URL"  # read when WEBHOOK_ENV is unset, named as deprecated
WEBHOOK_TIMEOUT_S = 10.0

def failure_summary(
    flow_run_name: str,
    state_message: str | None,
    summary: RunSummary | None,
    parameters: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Build the failure report: the paragraph and the fields it names.

    Args:
        flow_run_name: The Prefect flow run's name (e.g. ``"witty-fox"``).
        state_message: The failed state's message (Prefect puts the exception there).
        summary: The run's summary when the flow got as far as its stages (`runner.summary.carried_by`).
        parameters: The flow run's parameters, used when there is no summary.

    Returns:
        A dict with ``text`` (the one-paragraph summary), ``stage``, ``cause``, ``run_name``,
        ``storage_root`` and ``run_dir``.
    """
    config = (parameters or {}).get("config") or {}
    if not isinstance(config, dict):  # a PipelineConfig object when the hook runs in-process
        config = config.model_dump(mode="json") if hasattr(config, "model_dump") else {}
    known = summary is not None and summary.run_name is not None  # the run folder exists: resuming it makes sense
    summary = summary or RunSummary()
    stage, error = summary.failed_stage()
    # one paragraph: Prefect's messages for invalid parameters span several lines
    # URLs without their credentials: a refused parameter's validation error echoes its value
    cause = redact_text(" ".join((error or state_message or "unknown error (see the flow run log)").split()).rstrip("."))
    run_name = summary.run_name or config.get("run_name")
    storage_root = summary.storage_root or config.get("storage_root")
    run_dir = summary.run_dir
    where = failure_place(stage, list(summary.stages))
    resume = resume_advice(summary, run_name, storage_root) if known else (
        "Nothing was written yet: fix the cause (the named parameter) and start a new run."
    )
    completed = summary.completed_stages()
    done = f" Stages completed before it: {', '.join(completed)}." if completed else ""
    workload = str((summary.workload if known else None) or config.get("workload") or DEFAULT_WORKLOAD)
    evidence = gate_evidence(summary, workload)  # a run its gate failed: the accuracy, the gate and the artifacts
    searched = summary.module == SEARCH_MODULE or "tune" in config  # the tune flow's run
    named = "MNIST" if workload == DEFAULT_WORKLOAD else workload
    title = f"{named} tune run" if searched else f"{named} pipeline run"
    text = f"{title} {run_name or '(unnamed)'} (flow run {flow_run_name}) failed {where}: {cause}.{done}{evidence} {resume}"
    return {
        "text": text,
        "stage": stage,
        "cause": cause,
        "run_name": run_name,
        "storage_root": storage_root,
        "run_dir": run_dir,
    }


def failure_place(stage: str | None, started: list[str]) -> str:
    """Where the run failed: in a stage, between stages (a report, the summary itself), or before any."""
    if stage:
        return f"in stage '{stage}'"
    if started:
        return f"after stage '{started[-1]}'"
    return "before any stage started (parameters or setup)"


def resume_advice(summary: RunSummary, run_name: str | None, storage_root: str | None) -> str:
    """How to go on with a run whose folder exists: the same run name and storage root, from the CLI or the form."""
    return (
        f"To resume, fix the cause and start the run again with the same run name and storage root: "
        f"`{resume_command(run_name, storage_root, None, summary.module)}`, or a custom run "
        f"from the deployment's form with config.run_name = {run_name}; finished download and conversion "
        f"are skipped and training resumes from the latest checkpoint in {summary.run_dir or 'the run folder'}."
    )


def gate_evidence(summary: RunSummary, workload: str = DEFAULT_WORKLOAD) -> str:
    """For a run whose model fell below its gate: the test accuracy against the gate, where the gate came
    from, and the artifacts that show why; nothing for any other run."""
    evaluation = summary.evaluation
    accuracy, gate = evaluation.get("accuracy"), evaluation.get("min_accuracy")
    if accuracy is None or gate is None or accuracy >= gate:
        return ""
    keys = ", ".join(artifact_keys(workload)[name] for name in ("confusion", "predictions", "metrics", "checkpoint"))
    origin = f" (the gate: {evaluation['gate']})" if evaluation.get("gate") else ""
    return (f" Test accuracy {accuracy:.2%} on {evaluation.get('rows', '?')} images, {gate_verdict(accuracy, gate)}{origin}; "
            f"the evidence is in this run's artifacts {keys}.")


def post_webhook(url: str, payload: dict[str, Any], timeout_s: float = WEBHOOK_TIMEOUT_S) -> int:
    """POST ``payload`` as JSON to ``url``; returns the HTTP status (raises on network errors or 4xx/5xx)."""
    response = httpx.post(url, content=json.dumps(payload), headers={"Content-Type": "application/json"}, timeout=timeout_s)
    response.raise_for_status()
    return response.status_code


def report_failure(flow, flow_run, state) -> None:
    """Prefect ``on_failure`` hook: log the failure summary to the flow run and POST it to the webhook, if set."""
    from prefect.logging.loggers import flow_run_logger  # only when a run failed

    logger = flow_run_logger(flow_run=flow_run, flow=flow)
    summary, error = outcome_of(state)  # the one the failed run's exception carries, built even when writing it failed
    message = state.message
    if isinstance(error, ValidationError):  # its text in the state is shortened already: redacted again from the error
        message = f"{type(error).__name__}: {redact_error(error)}"
    report = redact_value(failure_summary(flow_run.name, message, summary, flow_run.parameters))
    logger.error(report["text"])
    url, variable = webhook_url()
    if not url:
        return
    if variable == OLD_WEBHOOK_ENV:
        logger.warning("%s is deprecated: set %s instead (it is read the same way)", OLD_WEBHOOK_ENV, WEBHOOK_ENV)
    payload = report | {"flow_run_id": str(flow_run.id), "flow_run_name": flow_run.name, "state": state.name}
    try:
        post_webhook(url, payload)
        logger.info("Failure summary posted to the webhook in %s", variable)
    except Exception as exc:  # the paragraph is already in the log; a dead webhook must not hide it
        logger.warning("Failure webhook (%s) failed: %s: %s", variable, type(exc).__name__, webhook_error(exc, url, variable))


def webhook_url() -> tuple[str, str]:
    """(the failure webhook's URL or "", the variable it came from): `WEBHOOK_ENV`, else the deprecated `OLD_WEBHOOK_ENV`."""
    for variable in (WEBHOOK_ENV, OLD_WEBHOOK_ENV):
        url = os.environ.get(variable, "").strip()
        if url:
            return url, variable
    return "", WEBHOOK_ENV


def webhook_error(exc: BaseException, url: str, variable: str = WEBHOOK_ENV) -> str:
    """``exc``'s message without the webhook's URL, which is its secret (a Slack-style URL carries its
    token in the path): the URL is named by its variable, any other URL is redacted."""
    try:
        host = urlsplit(url).hostname
    except ValueError:
        host = None
    return redact_text(str(exc).replace(url, f"${variable}"), hide_hosts=[host] if host else [])
