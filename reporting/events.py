"""The pipeline's domain events: what a run tells the rest of the system, as Prefect events.

Names are stable (the table in docs/operations.md). The resource of a run's events is the model it
trains, ``pipeline.model.<registry name>`` (``promote.model_name``, else ``<workload>-<model>``),
labelled with the workload and ``model.name``; a watched folder's is ``pipeline.folder.<path>``.
The figures go in the payload. Prefect adds the flow run (and its deployment) as related resources,
so an automation or a deployment trigger can match on any of them.

Events are sent by the process that runs the flow (never from a Ray task), so they leave with the
flow run's own Prefect client; where no Prefect API is configured, nothing is sent.
"""

from __future__ import annotations

from typing import Any

from storage_io import redact_url, redact_value

DATA_CHECKED = "pipeline.data.checked"  # after the conversion: the data's fingerprint, changed or not since the champion's
NOTHING_NEW = "pipeline.run.nothing-new"  # a run ended before training: data, model and recipe are the champion's
GATE_FAILED = "pipeline.gate.failed"  # the test accuracy was below evaluate.min_accuracy
PROMOTED = "pipeline.model.promoted"  # a new champion: model, version, accuracy, run, the champion it replaced
DATA_LANDED = "pipeline.data.landed"  # a watched folder's listing changed (flows.watch)
PREDICTIONS_WRITTEN = "pipeline.predictions.written"  # flows.score wrote a champion's predictions

EVENTS = (DATA_CHECKED, NOTHING_NEW, GATE_FAILED, PROMOTED, DATA_LANDED, PREDICTIONS_WRITTEN)


def model_resource(registry_name: str, workload: str, model: str) -> dict[str, str]:
    """The resource of a training run's events: the registry's model, with its workload and model.name."""
    return {
        "prefect.resource.id": f"pipeline.model.{registry_name}",
        "prefect.resource.name": registry_name,
        "pipeline.workload": workload,
        "pipeline.model": model,
    }


def folder_resource(path: str, workload: str) -> dict[str, str]:
    """The resource of a watched folder's events (its path without credentials)."""
    shown = redact_url(path)
    return {"prefect.resource.id": f"pipeline.folder.{shown}", "prefect.resource.name": shown, "pipeline.workload": workload}


def emit(name: str, resource: dict[str, str], payload: dict[str, Any]) -> str | None:
    """Send one event; its id, or None when no event could be sent (no Prefect API, events off).

    An event is news, not the run's record (summary.json is): failing to send one never fails a run.
    """
    from prefect.events import emit_event

    try:  # every value without a URL's credentials (a storage root, a folder, a mirror), as in the logs
        event = emit_event(event=name, resource=redact_value(resource), payload=redact_value(payload))
    except Exception:  # noqa: BLE001 - the events client is best-effort by design
        return None
    return str(event.id) if event is not None else None
