"""Credentials written inline in a manifest: found by name and by pattern, reported without their values.

Credentials come only from Secrets (``env`` with ``valueFrom.secretKeyRef``); a command refers to
them as ``$(VAR)`` (Kubernetes) or ``${VAR}`` / ``$VAR`` (a shell), a Prefect template as
``{{ variable }}``. Anything else that looks like a credential is an error:

- an ``env`` variable whose name says credential (``*SECRET*``, ``*TOKEN*``, ...) with a value;
- in the text of ``entrypoint``, ``command``, ``args``, ``runtimeEnvYAML`` and every ``env`` value:
  ``NAME=value`` / ``name: value`` / ``--name value`` with such a name, a URL with
  ``user:password@``, an AWS access key id, a private key block, an ``Authorization`` header.

Messages name the field and what was found (``AWS_SECRET_ACCESS_KEY=<redacted>``), never the value.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

# Names that hold a credential, in env variables, assignments and flags.
SECRET_NAME = re.compile(
    r"SECRET|PASSW(?:OR)?D|TOKEN|ACCESS[-_.]?KEY|CREDENTIAL|API[-_.]?KEY|PRIVATE[-_.]?KEY", re.IGNORECASE
)
# ... unless the name says it holds where a credential is, not the credential itself.
POINTER_NAME = re.compile(r"[-_.](?:FILE|PATH|DIR|NAME|URL|URI|ENDPOINT)S?$", re.IGNORECASE)
# A value that refers to a credential held elsewhere: $(VAR), ${VAR}, $VAR, {{ prefect_variable }}.
REFERENCE = re.compile(r"\$\([A-Za-z_]\w*\)|\$\{[A-Za-z_]\w*\}|\$[A-Za-z_]\w*|\{\{\s*[\w.]+\s*\}\}")
TEXT_FIELDS = ("entrypoint", "command", "args", "runtimeEnvYAML")

# A value: a $(VAR) or ${VAR} reference, a quoted string, or a word up to a space or shell punctuation.
_VALUE = r"""(?P<secret>\$\(\w+\)|\$\{\w+\}|"[^"]*"|'[^']*'|[^\s"',;&|)]+)"""
_FLAG_VALUE = _VALUE.replace(r"|[^\s", r"|[^-\s", 1)  # after `--name `: not another flag
# `NAME=value`, `name: value`, `--name value`, looked for at every word (a lookahead, so matches may overlap).
_ASSIGNMENT = re.compile(r"(?=(?<![\w.-])(?P<key>-{0,2}[A-Za-z_][\w.-]*)[\"']?(?:[ \t]*=[ \t]*|:[ \t]*)" + _VALUE + ")")
_FLAG = re.compile(r"(?=(?<![\w.-])(?P<key>--?[A-Za-z][\w.-]*)[ \t]+" + _FLAG_VALUE + ")")
_URL = re.compile(r"\b(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://[^/\s:@'\"]*:(?P<secret>[^/\s@'\"]+)@")
_AWS_KEY_ID = re.compile(r"(?<![A-Z0-9])(?P<secret>(?:AKIA|ASIA)[0-9A-Z]{16})(?![A-Z0-9])")
_PRIVATE_KEY = re.compile(r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY-----")
_AUTHORIZATION = re.compile(r"\bauthorization\s*[:=]\s*[\"']?(?P<scheme>bearer|basic|token)\s+" + _VALUE, re.IGNORECASE)


def is_credential_name(name: str) -> bool:
    """``AWS_SECRET_ACCESS_KEY``, ``--password``, ``token``: yes; ``AWS_SHARED_CREDENTIALS_FILE``: no."""
    return bool(SECRET_NAME.search(name)) and not POINTER_NAME.search(name)


def is_reference(value: Any) -> bool:
    """Whether ``value`` (quotes aside) is only a reference to a variable, or empty."""
    return isinstance(value, str) and REFERENCE.sub("", value.strip().strip("\"'")).strip() == ""


def find_credentials(text: str) -> list[str]:
    """What in ``text`` looks like an inline credential, each described with its value redacted."""
    found = []
    for pattern in (_ASSIGNMENT, _FLAG):
        for match in pattern.finditer(text):
            if is_credential_name(match["key"]) and not is_reference(match["secret"]):
                found.append(f"{match['key']}{'=' if pattern is _ASSIGNMENT else ' '}<redacted>")
    urls = [m for m in _URL.finditer(text) if not is_reference(m["secret"])]
    found += [f"a password in a {m['scheme']}:// URL (:<redacted>@)" for m in urls]
    found += ["an AWS access key id (AKIA/ASIA...)"] * bool(_AWS_KEY_ID.search(text))
    found += ["a private key block (-----BEGIN ... PRIVATE KEY-----)"] * bool(_PRIVATE_KEY.search(text))
    headers = [m for m in _AUTHORIZATION.finditer(text) if not is_reference(m["secret"])]
    found += [f"an Authorization: {m['scheme']} <redacted> header" for m in headers]
    return list(dict.fromkeys(found))


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


def env_errors(where: str, env: Any) -> list[str]:
    """Credential variables with a value instead of a Secret, and credentials inside any variable's value."""
    found = []
    for at, name, var in _env_entries(where, env):
        source = var.get("valueFrom")
        from_secret = isinstance(source, dict) and bool(source.get("secretKeyRef"))
        referred = "value" in var and is_reference(var["value"])
        if is_credential_name(name) and not from_secret and not referred:
            found.append(f"{at} {name}: holds a credential as a value; take it from a Secret (valueFrom.secretKeyRef)")
        elif inline := find_credentials(_text(var.get("value"))):
            found.append(_advice(f"{at}.value ({name})", inline))
    return found


def credential_errors(where: str, obj: Any, path: str = "") -> list[str]:
    """Inline credentials anywhere in ``obj`` (a manifest's object, a resolved job template), named by field path."""
    found = []
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for key, value in items:
        at = f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else str(key)
        if key in TEXT_FIELDS and (inline := find_credentials(_text(value))):
            found.append(_advice(f"{where} {at}", inline))
        elif key == "env" and isinstance(value, (dict, list)):
            found += env_errors(f"{where} {at}", value)
        else:
            found += credential_errors(where, value, at)
    return found
