from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ciuic_p2p import __version__
from ciuic_p2p.cli import main


def ciuic_node() -> str:
    """The installed console script, next to this interpreter or on PATH."""
    beside = Path(sys.executable).with_name("ciuic-node")
    found = str(beside) if beside.exists() else shutil.which("ciuic-node")
    assert found, "ciuic-node is not installed"
    return found


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([ciuic_node(), *args], capture_output=True, text=True, check=False)


def test_console_script_answers_version_and_help() -> None:
    version = run_cli("--version")
    assert version.returncode == 0 and version.stdout.strip() == f"ciuic-node {__version__}"
    helptext = run_cli("--help")
    assert helptext.returncode == 0
    assert "usage: ciuic-node" in helptext.stdout and "config" in helptext.stdout


def test_config_check_accepts_a_good_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "node.toml"
    path.write_text("[codec]\ndensity = 0.02\n")
    assert main(["config", "check", str(path)]) == 0
    out = capsys.readouterr().out
    assert "ok (preset wan)" in out and "codec.density = 0.02" in out


def test_config_check_reports_a_bad_file_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "node.toml"
    path.write_text("[codec]\ndensity = -1\n")
    result = run_cli("config", "check", str(path))
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0
    assert "codec.density: must be in (0, 1]" in result.stderr
    assert "Traceback" not in result.stderr
