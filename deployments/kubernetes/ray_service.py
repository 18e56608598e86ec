"""A RayService's own rules: KubeRay v1.6.2's (ValidateRayServiceMetadata, ValidateRayServiceSpec, the serve Service's
ports) and its serveConfigV2's.

serveConfigV2 is Ray Serve's config as a YAML string, which neither the API server nor KubeRay reads: a mistake in it
shows only when the cluster is up and Ray Serve refuses the app. Here it must parse as YAML, pass our subset of Ray
Serve's config schema (schemas/serve-config.schema.json, closed), hold unique application names and route prefixes, and
each application's ``import_path`` must be ``module:attribute`` with the module in this repository's packages (the
image's: pyproject.toml) and the attribute defined in it, read with `ast` (nothing is imported: no Ray Serve, no model
code). ``args`` go only to a builder function, and only those it takes: the names it subtracts from ``set(args)`` to
find unknown ones (``deployments.serve_model:build``); ``deployments`` only name the module's ``@serve.deployment``s.
The credentials in it are `deployments.kubernetes.credentials`' (``serveConfigV2``).
"""

from __future__ import annotations

import ast
import fnmatch
import json
import re
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from deployments.kubernetes.ray_pods import cluster_spec
from pipeline_config.common import MODEL_NAME_PATTERN

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SERVE_SCHEMA = HERE / "schemas" / "serve-config.schema.json"
IMPORT_PATH = re.compile(r"^([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*):([A-Za-z_]\w*)$")
INITIALIZING_TIMEOUT = "ray.io/initializing-timeout"  # KubeRay: a positive Go duration or number of seconds
_GO_DURATION = re.compile(r"^(?:(?:\d+(?:\.\d*)?|\.\d+)(?:ns|us|µs|ms|s|m|h))+$")
SERVING_PORT = "serve"  # KubeRay's serve Service takes the head's ports named serve or serve-*
DASHBOARD_PORT = "dashboard"  # ... and deploys serveConfigV2 through the head Service's port of this name
SERVE_MODEL_BUILD = "deployments.serve_model:build"


def service_errors(doc: dict) -> list[str]:
    """KubeRay's rules and this project's for one RayService, serveConfigV2's included."""
    found = []
    spec = doc.get("spec") or {}
    timeout = str(((doc.get("metadata") or {}).get("annotations") or {}).get(INITIALIZING_TIMEOUT, ""))
    if timeout and not (_GO_DURATION.match(timeout) and re.search(r"[1-9]", timeout) or timeout.isdigit() and int(timeout) > 0):
        found.append(
            f"RayService metadata.annotations.{INITIALIZING_TIMEOUT}: {timeout!r} is no positive duration ('30m', '1h') "
            f"or number of seconds; KubeRay refuses the RayService"
        )
    text = spec.get("serveConfigV2")
    if not isinstance(text, str) or not text.strip():
        found.append(
            "RayService spec.serveConfigV2: missing; these manifests deploy their applications (KubeRay would start a "
            "cluster that serves nothing)"
        )
    else:
        found += serve_config_errors("RayService spec.serveConfigV2", text)
    cluster = cluster_spec(doc)
    if cluster is not None:
        found += _port_errors(*cluster)
        found += _upgrade_errors(spec.get("upgradeStrategy") or {}, cluster[1])
    return found


def _port_errors(path: str, cluster: dict) -> list[str]:
    containers = ((((cluster.get("headGroupSpec") or {}).get("template") or {}).get("spec") or {}).get("containers") or [{}])
    ports = [str(port.get("name", "")) for port in (containers[0] or {}).get("ports") or [] if isinstance(port, dict)]
    if not ports:  # KubeRay's default ports: dashboard and serve among them
        return []
    found = []
    if DASHBOARD_PORT not in ports:
        found.append(
            f"RayService {path}.headGroupSpec.template.spec.containers[0].ports: no port named {DASHBOARD_PORT!r}; "
            f"KubeRay deploys serveConfigV2 through the head Service's dashboard port, which takes only these ports"
        )
    if not any(name == SERVING_PORT or name.startswith(SERVING_PORT + "-") for name in ports):
        found.append(
            f"RayService {path}.headGroupSpec.template.spec.containers[0].ports: no port named {SERVING_PORT!r} "
            f"(containerPort 8000); KubeRay creates no serve Service (<name>-serve-svc) without it"
        )
    return found


