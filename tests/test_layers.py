"""The structure of docs/architecture.md holds: layers, no import circles, folders and modules of a readable size.

The layers are ``[tool.importlinter]`` in pyproject.toml, checked by import-linter (grimp reads
every import statement, at module level or inside a function, without running the code); the
circles are grimp's graph's strongly connected components (tests/support/import_cycles.py). Each
check is also broken on purpose in a copy of the tree, to show it catches what it is for.
"""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


IMPORT_CYCLES = ROOT / "tests" / "support" / "import_cycles.py"
MAX_MODULES_PER_FOLDER = 12  # .py files in one folder, its __init__.py included (issue 68)
MAX_MODULE_LINES = 300


def production_packages() -> list[str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["root_packages"]


def copy_of_the_tree(target: Path) -> Path:
    for package in production_packages():
        shutil.copytree(ROOT / package, target / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", target)
    return target


def import_cycles(cwd: Path) -> list[list[str]]:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(cwd)}
    done = subprocess.run([sys.executable, str(IMPORT_CYCLES)], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


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
        ("training/worker/loop.py", "def _late():\n    from tasks.train import train\n", "training.worker.loop -> tasks.train"),
        # side by side on one layer: neither imports the other
        ("reporting/logs.py", "from training import model\n", "reporting.logs -> training"),
    ],
)
def test_the_check_fails_on_a_violation(tmp_path, module, line, reported):
    copy_of_the_tree(tmp_path)
    assert lint_imports(tmp_path).returncode == 0  # the copy holds, as the tree does

    with open(tmp_path / module, "a") as handle:
        handle.write("\n\n" + line)
    done = lint_imports(tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "BROKEN" in done.stdout and reported in done.stdout, done.stdout


def test_no_import_circle_between_production_modules():
    assert import_cycles(ROOT) == []


def test_the_circle_check_finds_a_circle_made_on_purpose(tmp_path):
    copy_of_the_tree(tmp_path)
    assert import_cycles(tmp_path) == []  # the copy holds, as the tree does
    # runner.cluster.ray_init imports runner.cluster.ray_head; the other way round closes a circle, even inside a function
    with open(tmp_path / "runner" / "cluster" / "ray_head.py", "a") as handle:
        handle.write("\n\ndef _late():\n    from runner.cluster import ray_init\n")
    assert import_cycles(tmp_path) == [["runner.cluster.ray_head", "runner.cluster.ray_init"]]


def test_no_folder_holds_more_than_twelve_modules():
    crowded = {}
    for package in production_packages():
        for folder in [ROOT / package, *(p for p in (ROOT / package).rglob("*") if p.is_dir() and p.name != "__pycache__")]:
            modules = sorted(folder.glob("*.py"))
            if len(modules) > MAX_MODULES_PER_FOLDER:
                crowded[str(folder.relative_to(ROOT))] = len(modules)
    assert crowded == {}, f"folders over {MAX_MODULES_PER_FOLDER} modules (split them by concern): {crowded}"


def test_no_production_module_is_over_the_line_limit():
    lengths = {str(path.relative_to(ROOT)): len(path.read_text().splitlines())
               for package in production_packages() for path in (ROOT / package).rglob("*.py")}
    over = {path: n for path, n in lengths.items() if n > MAX_MODULE_LINES}
    assert over == {}, f"modules over {MAX_MODULE_LINES} lines (split them by concern): {over}"


def imports_inside_functions(tree: ast.AST) -> list[ast.stmt]:
    return [node for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
            for node in ast.walk(fn) if isinstance(node, (ast.Import, ast.ImportFrom))]


def unexplained_imports(path: Path, root: Path = ROOT) -> list[str]:
    """Imports inside functions of ``path`` with no reason on their line (or on the comment line above them)."""
    lines = path.read_text().splitlines()
    found = []
    for node in imports_inside_functions(ast.parse("\n".join(lines))):
        said = "#" in lines[node.end_lineno - 1] or lines[node.lineno - 2].strip().startswith("#")
        if not said and not any("#" in line for line in lines[node.lineno - 1:node.end_lineno]):
            found.append(f"{path.relative_to(root)}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    return found


def test_every_import_inside_a_function_says_why():
    """An import is at the top of its module unless it is heavy or must wait (torch, Ray Train, Prefect's server, a
    flow imported only when served), and then its reason is on its line (issue 68). benchmarks/ times its imports."""
    found = [line for package in production_packages() if package != "benchmarks"
             for path in sorted((ROOT / package).rglob("*.py")) for line in unexplained_imports(path)]
    assert found == [], "imports inside functions without a reason:\n" + "\n".join(found)


def test_the_reason_check_catches_an_unexplained_import(tmp_path):
    module = tmp_path / "module.py"
    module.write_text("def late():\n    from storage_io import join\n    return join\n\n\ndef said():\n    import torch  # heavy\n")
    assert unexplained_imports(module, tmp_path) == ["module.py:2: from storage_io import join"]  # the torch import says why


def test_no_test_module_imports_another():
    """Shared test code lives in tests/support (plain helpers) and tests/conftest.py (fixtures)."""
    found = []
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in getattr(node, "names", [])]
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found += [f"{path.name}: {name}" for name in names if name.startswith(("tests.test_", "tests.conftest"))]
    assert found == []
