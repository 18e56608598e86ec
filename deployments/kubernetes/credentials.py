"""Credentials written inline in a manifest: found by name and by pattern, reported without their values.

Credentials come only from Secrets created outside the manifests (``env`` with
``valueFrom.secretKeyRef``, ``envFrom`` with ``secretRef``); a command refers to them as ``$(VAR)``
(Kubernetes) or ``${VAR}`` / ``$VAR`` (a shell), a Prefect template as ``{{ variable }}``. Anything
else that looks like a credential is an error:

- an ``env`` variable whose name says credential (``*SECRET*``, ``*TOKEN*``, ...) with a value; the
  same for a key of ``metadata.annotations``, ``metadata.labels``, ``rayStartParams`` (``redis-password``)
  and a ConfigMap's ``data``;
- a Secret written in the manifest (``data`` or ``stringData`` with values): it would be in git;
- ``envFrom`` with ``configMapRef`` to a ConfigMap of the file that holds a credential, or named for one;
- an ``image`` with a user and password or token in front of the registry (``user:TOKEN@registry/...``);
- in the text of ``entrypoint``, ``command``, ``args``, ``runtimeEnvYAML``, ``image``, every ``env``
  value and every value of those maps: ``NAME=value`` / ``name: value`` / ``--name value`` with such
  a name, a URL with ``user:password@``, a URL parameter that `storage_io.redact` hides (``?token=``,
  ``?auth=``, ``?sig=``, ...: found with its `redact_url`, so the rules are its own), an AWS access key
  id, a private key block, an ``Authorization`` header;
- in a RayService's ``serveConfigV2`` (Ray Serve's config as YAML text), every value, named by its path
  (``applications[0].args.storage_root``): a credential's name with a value, or any of the above in its
  text (``s3://KEY:SECRET@bucket``); and the above anywhere else in the text (a comment).

Messages name the field and what was found (``AWS_SECRET_ACCESS_KEY=<redacted>``), never the value;
`credential_secrets` gives the values found, so that the check can mask them in every other message
too (a schema error echoes a value of the wrong type).
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Iterable, Iterator
from typing import Any

from deployments.kubernetes.credential_text import (
    MASK,
    Finding,
    found_in,
    is_credential_name,
    is_reference,
    serve_config_findings,
)

TEXT_FIELDS = ("entrypoint", "command", "args", "runtimeEnvYAML")
SERVE_CONFIG = "serveConfigV2"  # a YAML text whose values are checked one by one (`serve_config_findings`)
# Maps of name -> value whose names and values are checked as an env list's are.
NAMED_VALUES = ("annotations", "labels", "rayStartParams")

# An image's digest (`name@sha256:...`): the one '@' an image reference may hold.
_DIGEST = re.compile(r"@[a-z0-9]+(?:[+._-][a-z0-9]+)*:[0-9a-fA-F]{32,}$")


def _finding(where: str, text: str) -> Finding | None:
    found = found_in(text)
    if not found:
        return None
    described = list(dict.fromkeys(description for description, _ in found))
    return Finding(_advice(where, described), tuple(value for _, value in found if value))


def image_credentials(image: Any) -> str | None:
    """The user and password (or token) written in front of an image's registry (``user:TOKEN@registry/...``), or None."""
    if not isinstance(image, str):
        return None
    reference = _DIGEST.sub("", image.strip())
    userinfo, at, _ = reference.rpartition("@")
    return userinfo if at and userinfo else None


def shown_image(image: Any) -> str:
    """An image reference as messages show it: a user and password in front of its registry as ``<redacted>@``."""
    userinfo = image_credentials(image)
    if userinfo is None:
        return repr(image)
    return repr(f"{MASK}@{image.strip().split(userinfo + '@', 1)[1]}")


def _text(value: Any) -> str:
    if isinstance(value, list):
        return " ".join(str(part) for part in value if part is not None)
    return value if isinstance(value, str) else ""


