"""URLs as they may be shown or stored: without the credentials some of them carry.

A URL's user and password (``https://user:pw@host/``), its credential-looking query or fragment
parameters (``?token=...``, ``X-Amz-Signature=...``) and a bare value in its query or fragment
(``#s3cret``, ``?s3cret``: a token without a name; a route such as ``#/experiments/1`` is kept) are
replaced by ``***``; everything else is kept as it was, so a URL without credentials comes back
unchanged. `redact_text` does the same to every URL inside a message (an exception's text, a
validation error that echoes its input), and outside URLs masks a credential written as
``name=value`` (``token=...``: a name `is_secret_name` says carries one) and a token of a well-known
form (GitHub's ``ghp_...``, an AWS access key id, Slack's ``xoxb-...``, Hugging Face's ``hf_...``),
wherever it stands: a refused ``--run-name token=...`` is not echoed.

The one rule for every value a refusal, log line, summary, report, event or webhook carries: redact
first, shorten after. `redact_error` is an exception's text made so: a pydantic ``ValidationError``
shortens each input it echoes to about 50 characters by cutting out its middle
(``'https://mirror.example/m...uvwxyz'``), which drops ``?access_token=`` and keeps the token's tail,
so its text is rebuilt from its errors with every input and message redacted before pydantic shortens them.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

from pydantic_core import PydanticCustomError, ValidationError

MASK = "***"
# A query or fragment parameter is a credential when its name (lowercased, "-" as "_") contains one of these...
_SECRET_PARTS = ("token", "password", "passwd", "secret", "signature", "credential", "apikey", "api_key", "access_key", "private")
# ... or is one of these.
_SECRET_NAMES = {"key", "sig", "pwd", "auth", "authorization", "code", "session"}
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>`]+")
# name=value outside a URL: the value masked when the name is a credential's (`is_secret_name`).
_ASSIGNMENT = re.compile(r"(?<![A-Za-z0-9_.-])([A-Za-z_][A-Za-z0-9_.-]*)=([^\s&'\"<>`,;)\]]+)")
# Tokens whose form gives them away, wherever they stand.
_KNOWN_TOKENS = re.compile(
    r"\b(?:gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,}|(?:AKIA|ASIA)[0-9A-Z]{16}|xox[abprs]-[A-Za-z0-9-]{10,}"
    r"|hf_[A-Za-z0-9]{20,}|sk-[A-Za-z0-9_-]{20,})"
)


def is_secret_name(name: str) -> bool:
    """True when a query parameter called ``name`` carries a credential (``token``, ``X-Amz-Signature``, ``sig``...)."""
    plain = unquote(name).strip().lower().replace("-", "_")
    return plain in _SECRET_NAMES or any(part in plain for part in _SECRET_PARTS)


def _redact_params(params: str) -> str:
    """``a=1&token=x`` -> ``a=1&token=***``: each credential's value masked, the rest as written. A part
    without ``=`` (``#s3cret``, ``?s3cret``) is a value without a name, a token as likely as not: masked,
    unless it is a path (``#/experiments/1/runs/abc``, a web app's route)."""
    parts = []
    for part in params.split("&"):
        name, equals, value = part.partition("=")
        if equals:
            parts.append(f"{name}={MASK}" if value and is_secret_name(name) else part)
        else:
            parts.append(MASK if part and not part.startswith("/") else part)
    return "&".join(parts)


def redact_url(url: str) -> str:
    """``url`` without its credentials: ``https://alice:pw@host/p?token=x&a=1`` -> ``https://***@host/p?token=***&a=1``.

    Only ``scheme://`` URLs are touched (a local path is returned as it is); one that cannot be
    parsed is masked whole after its scheme.
    """
    if "://" not in url:
        return url
    try:
        parts = urlsplit(url)
    except ValueError:  # e.g. a bracketed host that is not an IPv6 address
        return f"{url.split('://', 1)[0]}://{MASK}"
    netloc = parts.netloc
    if "@" in netloc:
        netloc = f"{MASK}@{netloc.rpartition('@')[2]}"
    query, fragment = _redact_params(parts.query), _redact_params(parts.fragment)
    if (netloc, query, fragment) == (parts.netloc, parts.query, parts.fragment):
        return url  # nothing to hide: exactly as given
    return urlunsplit((parts.scheme, netloc, parts.path, query, fragment))


def redact_text(text: str, hide_hosts: Collection[str] = ()) -> str:
    """``text`` with every ``scheme://`` URL in it redacted (`redact_url`); a URL on one of ``hide_hosts``
    (a webhook's, whose path is its secret) is masked whole. Outside URLs, a credential's ``name=value``
    has its value masked, and a token of a well-known form (``ghp_...``, ``AKIA...``) is masked whole."""
    text = _URL.sub(lambda match: _redact_found(match.group(0), {host.lower() for host in hide_hosts}), text)
    text = _ASSIGNMENT.sub(_redact_assignment, text)
    return _KNOWN_TOKENS.sub(MASK, text)


def _redact_assignment(match: re.Match) -> str:
    name, value = match.group(1), match.group(2)
    return f"{name}={MASK}" if value != MASK and is_secret_name(name) else match.group(0)


def _redact_found(url: str, hide_hosts: set[str]) -> str:
    if hide_hosts:
        try:
            host = urlsplit(url).hostname
        except ValueError:
            host = None
        if host in hide_hosts:
            return MASK
    return redact_url(url)


def redact_value(value: Any) -> Any:
    """``value`` with every URL in it redacted: a string (`redact_text`), or the strings in a dict, list,
    tuple or set, at any depth (a validation error's input may be a whole section of the config)."""
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, dict):
        return {redact_value(key): redact_value(item) for key, item in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return type(value)(redact_value(item) for item in value)
    return value


def redact_error(exc: BaseException) -> str:
    """``str(exc)`` with every URL's credentials masked, redacted before anything shortens it.

    A pydantic ``ValidationError`` is rebuilt from its errors, each input and message redacted first,
    so the text pydantic then shortens holds no part of a secret; any other exception's text is
    `redact_text`'s. Shorten the result, never the text before it."""
    if isinstance(exc, ValidationError):
        try:
            return str(_redacted_validation_error(exc))
        except Exception:  # an error pydantic will not rebuild: its fields and messages, without the inputs
            lines = [f"{exc.error_count()} validation error(s) for {exc.title}"]
            for error in exc.errors():
                lines += [".".join(str(part) for part in error["loc"]) or "(input)", f"  {redact_text(error['msg'])}"]
            return "\n".join(lines)
    return redact_text(str(exc))


def _redacted_validation_error(exc):
    """``exc`` (a pydantic ``ValidationError``) again, with each error's input and message redacted: an error
    of a type pydantic knows keeps it (its text and link are pydantic's own), any other becomes a custom error
    of the same type name and message."""
    lines = []
    for error in exc.errors():
        kind, ctx, msg = error["type"], dict(error.get("ctx") or {}), redact_text(error["msg"])
        if isinstance(ctx.get("error"), BaseException):  # value_error, assertion_error: the validator's own words
            said = redact_text(str(ctx["error"]))
            ctx["error"] = AssertionError(said) if kind == "assertion_error" else ValueError(said)
        line = {"type": kind, "loc": error["loc"], "input": redact_value(error.get("input"))}
        if ctx:
            line["ctx"] = ctx
        try:
            rebuilt = ValidationError.from_exception_data(exc.title, [line]).errors()[0]["msg"]
        except Exception:  # a custom type (PydanticCustomError), or a context pydantic does not take back
            rebuilt = None
        if rebuilt != msg:
            line = {"type": PydanticCustomError(kind, msg), "loc": error["loc"], "input": line["input"]}
        lines.append(line)
    return ValidationError.from_exception_data(exc.title, lines)


def has_credentials(url: str) -> bool:
    """True when `redact_url` would hide something in ``url``."""
    return redact_url(url) != url
