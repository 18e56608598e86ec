"""What in a piece of text looks like an inline credential (an assignment, a flag, a URL's password or parameter, an
AWS key id, a private key, an Authorization header), described without its value, the same in each value of a
RayService's serveConfigV2 (YAML text), and messages with the values found masked."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple
from urllib.parse import unquote, urlsplit

import yaml

from storage_io.redact import redact_url

# Names that hold a credential, in env variables, assignments and flags.
SECRET_NAME = re.compile(
    r"SECRET|PASSW(?:OR)?D|TOKEN|ACCESS[-_.]?KEY|CREDENTIAL|API[-_.]?KEY|PRIVATE[-_.]?KEY", re.IGNORECASE
)
# ... unless the name says it holds where a credential is, not the credential itself.
POINTER_NAME = re.compile(r"[-_.](?:FILE|PATH|DIR|NAME|URL|URI|ENDPOINT)S?$", re.IGNORECASE)
# A value that refers to a credential held elsewhere: $(VAR), ${VAR}, $VAR, {{ prefect_variable }}.
REFERENCE = re.compile(r"\$\([A-Za-z_]\w*\)|\$\{[A-Za-z_]\w*\}|\$[A-Za-z_]\w*|\{\{\s*[\w.]+\s*\}\}")
MASK = "<redacted>"
SHORTEST_MASKED = 4  # a shorter value ("1", "no") is not hunted for in the other messages
# A value: a $(VAR) or ${VAR} reference, a quoted string, or a word up to a space or shell punctuation.
_VALUE = r"""(?P<secret>\$\(\w+\)|\$\{\w+\}|"[^"]*"|'[^']*'|[^\s"',;&|)]+)"""
_FLAG_VALUE = _VALUE.replace(r"|[^\s", r"|[^-\s", 1)  # after `--name `: not another flag
# `NAME=value`, `name: value`, `--name value`, looked for at every word (a lookahead, so matches may overlap).
_ASSIGNMENT = re.compile(r"(?=(?<![\w.-])(?P<key>-{0,2}[A-Za-z_][\w.-]*)[\"']?(?:[ \t]*=[ \t]*|:[ \t]*)" + _VALUE + ")")
_FLAG = re.compile(r"(?=(?<![\w.-])(?P<key>--?[A-Za-z][\w.-]*)[ \t]+" + _FLAG_VALUE + ")")
_URL = re.compile(r"\b(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://[^/\s:@'\"]*:(?P<secret>[^/\s@'\"]+)@")
_ANY_URL = re.compile(r"\b(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://[^\s'\"<>`]+")  # storage_io.redact's URL
_AWS_KEY_ID = re.compile(r"(?<![A-Z0-9])(?P<secret>(?:AKIA|ASIA)[0-9A-Z]{16})(?![A-Z0-9])")
_PRIVATE_KEY = re.compile(r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY-----(?P<secret>.*?)(?:-----END|$)", re.DOTALL)
_AUTHORIZATION = re.compile(r"\bauthorization\s*[:=]\s*[\"']?(?P<scheme>bearer|basic|token)\s+" + _VALUE, re.IGNORECASE)


class Finding(NamedTuple):
    """One inline credential: the message (no value in it) and the values it found, to mask elsewhere."""

    message: str
    secrets: tuple[str, ...]


def is_credential_name(name: str) -> bool:
    """``AWS_SECRET_ACCESS_KEY``, ``--password``, ``token``: yes; ``AWS_SHARED_CREDENTIALS_FILE``: no."""
    return bool(SECRET_NAME.search(name)) and not POINTER_NAME.search(name)


def is_reference(value: Any) -> bool:
    """Whether ``value`` (quotes aside) is only a reference to a variable, or empty."""
    return isinstance(value, str) and REFERENCE.sub("", value.strip().strip("\"'")).strip() == ""


def _unquoted(value: str) -> str:
    return value.strip().strip("\"'")


def _url_parameters(text: str) -> Iterator[tuple[str, str | None, str]]:
    """(scheme, name, value) of each query or fragment parameter of the URLs in ``text`` that `storage_io.redact`
    hides (``?token=``, ``?auth=``, ``?sig=``, ...: whatever its rules call a credential; name None for a value
    without a name), its value not a reference. The rules are redact's own, applied by `redact_url`: not a copy."""
    for match in _ANY_URL.finditer(text):
        url = match.group(0)
        try:
            parts, hidden = urlsplit(url), urlsplit(redact_url(url))
        except ValueError:  # e.g. a bracketed host that is no IPv6 address
            continue
        for params, masked in ((parts.query, hidden.query), (parts.fragment, hidden.fragment)):
            for part, shown in zip(params.split("&"), masked.split("&")):
                if part == shown:
                    continue
                name, equals, value = part.partition("=")
                secret = value if equals else part
                if not is_reference(unquote(secret)):
                    yield match["scheme"], unquote(name) if equals else None, secret


def found_in(text: str) -> list[tuple[str, str | None]]:
    """(description, value) of what in ``text`` looks like an inline credential; the description never holds the value."""
    found: list[tuple[str, str | None]] = []
    for pattern in (_ASSIGNMENT, _FLAG):
        for match in pattern.finditer(text):
            if is_credential_name(match["key"]) and not is_reference(match["secret"]):
                found.append((f"{match['key']}{'=' if pattern is _ASSIGNMENT else ' '}{MASK}", _unquoted(match["secret"])))
    said = {description for description, _ in found}
    for scheme, name, value in _url_parameters(text):
        if name is None:
            found.append((f"a value without a name in a {scheme}:// URL's query or fragment ({MASK})", value))
        elif f"{name}={MASK}" not in said:  # `token=x` in a URL is an assignment already
            found.append((f"{name}={MASK} in a {scheme}:// URL", value))
    found += [(f"a password in a {m['scheme']}:// URL (:{MASK}@)", m["secret"]) for m in _URL.finditer(text)
              if not is_reference(m["secret"])]
    found += [("an AWS access key id (AKIA/ASIA...)", m["secret"]) for m in _AWS_KEY_ID.finditer(text)]
    for m in _PRIVATE_KEY.finditer(text):
        found += [("a private key block (-----BEGIN ... PRIVATE KEY-----)", None)]
        found += [("a private key block (-----BEGIN ... PRIVATE KEY-----)", line.strip()) for line in m["secret"].splitlines()]
    found += [(f"an Authorization: {m['scheme']} {MASK} header", _unquoted(m["secret"])) for m in _AUTHORIZATION.finditer(text)
              if not is_reference(m["secret"])]
    return found


def serve_config_findings(where: str, text: str) -> list[Finding]:
    """Credentials in serveConfigV2 (Ray Serve's config as YAML text): each value, named by its path
    (``applications[0].args.storage_root``), by its key's name and its text; then anything else in the text (a comment,
    text that is no YAML). Nothing substitutes ``$(VAR)`` there: the advice is the pods' env, which the replicas read."""
    def finding(at: str, described: list[str], values: Iterable[str | None]) -> Finding:
        return Finding(
            f"{at}: an inline credential ({', '.join(dict.fromkeys(described))}); serveConfigV2 is stored and shown as "
            f"plain text: put it in a Secret and into the pods' env with valueFrom.secretKeyRef, where the replicas read it",
            tuple(value for value in values if value),
        )

    def walk(obj: Any, path: str) -> Iterator[tuple[str, list[tuple[str, str | None]]]]:
        for key, value in obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ():
            at = f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else str(key)
            shown = "" if value is None else str(value)
            if isinstance(value, (dict, list)):
                yield from walk(value, at)
            elif isinstance(key, str) and is_credential_name(key) and shown.strip() and not is_reference(shown):
                yield f"{where} {at}", [(f"{key}: {MASK}", shown)]
            elif found := found_in(shown):
                yield f"{where} {at}", found

    try:
        config = yaml.safe_load(text)
    except yaml.YAMLError:
        config = None
    found = list(walk(config, ""))
    said = {item for _, items in found for item in items}  # what the text holds besides: a comment, text no YAML
    rest = [item for item in found_in(text) if item not in said and (item[1] is None or item[1] not in {v for _, v in said})]
    found += [(where, rest)] if rest else []
    return [finding(at, [d for d, _ in items], [v for _, v in items]) for at, items in found]


def find_credentials(text: str) -> list[str]:
    """What in ``text`` looks like an inline credential, each described with its value redacted."""
    return list(dict.fromkeys(description for description, _ in found_in(text)))


def mask(messages: list[str], secrets: Iterable[str]) -> list[str]:
    """``messages`` with every found secret value replaced by ``<redacted>`` (longest first, so a value that
    holds another is masked whole)."""
    hidden = sorted({s for s in secrets if len(s) >= SHORTEST_MASKED}, key=len, reverse=True)
    if not hidden:
        return messages
    out = []
    for message in messages:
        for secret in hidden:
            message = message.replace(secret, MASK)
        out.append(message)
    return out