def _advice(where: str, found: list[str]) -> str:
    return (
        f"{where}: an inline credential ({', '.join(found)}); put it in a Secret, take it into env with "
        f"valueFrom.secretKeyRef and refer to it as $(VAR)"
    )


def _env_entries(path: str, env: Any) -> Iterator[tuple[str, str, dict]]:
    """(field path, name, entry) of a Kubernetes env list or a Prefect ``{name: value}`` env."""
    if isinstance(env, dict):
        yield from ((f"{path}.{name}", str(name), {"name": name, "value": value}) for name, value in env.items())
    elif isinstance(env, list):
        for index, var in enumerate(env):
            if isinstance(var, dict):
                yield f"{path}[{index}]", str(var.get("name", "")), var


def _env_findings(where: str, env: Any) -> list[Finding]:
    found = []
    for at, name, var in _env_entries(where, env):
        source = var.get("valueFrom")
        from_secret = isinstance(source, dict) and bool(source.get("secretKeyRef"))
        value = var.get("value")
        referred = "value" in var and is_reference(value)
        if is_credential_name(name) and not from_secret and not referred:
            found.append(Finding(
                f"{at} {name}: holds a credential as a value; take it from a Secret (valueFrom.secretKeyRef)",
                (str(value),) if value not in (None, "") else (),
            ))
        elif finding := _finding(f"{at}.value ({name})", _text(value)):
            found.append(finding)
    return found


def _named_value_findings(where: str, values: dict, what: str) -> list[Finding]:
    """A map of name -> value (annotations, labels, rayStartParams, a ConfigMap's data): a credential's name
    with a value, or a credential inside a value."""
    found = []
    for name, value in values.items():
        at = f"{where}.{name}"
        text = value if isinstance(value, str) else "" if value is None else str(value)
        if is_credential_name(str(name)) and text.strip() and not is_reference(text):
            found.append(Finding(
                f"{at}: holds a credential as a value ({what} are stored and shown as plain text); put it in a "
                f"Secret and take it into env with valueFrom.secretKeyRef",
                (text,),
            ))
        elif finding := _finding(at, text):
            found.append(finding)
    return found


def _scan(where: str, obj: Any, path: str = "", config_maps: dict[str, list[str]] | None = None) -> list[Finding]:
    """Inline credentials anywhere in ``obj``, named by field path. ``config_maps``: the ConfigMaps of the
    file, name -> the credentials' keys in its data (what an ``envFrom`` with ``configMapRef`` takes in)."""
    found = []
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for key, value in items:
        at = f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else str(key)
        if key in TEXT_FIELDS:
            if finding := _finding(f"{where} {at}", _text(value)):
                found.append(finding)
        elif key == SERVE_CONFIG and isinstance(value, str):
            found += serve_config_findings(f"{where} {at}", value)
        elif key == "image" and isinstance(value, str):
            found += _image_findings(f"{where} {at}", value)
        elif key == "env" and isinstance(value, (dict, list)):
            found += _env_findings(f"{where} {at}", value)
        elif key in NAMED_VALUES and isinstance(value, dict):
            found += _named_value_findings(f"{where} {at}", value, key)
        elif key == "envFrom" and isinstance(value, list):
            found += _env_from_findings(f"{where} {at}", value, config_maps or {})
        else:
            found += _scan(where, value, at, config_maps)
    return found


def _image_findings(where: str, image: str) -> list[Finding]:
    found = []
    userinfo = image_credentials(image)
    if userinfo is not None:
        user, colon, password = userinfo.partition(":")
        found.append(Finding(
            f"{where}: a user and password or token in the image reference {shown_image(image)}; give the pods registry "
            f"credentials with imagePullSecrets (a Secret of type kubernetes.io/dockerconfigjson), never in the reference",
            tuple(part for part in (password if colon else user, userinfo) if part),
        ))
    if finding := _finding(where, image.split(userinfo + "@", 1)[1] if userinfo else image):
        found.append(finding)
    return found


