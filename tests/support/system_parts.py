"""The system programs some tests drive (not Python packages): what each is, how to install it, and the
set-up `make test` runs first.

    python -m tests.support.system_parts            # install what is missing where it can, else say how
    python -m tests.support.system_parts required   # the same, but exit 1 when a part is still missing (CI)

With root and apt-get (Debian, as CI runs) a missing part is installed from Debian's packages: browser
builds and other downloads do not work here, the registries do. Without either, one line per missing part
says what it is for and the exact command to install it; its tests are then skipped with the same words
(tests/conftest.py) and the session ends with a line counting them. ``required`` (what `.ci/run` passes
as ``SYSTEM_PARTS=required``) makes a missing part a failure instead, both here and in pytest's
collection: in CI nothing is skipped for a missing part.

A part's tests carry ``@pytest.mark.needs("<part name>")``. Standard library only: this runs before
anything is known about the environment.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass

REQUIRED = "required"  # SYSTEM_PARTS's value in CI: no test may be skipped for a missing part
ENV = "SYSTEM_PARTS"


@dataclass(frozen=True)
class Part:
    """A program some tests need, found on PATH, installed from Debian's packages."""

    name: str  # the marker's argument and the program's name on PATH
    packages: tuple[str, ...]  # Debian's packages that bring it
    used_by: str  # which tests need it, in a few words

    def location(self) -> str | None:
        """Where the program is, or None when it is not installed."""
        return shutil.which(self.name)

    def install_command(self) -> str:
        """The command a person runs to install it (with sudo unless they are root)."""
        prefix = "" if _is_root() else "sudo "
        return f"{prefix}apt-get install -y {' '.join(self.packages)}"

    def missing_line(self) -> str:
        """One line: what is missing, what for, and the command that installs it."""
        return f"{self.name} is not installed ({self.used_by} are skipped): install it with `{self.install_command()}`"


# Debian's Chromium for the Prefect UI tests (Playwright drives it; its own browser builds cannot be downloaded
# here); fonts-dejavu-core gives the headless pages a font, so screenshots show text.
CHROMIUM = Part("chromium", ("chromium", "fonts-dejavu-core"), "the Prefect UI tests in Chromium")
# Debian's Prometheus, for its promtool: the scrape config, the alerting rules (and their unit tests) and the
# dashboard's queries, checked by Prometheus's own parser and rule engine (tests/test_dashboards.py); no server runs.
PROMETHEUS = Part("prometheus", ("prometheus",), "the metrics tests in a real Prometheus")
PARTS = {part.name: part for part in (CHROMIUM, PROMETHEUS)}


def missing() -> list[Part]:
    """The parts that are not installed."""
    return [part for part in PARTS.values() if part.location() is None]


def required() -> bool:
    """Whether a missing part is a failure (``SYSTEM_PARTS=required``, as in CI) rather than a skip."""
    return os.environ.get(ENV, "").strip().lower() == REQUIRED


def _is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def install(parts: list[Part]) -> None:
    """Install ``parts`` with apt-get (as root, without prompts); apt's own output only when it fails."""
    packages = [package for part in parts for package in part.packages]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *packages]):
        done = subprocess.run(command, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL)
        if done.returncode != 0:
            sys.stderr.write(done.stdout + done.stderr)
            print(f"system parts: `{' '.join(command)}` failed (exit {done.returncode})")
            return


def main(argv: list[str]) -> int:
    """Install the missing parts where this user can, say how otherwise; 1 when ``required`` and one is still missing."""
    strict = REQUIRED in argv or required()
    absent = missing()
    if absent and _is_root() and shutil.which("apt-get"):
        names = ", ".join(part.name for part in absent)
        print(f"system parts: installing {names} from Debian's packages (apt-get, as root) ...", flush=True)
        started = time.monotonic()
        install(absent)
        absent = missing()
        if not absent:
            print(f"system parts: {names} installed in {time.monotonic() - started:.0f} s")
    for part in absent:
        print(f"system parts: {part.missing_line()}")
    if absent and strict:
        print(f"system parts: {ENV}={REQUIRED}: no test may be skipped for a missing part; stopping")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
