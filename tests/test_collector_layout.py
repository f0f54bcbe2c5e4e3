"""The collector's modules import one another in one direction: no cycle, even through imports
made inside functions."""

from __future__ import annotations

import ast
from pathlib import Path

import witcert.collector

PACKAGE = "witcert.collector"


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == PACKAGE:
                found.update(f"{PACKAGE}.{alias.name}" for alias in node.names)
            elif node.module.startswith(PACKAGE + "."):
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith(PACKAGE + "."))
    return found


def test_collector_modules_import_without_cycles():
    folder = Path(witcert.collector.__file__).parent
    modules = {f"{PACKAGE}.{path.stem}": path for path in folder.glob("*.py") if path.stem != "__init__"}
    graph = {name: _imports(path) & modules.keys() for name, path in modules.items()}
    assert graph[f"{PACKAGE}.service"] >= {f"{PACKAGE}.http_server", f"{PACKAGE}.pipeline"}
    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, "import cycle: " + " -> ".join((*path[path.index(name) :], name))
        if name in done:
            return
        for target in graph[name]:
            visit(target, (*path, name))
        done.add(name)

    for name in graph:
        visit(name, ())