def _env_from_findings(where: str, sources: list, config_maps: dict[str, list[str]]) -> list[Finding]:
    found = []
    for index, source in enumerate(sources):
        ref = source.get("configMapRef") if isinstance(source, dict) else None
        name = ref.get("name") if isinstance(ref, dict) else None
        if not isinstance(name, str):
            continue
        at = f"{where}[{index}].configMapRef {name}"
        if config_maps.get(name):
            found.append(Finding(
                f"{at}: takes credentials into the environment from a ConfigMap ({', '.join(config_maps[name])}); "
                f"put them in a Secret and use envFrom.secretRef",
                (),
            ))
        elif is_credential_name(name):
            found.append(Finding(
                f"{at}: a ConfigMap named for credentials; a ConfigMap is stored and shown as plain text: "
                f"put credentials in a Secret and use envFrom.secretRef",
                (),
            ))
    return found


def _secret_findings(where: str, doc: dict) -> list[Finding]:
    """A Secret written in the manifest: its values would be in the repository and in every copy of the file."""
    found = []
    for field in ("stringData", "data"):
        values = doc.get(field)
        if not isinstance(values, dict) or not values:
            continue
        secrets = []
        for value in values.values():
            text = "" if value is None else str(value)
            secrets.append(text)
            if field == "data":  # base64: the decoded value is the secret too

                try:
                    secrets.append(base64.b64decode(text, validate=True).decode())
                except (binascii.Error, UnicodeDecodeError, ValueError):
                    pass
        found.append(Finding(
            f"{where} {field}: an inline Secret ({', '.join(str(key) for key in values)}: {MASK}); its values would be in "
            f"the repository: create it with `kubectl create secret generic ... --from-literal` or a secret manager, "
            f"and keep only the reference (secretKeyRef, envFrom.secretRef) here",
            tuple(secrets),
        ))
    return found


def config_map_credentials(docs: Iterable[Any]) -> dict[str, list[str]]:
    """The ConfigMaps among ``docs``: name -> the keys of its ``data`` that hold a credential."""
    found = {}
    for doc in docs:
        if isinstance(doc, dict) and doc.get("kind") == "ConfigMap":
            name = (doc.get("metadata") or {}).get("name")
            data = doc.get("data") if isinstance(doc.get("data"), dict) else {}
            found[str(name)] = [str(key) for key, value in data.items()
                                if _named_value_findings("", {key: value}, "ConfigMaps")]
    return found


def document_findings(where: str, doc: Any, config_maps: dict[str, list[str]] | None = None) -> list[Finding]:
    """Inline credentials in one manifest's object: its fields (`credential_errors`), a Secret's values, a ConfigMap's data."""
    found = []
    if isinstance(doc, dict) and doc.get("kind") == "Secret":
        found += _secret_findings(where, doc)
        doc = {key: value for key, value in doc.items() if key not in ("data", "stringData")}
    elif isinstance(doc, dict) and doc.get("kind") == "ConfigMap":
        for field in ("data", "binaryData"):
            if isinstance(doc.get(field), dict):
                found += _named_value_findings(f"{where} {field}", doc[field], "ConfigMaps")
        doc = {key: value for key, value in doc.items() if key not in ("data", "binaryData")}
    return found + _scan(where, doc, config_maps=config_maps)


def env_errors(where: str, env: Any) -> list[str]:
    """Credential variables with a value instead of a Secret, and credentials inside any variable's value."""
    return [finding.message for finding in _env_findings(where, env)]


def credential_errors(where: str, obj: Any, path: str = "") -> list[str]:
    """Inline credentials anywhere in ``obj`` (a manifest's object, a resolved job template), named by field path."""
    return [finding.message for finding in _scan(where, obj, path)]


def credential_secrets(where: str, obj: Any) -> set[str]:
    """The values `credential_errors` found in ``obj``: what no message may show."""
    return {secret for finding in _scan(where, obj) for secret in finding.secrets}


