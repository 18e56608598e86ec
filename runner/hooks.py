"""What a failed run tells people: one paragraph in the flow run log and, optionally, a webhook POST.

The paragraph names the stage that failed, the cause, and how to resume (start the run again
with the same run name and storage root: finished download and conversion are skipped and Ray
Train resumes from the run's latest checkpoint).

The webhook URL comes from the environment of the process that runs the flow
(``MNIST_FAILURE_WEBHOOK_URL``: the serve process, the worker, or the CLI's shell), never
from a flow parameter: a URL with a token in it must not be stored with every flow run or shown
in the run form. The POST body is JSON with the paragraph under ``text`` (what Slack-style
incoming webhooks display) plus the fields it was built from.
"""

from __future__ import annotations

import json
import os
from typing import Any

import httpx

from pipeline_config import DEFAULT_WORKLOAD
from reporting.artifacts import artifact_keys, gate_verdict
from runner.console import resume_command
from storage_io import StorageLayout, read_json

WEBHOOK_ENV = "MNIST_FAILURE_WEBHOOK_URL"
WEBHOOK_TIMEOUT_S = 10.0

# flow run id -> summary.json of that run. The hook runs in the flow's own process after the
# flow function has written its summary, but only the flow knows the run name it picked (a new
# timestamped one when none was given), so the flow leaves the path here for the hook.
_SUMMARIES: dict[str, str] = {}  # a path or an s3:// URI
# flow run id -> the summary the flow last built, for when it could not be written (a full disk).
_LATEST: dict[str, dict[str, Any]] = {}


def remember_run(layout: StorageLayout) -> None:
    """Let the failure hook of the current flow run find this run's ``summary.json``."""
    from prefect.runtime import flow_run

    if flow_run.id:
        _SUMMARIES[str(flow_run.id)] = layout.summary_path


def remember_summary(summary: dict[str, Any]) -> None:
    """Keep the run's latest summary for the failure hook, whether or not it reaches storage."""
    from prefect.runtime import flow_run

    if flow_run.id:
        _LATEST[str(flow_run.id)] = summary


def failed_stage(summary: dict[str, Any]) -> tuple[str | None, str | None]:
    """(stage name, error) of the first failed stage in a run summary, or (None, None)."""
    for name, stage in (summary.get("stages") or {}).items():
        if stage.get("status") == "failed":
            return name, stage.get("error")
    return None, None


def failure_summary(
    flow_run_name: str,
    state_message: str | None,
    summary: dict[str, Any] | None,
    parameters: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Build the failure report: the paragraph and the fields it names.

    Args:
        flow_run_name: The Prefect flow run's name (e.g. ``"witty-fox"``).
        state_message: The failed state's message (Prefect puts the exception there).
        summary: The run's ``summary.json`` when the flow got far enough to write one.
        parameters: The flow run's parameters, used when there is no summary.

    Returns:
        A dict with ``text`` (the one-paragraph summary), ``stage``, ``cause``, ``run_name``,
        ``storage_root`` and ``run_dir``.
    """
    summary = summary or {}
    config = (parameters or {}).get("config") or {}
    if not isinstance(config, dict):  # a PipelineConfig object when the hook runs in-process
        config = config.model_dump(mode="json") if hasattr(config, "model_dump") else {}
    stage, error = failed_stage(summary)
    # one paragraph: Prefect's messages for invalid parameters span several lines
    cause = " ".join((error or state_message or "unknown error (see the flow run log)").split()).rstrip(".")
    run_name = summary.get("run_name") or config.get("run_name")
    storage_root = summary.get("storage_root") or config.get("storage_root")
    run_dir = summary.get("run_dir")
    started = list(summary.get("stages") or {})
    if stage:
        where = f"in stage '{stage}'"
    elif started:  # between stages (a report, the summary itself)
        where = f"after stage '{started[-1]}'"
    else:
        where = "before any stage started (parameters or setup)"
    if summary.get("run_name"):  # the run folder exists: resuming it makes sense
        resume = (
            f"To resume, fix the cause and start the run again with the same run name and storage root: "
            f"`{resume_command(run_name, storage_root, None, summary.get('module', 'flows.mnist'))}`, or a custom run "
            f"from the deployment's form with config.run_name = {run_name}; finished download and conversion "
            f"are skipped and training resumes from the latest checkpoint in {run_dir or 'the run folder'}."
        )
    else:
        resume = "Nothing was written yet: fix the cause (the named parameter) and start a new run."
    completed = [name for name, s in (summary.get("stages") or {}).items() if s.get("status") == "completed"]
    done = f" Stages completed before it: {', '.join(completed)}." if completed else ""
    workload = str(summary.get("workload") or config.get("workload") or DEFAULT_WORKLOAD)
    evidence = gate_evidence(summary, workload) if stage == "evaluate" else ""
    searched = summary.get("module") == "flows.tune" or "tune" in config  # the tune flow's run
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


def gate_evidence(summary: dict[str, Any], workload: str = DEFAULT_WORKLOAD) -> str:
    """For a run that reached its gate: the test accuracy against the gate and the artifacts that show why."""
    evaluation = summary.get("evaluation") or {}
    accuracy, gate = evaluation.get("accuracy"), evaluation.get("min_accuracy")
    if accuracy is None or gate is None:
        return ""
    keys = ", ".join(artifact_keys(workload)[name] for name in ("confusion", "predictions", "metrics", "checkpoint"))
    return f" Test accuracy {accuracy:.2%} on {evaluation.get('rows', '?')} images, {gate_verdict(accuracy, gate)}; the evidence is in this run's artifacts {keys}."


def post_webhook(url: str, payload: dict[str, Any], timeout_s: float = WEBHOOK_TIMEOUT_S) -> int:
    """POST ``payload`` as JSON to ``url``; returns the HTTP status (raises on network errors or 4xx/5xx)."""
    response = httpx.post(url, content=json.dumps(payload), headers={"Content-Type": "application/json"}, timeout=timeout_s)
    response.raise_for_status()
    return response.status_code


def report_failure(flow, flow_run, state) -> None:
    """Prefect ``on_failure`` hook: log the failure summary to the flow run and POST it to the webhook, if set."""
    from prefect.logging.loggers import flow_run_logger

    logger = flow_run_logger(flow_run=flow_run, flow=flow)
    summary_path = _SUMMARIES.pop(str(flow_run.id), None)
    latest = _LATEST.pop(str(flow_run.id), None)
    # The summary the flow built last: the one on storage is older when writing it failed.
    summary = latest or (read_json(summary_path) if summary_path else None)
    report = failure_summary(flow_run.name, state.message, summary, flow_run.parameters)
    logger.error(report["text"])
    url = os.environ.get(WEBHOOK_ENV, "").strip()
    if not url:
        return
    payload = report | {"flow_run_id": str(flow_run.id), "flow_run_name": flow_run.name, "state": state.name}
    try:
        post_webhook(url, payload)
        logger.info("Failure summary posted to the webhook in %s", WEBHOOK_ENV)
    except Exception as exc:  # the paragraph is already in the log; a dead webhook must not hide it
        logger.warning("Failure webhook (%s) failed: %s: %s", WEBHOOK_ENV, type(exc).__name__, exc)