def _upgrade_errors(strategy: dict, cluster: dict) -> list[str]:
    if strategy.get("type") != "NewClusterWithIncrementalUpgrade":
        return []
    found = []
    where = "RayService spec.upgradeStrategy"
    if not cluster.get("enableInTreeAutoscaling"):
        found.append(f"{where}: NewClusterWithIncrementalUpgrade needs the Ray autoscaler (rayClusterConfig.enableInTreeAutoscaling: true)")
    options = strategy.get("clusterUpgradeOptions")
    if not isinstance(options, dict):
        found.append(
            f"{where}: NewClusterWithIncrementalUpgrade needs clusterUpgradeOptions (stepSizePercent, intervalSeconds, "
            f"gatewayClassName) and the operator's RayServiceIncrementalUpgrade feature gate"
        )
        return found
    for field in ("maxSurgePercent", "stepSizePercent"):
        value = options.get(field, 100 if field == "maxSurgePercent" else None)
        if not isinstance(value, int) or not 0 <= value <= 100:
            found.append(f"{where}.clusterUpgradeOptions.{field}: must be between 0 and 100")
    if not isinstance(options.get("intervalSeconds"), int) or options["intervalSeconds"] <= 0:
        found.append(f"{where}.clusterUpgradeOptions.intervalSeconds: must be greater than 0")
    if not options.get("gatewayClassName"):
        found.append(f"{where}.clusterUpgradeOptions.gatewayClassName: required (the Gateway API class to route by)")
    return found


def _path(parts: Any) -> str:
    return "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in parts).lstrip(".")


def serve_config_errors(where: str, text: str) -> list[str]:
    """What is wrong with serveConfigV2's ``text``, each message starting with ``where``."""
    try:
        config = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at its line {mark.line + 1}" if mark is not None else ""
        return [f"{where}: not YAML{at} ({exc.__class__.__name__}); it is Ray Serve's config as a YAML string"]
    schema = json.loads(SERVE_SCHEMA.read_text())
    validator = jsonschema.Draft202012Validator({"$ref": "#/$defs/ServeConfigV2", "$defs": schema["$defs"]})
    errors = sorted(validator.iter_errors(config), key=lambda e: list(map(str, e.absolute_path)))
    if errors:
        return [f"{where} {_path(e.absolute_path) or '(config)'}: {e.message} (schemas/serve-config.schema.json)" for e in errors]
    found = []
    applications = config["applications"]
    for field in ("name", "route_prefix"):
        values = [app.get(field, "/" if field == "route_prefix" else None) for app in applications]
        if len(values) != len(set(values)):
            found.append(f"{where} applications: each application's {field} must differ ({values}); Ray Serve refuses the config")
    for index, app in enumerate(applications):
        found += _application_errors(f"{where} applications[{index}]", app)
    return found


def image_packages() -> list[str]:
    """The patterns of the packages the image installs (pyproject.toml's setuptools ``include``)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    return project["tool"]["setuptools"]["packages"]["find"]["include"]


def module_file(module: str) -> Path | None:
    """The file of ``module`` in this repository (``a/b.py`` or ``a/b/__init__.py``), or None."""
    base = REPO.joinpath(*module.split("."))
    return next((file for file in (base.with_suffix(".py"), base / "__init__.py") if file.is_file()), None)


def top_level_names(tree: ast.Module) -> dict[str, ast.AST]:
    """What a module defines at its top (also under ``if`` and ``try``): name -> its def, its value, or its import."""
    names: dict[str, ast.AST] = {}

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names[node.name] = node
            elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names.update({n.id: node.value for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)})
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update({(alias.asname or alias.name).split(".")[0]: node for alias in node.names})
            elif isinstance(node, (ast.If, ast.Try)):
                for block in (node.body, node.orelse, getattr(node, "finalbody", []), *[h.body for h in getattr(node, "handlers", [])]):
                    visit(block)

    visit(tree.body)
    return names


def _strings(node: ast.AST, names: dict[str, ast.AST]) -> set[str] | None:
    """The strings of a literal set, list or tuple, through set()/frozenset() and a module constant's name."""
    if isinstance(node, (ast.Set, ast.List, ast.Tuple)):
        values = [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
        return set(values) if len(values) == len(node.elts) else None
    if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("set", "frozenset", "tuple", "list") and len(node.args) == 1:
        return _strings(node.args[0], names)
    if isinstance(node, ast.Name) and node.id in names:
        return _strings(names[node.id], names)
    return None


def builder_args(function: ast.FunctionDef | ast.AsyncFunctionDef, names: dict[str, ast.AST]) -> set[str] | None:
    """The args an application builder takes: what it subtracts from ``set(args)`` to find the unknown ones (a literal
    set, or a module constant), as `deployments.serve_model.build` does; None when it does no such thing."""
    param = function.args.args[0].arg if function.args.args else None
    for node in ast.walk(function):
        if (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Sub) and isinstance(node.left, ast.Call)
                and getattr(node.left.func, "id", None) == "set" and [getattr(a, "id", None) for a in node.left.args] == [param]):
            return _strings(node.right, names)
    return None


