"""Offline checks of the Kubernetes manifests and the Prefect work-pool template in this folder.

No cluster is needed, nor the KubeRay CRDs (which cannot be fetched here): each object is checked

1. against our own JSON Schema of the fields we use (schemas/, written from KubeRay v1.6.2's
   ray.io/v1 API reference and the Kubernetes policy/v1 and core v1 (ConfigMap, Secret) references;
   additionalProperties false, so
   a misspelt field fails here instead of being pruned in silence by the API server);
2. against the rules the KubeRay operator applies when it reconciles, which no schema expresses
   (a TTL needs shutdownAfterJobFinishes, name lengths, authOptions' Ray version, ...), and a
   RayService's serveConfigV2 (`deployments.kubernetes.ray_service`: YAML, Ray Serve's schema, an
   import_path in this repository, its builder's args);
3. against this project: rayVersion is the lock's ray, every image is `<name>:<lock hash>`
   (deployments/images.py), credentials come only from Secrets created outside the manifests (none
   written inline anywhere: entrypoint, command, args, env and envFrom, image references,
   annotations, labels, rayStartParams, serveConfigV2, a ConfigMap's data, a Secret's data or stringData; every
   secret value masked in every message: `deployments.kubernetes.credentials`), each pod's
   grace period outlasts the drain plus a checkpoint upload, and a PodDisruptionBudget protects
   each Ray head;
4. the work-pool template with Prefect's own functions: the server's base-job-template validation,
   its JSON Schema check of the variables, and the worker's template resolution.

    python -m deployments.kubernetes.check [PATH]   # every problem; exit 1 when there is one, 2 for a bad PATH

PATH is a manifest file or a folder of them (*.yaml, *.yml, *.json; default: this folder); a JSON
file with a `job_configuration` is checked as a work-pool template. The shared rules are
`deployments.kubernetes.rules`, the work-pool template's checks `deployments.kubernetes.work_pool`;
this module checks the manifests and runs everything.

tests/test_kubernetes_manifests.py runs these on the files and on broken copies of them.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from pathlib import Path

import jsonschema
import yaml

from deployments.images import LOCK, image_reference
from deployments.kubernetes.credential_text import mask
from deployments.kubernetes.credentials import config_map_credentials, document_findings
from deployments.kubernetes.ray_pods import MAX_NAME_LENGTH, budget_errors, cluster_spec, spec_templates
from deployments.kubernetes.ray_service import service_errors
from deployments.kubernetes.rules import image_errors, lock_version

HERE = Path(__file__).resolve().parent
SCHEMAS = HERE / "schemas"
MANIFEST_SUFFIXES = (".yaml", ".yml", ".json")
SCHEMA_FILES = ("ray.io-v1.schema.json", "policy-v1.schema.json", "core-v1.schema.json")
KUBERAY_VERSION = "v1.6.2"  # the release whose ray.io/v1 API reference schemas/ follows

# The grace-period budget of a Ray pod. DRAIN: what Ray needs after SIGTERM to stop its processes
# and the driver to write its summary (the CLI took 5.2 s from SIGTERM to exit on 2 cores; a busy
# node and the GCS noticing the node gone take longer). CHECKPOINT_UPLOAD: one ResNet-18 checkpoint
# (179 MB with the optimizer state, docs/performance.md) at 3 MB/s, a slow S3 link. A preStop hook
# that waits longer than the upload budget counts with its own length instead.
DRAIN_SECONDS = 30
CHECKPOINT_UPLOAD_SECONDS = 60

DNS_1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
TOKEN_AUTH_MIN_RAY = (2, 52, 0)  # KubeRay refuses authOptions.mode token for an older rayVersion


def load_documents(path: Path) -> list[dict]:
    """The YAML documents of a manifest file, empty ones left out."""
    return [doc for doc in yaml.safe_load_all(Path(path).read_text()) if doc is not None]


def _validator(kind: str) -> jsonschema.Draft202012Validator | None:
    for name in SCHEMA_FILES:
        schema = json.loads((SCHEMAS / name).read_text())
        if kind in schema["$defs"]:
            return jsonschema.Draft202012Validator({"$ref": f"#/$defs/{kind}", "$defs": schema["$defs"]})
    return None


def schema_errors(doc: dict) -> list[str]:
    """Where ``doc`` breaks our schema of its kind, as ``<path>: <message>``, or that its kind has none."""
    kind = doc.get("kind") if isinstance(doc, dict) else None
    validator = _validator(kind) if isinstance(kind, str) else None
    if validator is None:
        return [f"kind {kind!r}: no schema in deployments/kubernetes/schemas/ (add the fields you use from the API reference)"]
    found = []
    for error in sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path))):
        where = ".".join(str(part) for part in error.absolute_path) or "(document)"
        found.append(f"{kind} {where}: {error.message}")
    return found


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def _prestop_sleep(container: dict) -> int:
    """Seconds a ``sleep N`` preStop hook waits (0 without one): the grace period must cover it."""
    command = ((container.get("lifecycle") or {}).get("preStop") or {}).get("exec", {}).get("command") or []
    words = shlex.split(command[-1]) if command and command[0] in ("/bin/sh", "sh", "/bin/bash") else list(command)
    return max((int(words[i + 1]) for i, word in enumerate(words[:-1]) if word == "sleep" and words[i + 1].isdigit()), default=0)


def rule_errors(doc: dict, lock: Path = LOCK) -> list[str]:
    """The operator's rules and this project's for one RayJob, RayCluster or RayService (nothing for other kinds)."""
    kind = doc.get("kind")
    if kind not in MAX_NAME_LENGTH:
        return []
    found = []
    name = (doc.get("metadata") or {}).get("name", "")
    if not DNS_1035_LABEL.match(str(name)) or len(str(name)) > MAX_NAME_LENGTH[kind]:
        found.append(
            f"{kind} metadata.name {name!r}: KubeRay wants a DNS-1035 label (a-z, 0-9, '-', starting with a letter) "
            f"of at most {MAX_NAME_LENGTH[kind]} characters"
        )
    spec = doc.get("spec") or {}
    if kind == "RayJob":
        shutdown = spec.get("shutdownAfterJobFinishes", False)
        ttl = spec.get("ttlSecondsAfterFinished", 0)
        if isinstance(ttl, int) and ttl > 0 and not shutdown:
            found.append(
                "RayJob spec.ttlSecondsAfterFinished: a TTL needs shutdownAfterJobFinishes: true "
                "(KubeRay refuses a RayJob with a TTL that would never delete anything)"
            )
        if isinstance(ttl, int) and ttl < 0:
            found.append("RayJob spec.ttlSecondsAfterFinished: must not be negative")
        if spec.get("suspend") and not shutdown:
            found.append("RayJob spec.suspend: KubeRay suspends only a RayJob with shutdownAfterJobFinishes: true")
        deadline = spec.get("activeDeadlineSeconds")
        if deadline is not None and (not isinstance(deadline, int) or deadline <= 0):
            found.append("RayJob spec.activeDeadlineSeconds: must be a positive number of seconds")
        backoff = spec.get("backoffLimit")
        if isinstance(backoff, int) and backoff < 0:
            found.append("RayJob spec.backoffLimit: must not be negative")
        if "rayClusterSpec" not in spec:
            found.append("RayJob spec.rayClusterSpec: missing (these manifests create their cluster; no clusterSelector)")
        try:
            yaml.safe_load(spec.get("runtimeEnvYAML") or "")
        except yaml.YAMLError as exc:
            found.append(f"RayJob spec.runtimeEnvYAML: not YAML ({exc.__class__.__name__})")
    if kind == "RayService":
        found += service_errors(doc)
    cluster = cluster_spec(doc)
    if cluster is not None:
        found += _cluster_errors(kind, *cluster, lock)
    return found


def _cluster_errors(kind: str, path: str, spec: dict, lock: Path) -> list[str]:
    found = []
    ray = lock_version("ray", lock)
    version = spec.get("rayVersion")
    if version != ray:
        found.append(
            f"{kind} {path}.rayVersion: {version!r} is not the lock's ray {ray!r}; the image holds the lock's Ray "
            f"and KubeRay picks its commands by this version"
        )
    auth = spec.get("authOptions") or {}
    if auth.get("mode", "token" if auth else None) == "token" and (not version or _version(str(version)) < TOKEN_AUTH_MIN_RAY):
        found.append(f"{kind} {path}.authOptions: token authentication needs rayVersion 2.52.0 or later")
    groups = [("Head", spec.get("headGroupSpec") or {})] + [
        (str(g.get("groupName")), g) for g in spec.get("workerGroupSpecs") or [] if isinstance(g, dict)
    ]
    for group_name, group in groups:
        if "labels" in (group.get("rayStartParams") or {}):
            found.append(f"{kind} {path}: rayStartParams 'labels' of group {group_name} is refused by KubeRay")
    names = [name for name, _ in groups[1:]]
    if len(names) != len(set(names)):
        found.append(f"{kind} {path}.workerGroupSpecs: group names must differ ({names})")
    for index, group in enumerate(g for _, g in groups[1:]):
        low, want, high = group.get("minReplicas", 0), group.get("replicas", 0), group.get("maxReplicas", 2**31 - 1)
        if all(isinstance(n, int) for n in (low, want, high)) and not low <= want <= high:
            found.append(f"{kind} {path}.workerGroupSpecs[{index}]: need minReplicas <= replicas <= maxReplicas")
    expected = image_reference(lock)
    for where, role, template in spec_templates(kind, path, spec):
        pod = template.get("spec") or {}
        containers = [c for c in pod.get("containers") or [] if isinstance(c, dict)]
        for index, container in enumerate(containers):
            found += image_errors(f"{kind} {where}.spec.containers[{index}]", container.get("image"), expected)
        wait = max([CHECKPOINT_UPLOAD_SECONDS] + [_prestop_sleep(c) for c in containers])
        grace = pod.get("terminationGracePeriodSeconds")
        if not isinstance(grace, int) or grace <= DRAIN_SECONDS + wait:
            found.append(
                f"{kind} {where}.spec.terminationGracePeriodSeconds: {grace!r} s must be longer than the drain "
                f"({DRAIN_SECONDS} s) plus a checkpoint upload ({wait} s) = {DRAIN_SECONDS + wait} s, or Kubernetes "
                f"kills the {role} pod in the middle of it"
            )
    return found


def check_documents(docs: list, lock: Path = LOCK) -> list[str]:
    """Every problem in one manifest file's documents; a credential found anywhere is masked in every message."""
    found, secrets = [], set()
    config_maps = config_map_credentials(docs)  # what an envFrom's configMapRef takes in
    for index, doc in enumerate(docs):
        if not isinstance(doc, dict):
            found.append(f"document {index + 1}: not a Kubernetes object (a mapping with apiVersion and kind)")
            continue
        found += schema_errors(doc)
        credentials = document_findings(f"{doc.get('kind')} {(doc.get('metadata') or {}).get('name')}", doc, config_maps)
        found += [finding.message for finding in credentials]
        secrets.update(secret for finding in credentials for secret in finding.secrets)
        try:
            found += rule_errors(doc, lock)
        except (AttributeError, KeyError, TypeError, ValueError):  # a shape the schema errors above already name
            found.append(f"{doc.get('kind')}: the operator's and the project's rules not checked; fix the above first")
    objects = [doc for doc in docs if isinstance(doc, dict)]
    try:
        found += budget_errors(objects)
    except (AttributeError, KeyError, TypeError, ValueError):
        found += ["PodDisruptionBudget: not checked; fix the errors above first"]
    return mask(found, secrets)  # a schema error echoes a value of the wrong type: never a secret's


