"""The layers of docs/architecture.md hold: a package imports only from the layers below it.

The contract is ``[tool.importlinter]`` in pyproject.toml, checked by import-linter (grimp reads
every import statement, at module level or inside a function, without running the code). A
second test breaks the contract on purpose in a copy of the tree, to show the check catches it.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def lint_imports(cwd: Path) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(cwd), "NO_COLOR": "1"}
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_no_lower_layer_imports_a_higher_one():
    done = lint_imports(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Contracts: 1 kept, 0 broken." in done.stdout


@pytest.mark.parametrize(
    ("module", "line", "reported"),
    [
        ("storage_io/layout.py", "import flows.mnist\n", "storage_io.layout -> flows.mnist"),
        # inside a function: a function-level import is no way around the layers
        ("training/loop.py", "def _late():\n    from tasks.train import train\n", "training.loop -> tasks.train"),
        # side by side on one layer: neither imports the other
        ("reporting/logs.py", "from training import model\n", "reporting.logs -> training"),
    ],
)
def test_the_check_fails_on_a_violation(tmp_path, module, line, reported):
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    for package in config["root_packages"]:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    assert lint_imports(tmp_path).returncode == 0  # the copy holds, as the tree does

    with open(tmp_path / module, "a") as handle:
        handle.write("\n\n" + line)
    done = lint_imports(tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "BROKEN" in done.stdout and reported in done.stdout, done.stdout


def test_no_test_module_imports_another():
    """Shared test code lives in tests/support (plain helpers) and tests/conftest.py (fixtures)."""
    found = []
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in getattr(node, "names", [])]
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found += [f"{path.name}: {name}" for name in names if name.startswith(("tests.test_", "tests.conftest"))]
    assert found == []
