"""The package's import graph: no circles between project files, and the training
hook does not load the daemon's stack.

Every import counts (module level, inside functions, under ``TYPE_CHECKING``); a
package's ``__init__.py`` is a file of its own, and importing ``a.b.c`` also runs
``a/__init__.py`` and ``a/b/__init__.py``, so those are edges too."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import ciuic_p2p

PACKAGE = Path(ciuic_p2p.__file__).parent


def module_of(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def graph() -> dict[str, set[str]]:
    modules = {module_of(p): p for p in PACKAGE.rglob("*.py")}
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for target in targets:
                if target in modules and target != name:
                    edges[name].add(target)  # what it names, its own package too
                parts = target.split(".")
                # Every package above it runs on import, unless it is one of the
                # importer's own (already running).
                for i in range(1, len(parts)):
                    prefix = ".".join(parts[:i])
                    if prefix in modules and prefix != name and not name.startswith(prefix + "."):
                        edges[name].add(prefix)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles_between_project_files() -> None:
    assert cycles(graph()) == []


def test_the_check_sees_a_circle_through_a_package_init() -> None:
    edges = {"p": {"p.a"}, "p.a": {"p.b"}, "p.b": {"p"}, "q": set()}
    assert cycles(edges) == [["p", "p.a", "p.b"]]


@pytest.mark.processes
def test_the_training_hook_loads_no_transport_no_daemon() -> None:
    code = (
        "import sys, ciuic_p2p.train.hook, ciuic_p2p.train.attach\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('aioquic', 'prometheus_client',"
        " 'aiohttp') or m.startswith('ciuic_p2p.daemon')]\n"
        "print(','.join(sorted(bad)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert done.stdout.strip() == ""
