"""The project's container image name and tag: `<project name>:<lock hash>`, computed in one place.

An image is built from requirements.lock (`make image`), so the lock is what tells two images
apart: the tag is the first 12 hex digits of the lock file's sha256, and a changed lock gives a
new tag. The Kubernetes manifests in deployments/kubernetes/ name the image by this tag, and their
test compares it with what this module computes, so a lock that moves on without the manifests
fails the suite instead of running a cluster on libraries the lock no longer describes.

    python -m deployments.images            # prints e.g. prefect-ray-training:3f2a9c0d1b4e

The image's name is the project's name in pyproject.toml, read from there so a rename cannot leave
a second spelling behind.
"""

from __future__ import annotations

import hashlib
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "requirements.lock"
PYPROJECT = ROOT / "pyproject.toml"
HASH_LENGTH = 12  # hex digits: 48 bits, no collision between the few locks a project ever has


def lock_hash(lock: Path = LOCK) -> str:
    """The image tag for a lock file: the first 12 hex digits of the sha256 of its bytes.

    The bytes, not a parsed form: any edit to the lock, comments included, is a new image,
    which is what `make image` rebuilds for.
    """
    return hashlib.sha256(Path(lock).read_bytes()).hexdigest()[:HASH_LENGTH]


def image_name(pyproject: Path = PYPROJECT) -> str:
    """The image's name: ``[project] name`` in pyproject.toml (``prefect-ray-training``)."""
    return tomllib.loads(Path(pyproject).read_text())["project"]["name"]


def image_reference(lock: Path = LOCK, pyproject: Path = PYPROJECT) -> str:
    """``<name>:<lock hash>``, the reference `make image` builds and the manifests run."""
    return f"{image_name(pyproject)}:{lock_hash(lock)}"


if __name__ == "__main__":
    print(image_reference())
