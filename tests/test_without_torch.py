"""A relay or seed host installs ciuic-p2p without the `train` extra: the CLI and the
daemon never import torch or numpy, and every command but ``demo`` works where they are
missing. "Missing" is a directory ahead on PYTHONPATH whose ``torch`` and ``numpy``
raise ModuleNotFoundError on import, as an environment without them would, for every
import anywhere in the process (lazy ones included)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.daemon.fleet import Fleet, free_port_block

MISSING = 'raise ModuleNotFoundError("No module named {name!r}", name={name!r})\n'


@pytest.fixture
def without_torch(tmp_path: Path) -> dict[str, str]:
    """The environment of a process that has neither torch nor numpy."""
    shadow = tmp_path / "no-torch"
    for name in ("torch", "numpy"):
        (shadow / name).mkdir(parents=True)
        (shadow / name / "__init__.py").write_text(MISSING.format(name=name))
    path = os.pathsep.join(filter(None, [str(shadow), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}


def run(
    env: dict[str, str], *args: str, timeout_s: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout_s,
    )


@pytest.mark.processes
def test_importing_the_cli_and_the_daemon_loads_neither_torch_nor_numpy() -> None:
    code = (
        "import sys, ciuic_p2p.cli, ciuic_p2p.daemon.run, ciuic_p2p.daemon.node\n"
        "from ciuic_p2p.cli import build_parser\n"
        "build_parser()\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy')))\n"
    )
    done = run(dict(os.environ), "-c", code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.processes
def test_the_shadow_really_hides_torch(without_torch: dict[str, str]) -> None:
    done = run(without_torch, "-c", "import torch")
    assert done.returncode == 1 and "No module named 'torch'" in done.stderr


@pytest.mark.processes
def test_commands_work_without_torch_and_demo_says_what_to_install(
    without_torch: dict[str, str], tmp_path: Path
) -> None:
    for args in (["--version"], ["--help"], ["demo", "--help"], ["config", "example"]):
        done = run(without_torch, "-m", "ciuic_p2p", *args)
        assert done.returncode == 0, (args, done.stderr)
        assert "Traceback" not in done.stderr
    assert run(without_torch, "-m", "ciuic_p2p", "--version").stdout.startswith("ciuic-node ")
    key = run(without_torch, "-m", "ciuic_p2p", "keygen", "--out", str(tmp_path / "k.key"))
    assert key.returncode == 0 and "public key:" in key.stdout

    demo = run(without_torch, "-m", "ciuic_p2p", "demo", "--nodes", "2")
    assert demo.returncode == 2
    assert demo.stderr.count("\n") == 1 and "pip install 'ciuic-p2p[demo]'" in demo.stderr

    hook = run(without_torch, "-c", "import ciuic_p2p; ciuic_p2p.attach")
    assert hook.returncode == 1 and "pip install 'ciuic-p2p[train]'" in hook.stderr


@pytest.mark.processes
def test_two_daemons_form_a_mesh_without_torch(
    without_torch: dict[str, str], tmp_path: Path
) -> None:
    fleet = Fleet(tmp_path / "fleet")
    base = free_port_block(2)
    try:
        fleet.start("a", "--listen", f"127.0.0.1:{base}", env=without_torch)
        fleet.start(
            "b",
            "--listen",
            f"127.0.0.1:{base + 1}",
            "--join",
            f"127.0.0.1:{base}",
            env=without_torch,
        )

        def both_see_two() -> bool:
            views = [fleet.status(n) for n in ("a", "b")]
            return all(v is not None and v.get("alive") == 2 for v in views)

        fleet.wait(both_see_two, 60, "two daemons without torch see each other")
        status = run(
            without_torch, "-m", "ciuic_p2p", "status", "--state-dir", str(tmp_path / "fleet" / "a")
        )
        assert status.returncode == 0 and "alive" in status.stdout, status.stderr
    finally:
        fleet.stop_all()
    for name in ("a", "b"):
        assert "Traceback" not in fleet.logs[name].read_text()
