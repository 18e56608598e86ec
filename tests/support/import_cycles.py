"""Print the import circles between a tree's production modules, one JSON list of module names a line.

Run with the tree as the working directory and on ``PYTHONPATH`` (tests/test_layers.py does, for the real
tree and for a copy it breaks on purpose). The packages are ``[tool.importlinter].root_packages`` of the
tree's pyproject.toml; grimp reads every import statement (module level, inside functions, under
``TYPE_CHECKING``) without running the code. A circle is a strongly connected component of more than one
module in the graph of direct imports.
"""

from __future__ import annotations

import json
import sys
import tomllib
from pathlib import Path

import grimp


def circles(graph) -> list[list[str]]:
    """Tarjan's strongly connected components of ``graph`` with more than one module, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for other in sorted(graph.find_modules_directly_imported_by(module)):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in on_stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return sorted(found)


def main() -> int:
    packages = tomllib.loads(Path("pyproject.toml").read_text())["tool"]["importlinter"]["root_packages"]
    graph = grimp.build_graph(*packages, include_external_packages=False, cache_dir=None)
    for circle in circles(graph):
        print(json.dumps(circle))
    return 0


if __name__ == "__main__":
    sys.exit(main())
