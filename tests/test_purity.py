"""Pure cores never import I/O, clocks or the transport (docs/architecture.md)."""

from __future__ import annotations

import ast
from pathlib import Path

import ciuic_p2p.core

FORBIDDEN = {"asyncio", "socket", "time", "uvloop", "selectors", "threading", "aioquic"}


def test_core_modules_import_no_io_or_clock() -> None:
    core = Path(ciuic_p2p.core.__file__).parent
    offenders = []
    for path in sorted(core.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] in FORBIDDEN]
    assert offenders == []
    assert len(list(core.glob("*.py"))) >= 6
