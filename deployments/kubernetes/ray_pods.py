"""A RayCluster's, RayJob's or RayService's pods: its cluster spec, the pod template of each Ray group, the longest name
KubeRay allows, and the PodDisruptionBudget that must keep its head."""

from __future__ import annotations

from collections.abc import Iterator

# KubeRay appends 6 characters to a RayJob's or RayService's name for its RayCluster, and a RayCluster's
# name plus its longest Service suffix ("-serve-svc") must stay a 63-character DNS label (v1.6.2:
# MaxRayClusterNameLength, MaxRayJobNameLength, MaxRayServiceNameLength in controllers/ray/utils/constant.go).
MAX_NAME_LENGTH = {"RayCluster": 53, "RayJob": 47, "RayService": 47}
# Where each kind holds its RayClusterSpec.
CLUSTER_SPEC_FIELD = {"RayJob": "rayClusterSpec", "RayService": "rayClusterConfig"}


def cluster_spec(doc: dict) -> tuple[str, dict] | None:
    """(path, RayClusterSpec) of a RayCluster, RayJob (``rayClusterSpec``) or RayService (``rayClusterConfig``)."""
    spec = doc.get("spec") or {}
    if doc.get("kind") == "RayCluster":
        return "spec", spec
    field = CLUSTER_SPEC_FIELD.get(str(doc.get("kind")))
    if field and isinstance(spec.get(field), dict):
        return f"spec.{field}", spec[field]
    return None


def pod_templates(doc: dict) -> Iterator[tuple[str, str, dict]]:
    """(path, role, pod template) of each Ray group: ``head``, then each worker group."""
    found = cluster_spec(doc)
    if found is not None:
        yield from spec_templates(str(doc.get("kind")), *found)


def spec_templates(kind: str, path: str, spec: dict) -> Iterator[tuple[str, str, dict]]:
    """(path, role, pod template) of each Ray group of the RayClusterSpec ``spec`` at ``path`` in a ``kind``."""
    head = (spec.get("headGroupSpec") or {}).get("template")
    if isinstance(head, dict):
        yield f"{path}.headGroupSpec.template", "head", head
    for index, group in enumerate(spec.get("workerGroupSpecs") or []):
        if isinstance(group, dict) and isinstance(group.get("template"), dict):
            yield f"{path}.workerGroupSpecs[{index}].template", "worker", group["template"]


def budget_errors(docs: list[dict]) -> list[str]:
    """Each Ray head in a file has a PodDisruptionBudget there that selects it, allows no eviction, and takes no worker."""
    found = []
    budgets = [d for d in docs if isinstance(d, dict) and d.get("kind") == "PodDisruptionBudget"]
    for doc in docs:
        if not isinstance(doc, dict) or doc.get("kind") not in MAX_NAME_LENGTH:
            continue
        templates = list(pod_templates(doc))
        head_labels = next((((t.get("metadata") or {}).get("labels") or {}) for _, role, t in templates if role == "head"), {})
        worker_labels = [((t.get("metadata") or {}).get("labels") or {}) for _, role, t in templates if role == "worker"]
        name = (doc.get("metadata") or {}).get("name")

        def selects(budget: dict, labels: dict) -> bool:
            wanted = ((budget.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
            return bool(wanted) and all(labels.get(k) == v for k, v in wanted.items())

        guarding = [b for b in budgets if selects(b, head_labels)]
        if not guarding:
            found.append(
                f"{doc['kind']} {name}: no PodDisruptionBudget in the file selects its head pod "
                f"(labels {head_labels}); a node drain could evict the head and end "
                f"{'every replica it serves with' if doc['kind'] == 'RayService' else 'every run on it'}"
            )
        for budget in guarding:
            spec = budget.get("spec") or {}
            blocks = spec.get("maxUnavailable") == 0 or (isinstance(spec.get("minAvailable"), int) and spec["minAvailable"] >= 1)
            if not blocks:
                found.append(f"PodDisruptionBudget {budget['metadata'].get('name')}: must allow no eviction of the head (maxUnavailable: 0)")
            if any(selects(budget, labels) for labels in worker_labels):
                found.append(
                    f"PodDisruptionBudget {budget['metadata'].get('name')}: also selects worker pods, whose eviction "
                    f"Ray Train survives; a drain would wait on them for nothing"
                )
    return found