def shown(path: Path) -> str:
    """``path`` as the messages name it: relative to the working folder when it is under it."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def check_file(path: Path, lock: Path = LOCK) -> list[str]:
    """Every problem in one file: its manifests, or the work-pool template it holds."""
    try:
        docs = [doc for doc in yaml.safe_load_all(Path(path).read_text(encoding="utf-8")) if doc is not None]
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        return [f"{shown(path)}: cannot be read as YAML or JSON{at} ({exc.__class__.__name__})"]
    if len(docs) == 1 and isinstance(docs[0], dict) and "job_configuration" in docs[0]:
        from deployments.kubernetes.work_pool import check_work_pool_template  # Prefect: seconds to import

        problems = check_work_pool_template(docs[0], lock)
    else:
        problems = check_documents(docs, lock) if docs else ["no Kubernetes object in the file"]
    return [f"{shown(path)}: {problem}" for problem in problems]


def manifest_files(path: Path) -> list[Path]:
    """``path`` itself, or the manifests directly in the folder ``path`` (sorted by name)."""
    if not Path(path).is_dir():
        return [Path(path)]
    return sorted(p for p in Path(path).iterdir() if p.suffix in MANIFEST_SUFFIXES and p.is_file())


def check_all(lock: Path = LOCK, path: Path = HERE) -> list[str]:
    """Every problem in the manifests at ``path`` (default: deployments/kubernetes/ with the work-pool template)."""
    return [problem for file in manifest_files(path) for problem in check_file(file, lock)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m deployments.kubernetes.check",
        description="Check Kubernetes manifests (KubeRay RayJob, RayCluster and RayService with its serveConfigV2, "
        "PodDisruptionBudget) and a Prefect "
        "Kubernetes work-pool template offline: our schemas, KubeRay's rules, the lock's Ray and image tag, "
        "credentials only from Secrets (none inline anywhere: commands, env, envFrom, images, annotations, labels, "
        "rayStartParams, serveConfigV2, ConfigMaps, a Secret's own values; never printed), grace periods.",
    )
    parser.add_argument(
        "path",
        nargs="?",
        type=Path,
        default=HERE,
        help="a manifest file or a folder of them (*.yaml, *.yml, *.json); default: this check's own folder, "
        "deployments/kubernetes/",
    )
    path = parser.parse_args(argv).path
    if not path.exists():
        parser.error(f"no such file or folder: {path}")
    files = manifest_files(path)
    if not files:
        parser.error(f"no manifests ({', '.join('*' + s for s in MANIFEST_SUFFIXES)}) in the folder {path}")
    problems = [problem for file in files for problem in check_file(file)]
    for problem in problems:
        print(problem)
    names = ", ".join(shown(file) for file in files)
    print(f"{len(problems)} problem(s) in {names}" if problems else f"ok: {names}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
