"""Pure cores (every module under ``ciuic_p2p/core/`` and ``ciuic_p2p/emulator/model/``,
sub-packages included) import no I/O, clock, thread or process module, no transport,
and no project module but other cores, ``ciuic_p2p.errors`` and the pure config
sections (docs/architecture.md). Every import counts: at module level, inside a
function, under ``TYPE_CHECKING``."""

from __future__ import annotations

import ast
from pathlib import Path

import ciuic_p2p

FORBIDDEN = {
    "asyncio", "socket", "time", "threading", "concurrent", "multiprocessing",
    "subprocess", "os", "pathlib", "signal", "selectors", "shutil", "tempfile",
    "uvloop", "aioquic", "io", "sys", "glob", "fcntl",
}  # fmt: skip
ALLOWED_PROJECT_PREFIXES = (
    "ciuic_p2p.core",
    "ciuic_p2p.emulator.model",
    "ciuic_p2p.errors",
    "ciuic_p2p.config.sections",
)
PACKAGE = Path(ciuic_p2p.__file__).parent
PURE_ROOTS = (PACKAGE / "core", PACKAGE / "emulator" / "model")


def impure_imports(roots: tuple[Path, ...]) -> list[str]:
    """``file: module`` for each import a pure module must not make."""
    offenders = []
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                names: list[str] = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    if node.level:
                        names = ["(relative import)"]
                    elif node.module:
                        names = [node.module]
                for name in names:
                    top = name.split(".")[0]
                    project = top == "ciuic_p2p"
                    if (top in FORBIDDEN or name == "(relative import)") or (
                        project and not name.startswith(ALLOWED_PROJECT_PREFIXES)
                    ):
                        offenders.append(f"{path.relative_to(root.parent)}: {name}")
    return offenders


def test_core_modules_import_no_io_clock_threads_or_edges() -> None:
    assert impure_imports(PURE_ROOTS) == []
    assert len(list(PURE_ROOTS[0].rglob("*.py"))) >= 30  # the walk reaches sub-packages


def test_the_check_catches_an_impure_module_deep_in_a_sub_package(tmp_path: Path) -> None:
    deep = tmp_path / "core" / "mesh" / "inner"
    deep.mkdir(parents=True)
    (deep / "clean.py").write_text("from ciuic_p2p.core.mesh import messages\nimport math\n")
    (deep / "dirty.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from ciuic_p2p.daemon.node import MeshDaemon\n"
        "def later():\n    import time\n    from concurrent.futures import ThreadPoolExecutor\n"
    )
    found = impure_imports((tmp_path / "core",))
    assert found == [
        "core/mesh/inner/dirty.py: ciuic_p2p.daemon.node",
        "core/mesh/inner/dirty.py: time",
        "core/mesh/inner/dirty.py: concurrent.futures",
    ]
