"""URLs as they may be shown or stored: without the credentials some of them carry.

A URL's user and password (``https://user:pw@host/``) and its credential-looking query or fragment
parameters (``?token=...``, ``X-Amz-Signature=...``) are replaced by ``***``; everything else is
kept as it was, so a URL without credentials comes back unchanged. `redact_text` does the same to
every URL inside a message (an exception's text, a validation error that echoes its input).
"""

from __future__ import annotations

import re
from collections.abc import Collection
from urllib.parse import unquote, urlsplit, urlunsplit

MASK = "***"
# A query or fragment parameter is a credential when its name (lowercased, "-" as "_") contains one of these...
_SECRET_PARTS = ("token", "password", "passwd", "secret", "signature", "credential", "apikey", "api_key", "access_key", "private")
# ... or is one of these.
_SECRET_NAMES = {"key", "sig", "pwd", "auth", "authorization", "code", "session"}
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>`]+")


def is_secret_name(name: str) -> bool:
    """True when a query parameter called ``name`` carries a credential (``token``, ``X-Amz-Signature``, ``sig``...)."""
    plain = unquote(name).strip().lower().replace("-", "_")
    return plain in _SECRET_NAMES or any(part in plain for part in _SECRET_PARTS)


def _redact_params(params: str) -> str:
    """``a=1&token=x`` -> ``a=1&token=***``: each credential's value masked, the rest as written."""
    parts = []
    for part in params.split("&"):
        name, equals, value = part.partition("=")
        parts.append(f"{name}={MASK}" if equals and value and is_secret_name(name) else part)
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
    (a webhook's, whose path is its secret) is masked whole."""
    return _URL.sub(lambda match: _redact_found(match.group(0), {host.lower() for host in hide_hosts}), text)


def _redact_found(url: str, hide_hosts: set[str]) -> str:
    if hide_hosts:
        try:
            host = urlsplit(url).hostname
        except ValueError:
            host = None
        if host in hide_hosts:
            return MASK
    return redact_url(url)


def has_credentials(url: str) -> bool:
    """True when `redact_url` would hide something in ``url``."""
    return redact_url(url) != url
