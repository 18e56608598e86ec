"""The pipeline's domain events: what a run tells the rest of the system, as Prefect events.

Names are stable (the table in docs/operations.md). The resource of a run's events is the model it
trains, ``pipeline.model.<registry name>`` (``promote.model_name``, else ``<workload>-<model>``),
labelled with the workload and ``model.name``; a watched folder's is ``pipeline.folder.<path>``.
The figures go in the payload. Prefect adds the flow run (and its deployment) as related resources,
so an automation or a deployment trigger can match on any of them.

Events are sent by the process that runs the flow, never from a Ray task: a stage's events come from
its hooks (`runner.stages.Stage`, the pipeline's in `flows/stages.py`), which run in the flow's
process around the stage's task, so they leave with the flow run's own Prefect client and API, the
flow run and its deployment related, whichever flow runs the stage; where no Prefect API is
configured, nothing is sent. `emit` queues an
event for Prefect's events worker and returns at once (a run's news: best effort); `send` posts one
and returns only once the API accepted it, for a sender that keeps state by it (the watcher keeps a
folder's listing only after its ``pipeline.data.landed`` was accepted).
"""

from __future__ import annotations

from typing import Any

from storage_io import redact_text, redact_url, redact_value

DATA_CHECKED = "pipeline.data.checked"  # after the conversion: the data's fingerprint, changed or not since the champion's
NOTHING_NEW = "pipeline.run.nothing-new"  # a run ended before training: data, model and recipe are the champion's
GATE_FAILED = "pipeline.gate.failed"  # the test accuracy was below evaluate.min_accuracy
PROMOTED = "pipeline.model.promoted"  # a new champion: model, version, accuracy, run, the champion it replaced
DATA_LANDED = "pipeline.data.landed"  # a watched folder's listing changed (flows.watch)
PREDICTIONS_WRITTEN = "pipeline.predictions.written"  # flows.score wrote a champion's predictions
SERVED = "pipeline.model.served"  # a serving replica answers with a version now (deployments.serve_model)
SERVING_REFUSED = "pipeline.model.serving-refused"  # a serving replica refused a version: its checks failed, the old answers

EVENTS = (DATA_CHECKED, NOTHING_NEW, GATE_FAILED, PROMOTED, DATA_LANDED, PREDICTIONS_WRITTEN, SERVED, SERVING_REFUSED)


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
    from prefect.events import emit_event  # reporting imports no Prefect until it sends

    try:  # every value without a URL's credentials (a storage root, a folder, a mirror), as in the logs
        event = emit_event(event=name, resource=redact_value(resource), payload=redact_value(payload))
    except Exception:  # noqa: BLE001 - the events client is best-effort by design
        return None
    return str(event.id) if event is not None else None


def send(name: str, resource: dict[str, str], payload: dict[str, Any], timeout_s: float = 10.0) -> tuple[str | None, str | None]:
    """Send one event and wait for the Prefect API's answer: (its id, None) once the API accepted it, or
    (None, why not) when it could not be sent (no API, the API unreachable or refusing it).

    Prefect's events worker (`emit`) sends in the background and only logs a failure ("EventsWorker
    failed with N pending items"), so its caller cannot know; this posts the event to the API's
    ``POST /events`` (the events REST endpoint, which answers 204 once the server took it) with the
    process's Prefect client, with the flow run and its deployment as related resources and every value
    redacted, as `emit` does.
    """
    from prefect.settings import PREFECT_API_URL  # reporting imports no Prefect until it sends

    api = PREFECT_API_URL.value()
    if not api:
        return None, "no Prefect API (PREFECT_API_URL is not set)"

    import anyio  # anyio: only when an event is sent
    from prefect.client.orchestration import get_client  # reporting imports no Prefect until it sends
    from prefect.events import Event  # reporting imports no Prefect until it sends
    from prefect.events.related import related_resources_from_run_context  # reporting imports no Prefect until it sends
    from prefect.utilities.asyncutils import run_coro_as_sync  # reporting imports no Prefect until it sends

    async def post() -> str:
        with anyio.fail_after(timeout_s):
            async with get_client() as client:
                related = await related_resources_from_run_context(client, exclude={resource["prefect.resource.id"]})
                event = Event(event=name, resource=redact_value(resource), payload=redact_value(payload), related=related)
                response = await client.request("POST", "/events", json=[event.model_dump(mode="json")])
                response.raise_for_status()
                return str(event.id)

    try:
        return run_coro_as_sync(post()), None
    except TimeoutError:
        return None, f"the Prefect API at {redact_text(api)} did not answer within {timeout_s:g}s"
    except Exception as exc:  # noqa: BLE001 - unreachable, refused, an HTTP error: said, never raised
        import httpx  # httpx: only when a server is asked

        text = redact_text(str(exc).splitlines()[0] if str(exc) else "")
        why = f"{type(exc).__name__}{': ' + text if text else ''}"
        if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
            return None, f"the Prefect API at {redact_text(api)} cannot be reached ({why})"
        return None, f"the Prefect API at {redact_text(api)} did not accept it ({why})"