def deployment_names(tree: ast.Module) -> set[str]:
    """The names of the module's ``@serve.deployment`` classes and functions (``name=`` when the decorator gives one)."""
    found = set()
    for node in tree.body:
        for decorator in getattr(node, "decorator_list", []):
            target = decorator.func if isinstance(decorator, ast.Call) else decorator
            if getattr(target, "attr", getattr(target, "id", None)) == "deployment":
                keywords = decorator.keywords if isinstance(decorator, ast.Call) else []
                given = [k.value.value for k in keywords if k.arg == "name" and isinstance(k.value, ast.Constant)]
                found.add(str(given[0]) if given else node.name)
    return found


def _application_errors(where: str, app: dict) -> list[str]:
    import_path = app["import_path"]
    match = IMPORT_PATH.match(import_path)
    if match is None:
        return [f"{where}.import_path {import_path!r}: not module:attribute (a module of this repository, ':', a name it defines)"]
    module, attribute = match.groups()
    file = module_file(module)
    if file is None:
        return [f"{where}.import_path {import_path!r}: no module {module} in this repository ({module.replace('.', '/')}.py)"]
    if not any(fnmatch.fnmatch(module.split(".")[0], pattern) for pattern in image_packages()):
        return [f"{where}.import_path {import_path!r}: {module} is not in the image (pyproject.toml's packages: {image_packages()})"]
    tree = ast.parse(file.read_text(encoding="utf-8"))
    names = top_level_names(tree)
    if attribute not in names:
        return [f"{where}.import_path {import_path!r}: {file.relative_to(REPO)} defines no {attribute}"]
    found = []
    target, args = names[attribute], app.get("args")
    if args and isinstance(target, ast.ClassDef | ast.expr):
        found.append(f"{where}.args: {attribute} is no function; Ray Serve passes args only to an application builder")
    elif args is not None and isinstance(target, ast.FunctionDef | ast.AsyncFunctionDef):
        takes = builder_args(target, names)
        if takes is None:
            found.append(f"{where}.args: cannot tell which args {import_path} takes (no `set(args) - {{...}}` in it)")
        elif unknown := sorted(set(args) - takes):
            found.append(
                f"{where}.args: {unknown} unknown to {import_path}, which takes {', '.join(sorted(takes))} "
                f"(it raises ValueError and Ray Serve refuses the app)"
            )
    if import_path == SERVE_MODEL_BUILD:
        found += _serve_model_args(f"{where}.args", args or {})
    known = deployment_names(tree)
    for index, deployment in enumerate(app.get("deployments") or []):
        if known and deployment["name"] not in known:
            found.append(
                f"{where}.deployments[{index}].name {deployment['name']!r}: no such deployment in {module} "
                f"({', '.join(sorted(known))}); Ray Serve refuses options for a deployment the app does not hold"
            )
    return found


def _serve_model_args(where: str, args: dict) -> list[str]:
    """`deployments.serve_model.build`'s args, as it reads them."""
    found = []
    root = args.get("storage_root")
    if not isinstance(root, str) or not root.startswith("s3://"):
        found.append(
            f"{where}.storage_root: {'missing' if root is None else 'not an s3:// URL'}; every pod must reach the "
            f"registry, and a pod's own folder is empty (s3://bucket/prefix; credentials from the pods' env)"
        )
    model = args.get("model")
    if model is not None and not (isinstance(model, str) and MODEL_NAME_PATTERN.fullmatch(model)):
        found.append(f"{where}.model {model!r}: a registry name is lowercase letters, digits and '-' (mnist-resnet18)")
    version = args.get("version")
    if version not in (None, "") and not (isinstance(version, int) and not isinstance(version, bool) and version > 0
                                         or isinstance(version, str) and version.isdigit() and int(version) > 0):
        found.append(f"{where}.version {version!r}: a version is a positive whole number (or leave it out: the champion)")
    every = args.get("follow_every_s")
    try:
        positive = every is None or not isinstance(every, bool) and float(every) > 0
    except (TypeError, ValueError):
        positive = False
    if not positive:
        found.append(f"{where}.follow_every_s {every!r}: seconds between looks at the champion pointer, a positive number")
    return found
