"""Rules every file in deployments/kubernetes/ is held to: the lock's versions, the image tag, credentials only from Secrets.

Shared by the manifest checks (`deployments.kubernetes.check`) and the work-pool template's
(`deployments.kubernetes.work_pool`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from deployments.images import LOCK

# Environment variables that hold credentials: they may only come from a Secret.
SECRET_ENV = re.compile(r"SECRET|PASSWORD|TOKEN|ACCESS_KEY|CREDENTIAL|API_KEY", re.IGNORECASE)


def lock_version(package: str, lock: Path = LOCK) -> str:
    """The version requirements.lock pins for ``package`` (``ray`` -> ``2.60.0``)."""
    for line in Path(lock).read_text().splitlines():
        name, sep, version = line.partition("==")
        if sep and name.strip().lower() == package:
            return version.split()[0].strip()
    raise LookupError(f"{package} is not pinned in {lock}")


def env_errors(where: str, env: Any) -> list[str]:
    """A credential variable with a literal value: credentials come from a Secret, never from a file."""
    found = []
    for var in env if isinstance(env, list) else []:
        name = var.get("name", "") if isinstance(var, dict) else ""
        if SECRET_ENV.search(name) and not (var.get("valueFrom") or {}).get("secretKeyRef"):
            found.append(f"{where}: env {name} holds a credential; take it from a Secret (valueFrom.secretKeyRef), never a value")
    return found


def image_errors(where: str, image: Any, expected: str) -> list[str]:
    """An image that is not ``[registry/]<name>:<lock hash>``."""
    if isinstance(image, str) and image.rsplit("/", 1)[-1] == expected:
        return []
    return [
        f"{where}: image {image!r} is not {expected!r} (<name>:<lock hash> of requirements.lock, "
        f"deployments/images.py; a registry prefix is fine): rebuild with `make image` and set the new tag"
    ]
