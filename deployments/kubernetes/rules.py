"""Rules every file in deployments/kubernetes/ is held to: the lock's versions and the image tag.

Shared by the manifest checks (`deployments.kubernetes.check`) and the work-pool template's
(`deployments.kubernetes.work_pool`); credentials only from Secrets is `deployments.kubernetes.credentials`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from deployments.images import LOCK
from deployments.kubernetes.credentials import shown_image


def lock_version(package: str, lock: Path = LOCK) -> str:
    """The version requirements.lock pins for ``package`` (``ray`` -> ``2.60.0``)."""
    for line in Path(lock).read_text().splitlines():
        name, sep, version = line.partition("==")
        if sep and name.strip().lower() == package:
            return version.split()[0].strip()
    raise LookupError(f"{package} is not pinned in {lock}")


def image_errors(where: str, image: Any, expected: str) -> list[str]:
    """An image that is not ``[registry/]<name>:<lock hash>``; a user and password in front of its registry are shown
    as ``<redacted>@`` (the credential itself is `deployments.kubernetes.credentials`' finding)."""
    if isinstance(image, str) and image.rsplit("/", 1)[-1] == expected:
        return []
    return [
        f"{where}: image {shown_image(image)} is not {expected!r} (<name>:<lock hash> of requirements.lock, "
        f"deployments/images.py; a registry prefix is fine): rebuild with `make image` and set the new tag"
    ]
