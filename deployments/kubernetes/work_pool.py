"""The Prefect Kubernetes work-pool template (prefect-work-pool.json), checked with Prefect's own functions.

The server's base-job-template validation, its JSON Schema check of the variables, and the
worker's template resolution; then the project's rules (`deployments.kubernetes.rules`) on the
job the template resolves to.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from prefect.server.schemas.actions import WorkPoolCreate
from prefect.utilities.schema_tools.validation import is_valid_schema
from prefect.utilities.schema_tools.validation import validate as prefect_validate
from prefect.utilities.templating import find_placeholders
from prefect.workers.base import BaseJobConfiguration
from pydantic import ConfigDict, ValidationError

from deployments.images import LOCK, image_reference
from deployments.kubernetes.credential_text import mask
from deployments.kubernetes.credentials import credential_errors, credential_secrets
from deployments.kubernetes.rules import image_errors

WORK_POOL_TEMPLATE = Path(__file__).resolve().parent / "prefect-work-pool.json"
# What the Prefect Kubernetes worker (prefect-kubernetes 0.8.0, KubernetesWorkerJobConfiguration)
# insists on in a job manifest; that package is not in the lock, so its rule is restated here.
WORKER_REQUIRED = {
    ("apiVersion",): "batch/v1",
    ("kind",): "Job",
    ("spec", "template", "spec", "parallelism"): 1,
    ("spec", "template", "spec", "completions"): 1,
    ("spec", "template", "spec", "restartPolicy"): "Never",
    ("spec", "template", "spec", "containers", 0, "name"): "prefect-job",
}


def _get(obj: Any, path: tuple) -> Any:
    for part in path:
        try:
            obj = obj[part]
        except (KeyError, IndexError, TypeError):
            return None
    return obj


class KubernetesJobConfiguration(BaseJobConfiguration):
    """The fields of the Prefect Kubernetes worker's job configuration (prefect-kubernetes 0.8.0).

    That package is not in the lock, so its configuration class is restated here with the fields a
    template may fill; ``extra="forbid"`` makes a misspelt ``job_configuration`` key fail the way
    an unknown field of a schema does.
    """

    model_config = ConfigDict(extra="forbid")

    annotations: dict[str, str] = {}
    namespace: str = "default"
    job_manifest: dict[str, Any]
    cluster_config: dict[str, Any] | None = None
    job_watch_timeout_seconds: int | None = None
    pod_watch_timeout_seconds: int = 60
    stream_output: bool = True


def resolve_work_pool_template(template: dict, values: dict | None = None) -> dict:
    """The job configuration a Prefect worker builds from ``template`` and a deployment's job variables.

    Prefect's own code does it: ``from_template_and_values`` (the variables' defaults, the
    deployment's values over them, ``apply_values``, block and variable references). Our template
    names no block and no Prefect variable, so the client it would read those with is never called.
    """

    async def resolve() -> KubernetesJobConfiguration:
        return await KubernetesJobConfiguration.from_template_and_values(template, values or {}, client=object())

    return asyncio.run(resolve()).model_dump()


def check_work_pool_template(template: dict, lock: Path = LOCK, values: dict | None = None) -> list[str]:
    """Problems in a Kubernetes work pool's base job template, found with Prefect's own checks first."""
    try:  # what the Prefect server runs on `prefect work-pool create --base-job-template`
        WorkPoolCreate(name="mnist-kubernetes", type="kubernetes", base_job_template=template)
    except ValidationError as exc:
        return [f"work-pool template: Prefect refuses it: {error['msg']}" for error in exc.errors()]
    found = []
    variables = template["variables"]
    try:
        is_valid_schema(variables)
    except ValueError as exc:
        return [f"work-pool template variables: {exc}"]
    defaults = {k: v["default"] for k, v in variables.get("properties", {}).items() if "default" in v}
    try:
        prefect_validate({**defaults, **(values or {})}, variables, raise_on_error=True, preprocess=True, ignore_required=True)
    except Exception as exc:  # Prefect's ValidationError carries the JSON Schema message
        found.append(f"work-pool template variables: the defaults do not fit their own schema: {exc}")
    try:
        resolved = resolve_work_pool_template(template, values)
    except ValidationError as exc:
        return found + [f"work-pool template job_configuration: {e['loc']}: {e['msg']}" for e in exc.errors()]
    left = sorted(p.full_match for p in find_placeholders(resolved) if p.type.value == "standard")
    if left:
        found.append(f"work-pool template: placeholders left after Prefect resolved it: {left}")
    manifest = resolved.get("job_manifest") or {}
    for path, value in WORKER_REQUIRED.items():
        if _get(manifest, path) != value:
            found.append(f"work-pool template job_manifest.{'.'.join(map(str, path))}: the Kubernetes worker needs {value!r}")
    container = _get(manifest, ("spec", "template", "spec", "containers", 0)) or {}
    found += image_errors("work-pool template image (variables.image default)", container.get("image"), image_reference(lock))
    # The resolved configuration: job_manifest's containers, and `env` and `command` from the variables.
    found += credential_errors("work-pool template (resolved)", resolved)
    return mask(found, credential_secrets("work-pool template (resolved)", resolved))
