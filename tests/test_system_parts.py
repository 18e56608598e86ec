"""`make test` on a machine without a system part (issue 72): one line naming the part and its install command,
its tests skipped with that reason and counted at the end; with SYSTEM_PARTS=required (CI) a failure instead.

Real processes: `python -m tests.support.system_parts` and pytest itself, run with a PATH on which no part
(Chromium, Prometheus) nor apt-get is found, as on a machine without them (the part is looked up on PATH). Nothing is
installed here: the install path (root with apt-get) is what `.ci/run` runs on every CI machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.system_parts import CHROMIUM, PARTS

ROOT = Path(__file__).resolve().parent.parent
UI_TESTS = 9  # tests/test_ui_browser.py's tests: every one drives Chromium


def without_parts(**extra: str) -> dict[str, str]:
    """This environment with a PATH that holds only the virtual environment's programs (no chromium, no apt-get)."""
    env = {key: value for key, value in os.environ.items() if key != "SYSTEM_PARTS"}
    return {**env, "PATH": str(Path(sys.executable).parent), **extra}


def run(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_a_missing_part_is_one_line_with_its_install_command_and_a_failure_only_when_required():
    done = run("-m", "tests.support.system_parts", env=without_parts())
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines() == [f"system parts: {part.missing_line()}" for part in PARTS.values()]  # one each
    assert "apt-get install -y chromium fonts-dejavu-core`" in done.stdout

    strict = run("-m", "tests.support.system_parts", env=without_parts(SYSTEM_PARTS="required"))
    assert strict.returncode == 1, strict.stdout + strict.stderr
    assert "SYSTEM_PARTS=required: no test may be skipped for a missing part" in strict.stdout


@pytest.mark.parametrize("workers", [("-n", "2", "--dist", "loadfile"), ()], ids=["two-workers", "one-process"])
def test_the_tests_of_a_missing_part_are_skipped_saying_why_and_counted_at_the_end_or_stop_collection_in_ci(workers):
    """As `make test` runs them (two pytest-xdist workers, whose skips the controller counts) and in one process."""
    args = ("-m", "pytest", *workers, "tests/test_ui_browser.py", "-m", "not slow or spine", "-p", "no:cacheprovider", "-q")
    done = run(*args, env=without_parts())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"{UI_TESTS} skipped" in done.stdout
    assert f"SKIPPED [{UI_TESTS}] tests/test_ui_browser.py: {CHROMIUM.missing_line()}" in done.stdout
    assert done.stdout.rstrip().splitlines()[-1].startswith(f"{UI_TESTS} test(s) skipped because chromium is not installed")

    strict = run(*args, env=without_parts(SYSTEM_PARTS="required"))
    assert strict.returncode != 0 and "passed" not in strict.stdout and "skipped" not in strict.stdout
    assert f"SYSTEM_PARTS=required and {CHROMIUM.missing_line()}" in strict.stdout + strict.stderr
