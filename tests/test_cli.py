from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ciuic_p2p import __version__
from ciuic_p2p.cli import main
from ciuic_p2p.cli.control import _print_peers

pytestmark = pytest.mark.processes

CLI_REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "reference" / "cli.md"


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


def test_keygen_ca_issue_and_revoke_flow(tmp_path: Path) -> None:
    key = tmp_path / "node.key"
    out = run_cli("keygen", "--out", str(key))
    peer_id, pub_line = out.stdout.splitlines()
    assert out.returncode == 0 and peer_id.startswith("ciuic")
    public_hex = pub_line.split()[2]
    assert (key.stat().st_mode & 0o777) == 0o600
    assert run_cli("keygen", "--out", str(key)).returncode == 2  # never overwrites silently
    ca = tmp_path / "ca"
    assert run_cli("ca", "init", "--dir", str(ca), "--cluster", "alpha").returncode == 0
    cert = tmp_path / "node.pem"
    # The CA machine needs only the public key that keygen printed, never the node key.
    issued = run_cli("ca", "issue", "--dir", str(ca), "--key", public_hex, "--out", str(cert))
    assert issued.returncode == 0 and peer_id in issued.stdout
    crl = tmp_path / "revoked.pem"
    revoked = run_cli("ca", "revoke", "--dir", str(ca), str(cert), "--out", str(crl))
    assert revoked.returncode == 0 and "1 node(s) newly revoked" in revoked.stdout
    other = tmp_path / "other"
    assert run_cli("ca", "init", "--dir", str(other), "--cluster", "beta").returncode == 0
    foreign = run_cli("ca", "revoke", "--dir", str(other), str(cert), "--out", str(crl))
    assert foreign.returncode == 2 and "not issued by this CA" in foreign.stderr

    import datetime as dt  # noqa: PLC0415

    from ciuic_p2p.admission import Trust, load_certificate, load_crl  # noqa: PLC0415

    trust = Trust(load_certificate(ca / "ca.pem"), load_crl(crl))
    try:
        trust.verify(load_certificate(cert), dt.datetime.now(dt.UTC))
    except Exception as exc:
        assert "revoked" in str(exc)
    else:
        raise AssertionError("revoked certificate accepted")


def test_key_with_loose_permissions_is_one_clear_line(tmp_path: Path) -> None:
    key = tmp_path / "node.key"
    assert run_cli("keygen", "--out", str(key)).returncode == 0
    key.chmod(0o644)
    assert run_cli("ca", "init", "--dir", str(tmp_path / "ca"), "--cluster", "a").returncode == 0
    result = run_cli(
        "ca",
        "issue",
        "--dir",
        str(tmp_path / "ca"),
        "--key",
        str(key),
        "--out",
        str(tmp_path / "c.pem"),
    )
    assert result.returncode == 2 and "chmod 600" in result.stderr
    assert "Traceback" not in result.stderr and result.stderr.count("\n") == 1


def test_emulate_starts_measures_and_tears_down() -> None:
    # Five pings: the median of two is their mean, and one ping that meets a late
    # wake-up on a busy machine then decides it (125 ms for 119 failed CI once).
    result = run_cli("emulate", "multicloud8", "--nodes", "3", "--pings", "5", "--json")
    assert result.returncode == 0, result.stderr
    import json  # noqa: PLC0415

    data = json.loads(result.stdout)
    assert len(data["nodes"]) == 3 and len(data["pairs"]) == 6
    for pair in data["pairs"]:
        assert pair["measured_ms"] is not None
        assert abs(pair["measured_ms"] - pair["configured_ms"]) < max(
            3, 0.05 * pair["configured_ms"]
        )


@pytest.mark.parametrize(
    "args",
    [
        ["ca", "issue", "--dir", "{ca}", "--key", "00" * 32, "--out", "{tmp}/x.pem"],
        [
            "ca",
            "issue",
            "--dir",
            "{ca}",
            "--key",
            "ab" * 32,
            "--out",
            "{tmp}/x.pem",
            "--days",
            "-5",
        ],
        ["ca", "issue", "--dir", "{ca}", "--key", "ab" * 32, "--out", "/nonexistent/x.pem"],
        ["ca", "init", "--dir", "{tmp}/file", "--cluster", "a"],
        ["emulate", "no-such-scenario"],
        ["emulate", "multicloud8", "--nodes", "1"],
        ["emulate", "multicloud8", "--pings", "0"],
    ],
)
def test_user_mistakes_are_one_clear_line(tmp_path: Path, args: list[str]) -> None:
    ca = tmp_path / "ca"
    assert run_cli("ca", "init", "--dir", str(ca), "--cluster", "a").returncode == 0
    (tmp_path / "file").write_text("not a directory")
    result = run_cli(*(a.format(ca=ca, tmp=tmp_path) for a in args))
    assert result.returncode == 2, result.stdout
    assert "Traceback" not in result.stderr and result.stderr.count("\n") == 1
    assert result.stderr.startswith("ciuic-node: error:")


@pytest.mark.parametrize(
    "command",
    [
        ["run"], ["join"], ["leave"], ["status"], ["peers"], ["routes"], ["keygen"],
        ["ca"], ["ca", "init"], ["ca", "issue"], ["ca", "revoke"], ["audit"],
        ["audit", "verify"], ["config"], ["config", "check"], ["demo"], ["store"],
        ["store", "put"], ["store", "get"], ["emulate"], ["netem"],
    ],
)  # fmt: skip
def test_every_command_answers_help(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main([*command, "--help"])
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: ciuic-node {' '.join(command)}")


def test_inspection_commands_without_a_daemon_fail_in_one_line(tmp_path: Path) -> None:
    for command in ("status", "peers", "routes", "leave"):
        out = run_cli(command, "--json", "--state-dir", str(tmp_path))
        assert out.returncode == 2 and out.stderr.count("\n") == 1, (command, out.stderr)
        assert "no daemon here" in out.stderr and "Traceback" not in out.stderr


def test_control_commands_say_where_they_looked_and_how_to_name_a_daemon(
    tmp_path: Path,
) -> None:
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("CIUIC_")},
        "CIUIC_NODE_STATE_DIR": str(tmp_path / "none"),
    }
    out = subprocess.run(
        [ciuic_node(), "status"], check=False, capture_output=True, text=True, env=env, timeout=60
    )
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert f"looked at {tmp_path / 'none' / 'control.sock'}" in out.stderr
    assert "--state-dir DIR" in out.stderr and "--config FILE" in out.stderr


def test_a_members_address_cannot_write_escapes_to_the_terminal(
    capsys: pytest.CaptureFixture[str],
) -> None:
    hostile: dict[str, object] = {
        "peer": "ciuicx",
        "name": "n\x1b[2J",
        "address": "\x1b]0;pwned\x07:1",
        "state": "alive",
        "rtt_ms": None,
        "rtt_source": None,
        "route": [],
    }
    _print_peers({"members": [hostile]})
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "\\x1b" in out


@pytest.mark.parametrize("join", ["127.0.0.1", "127.0.0.1:notaport", "127.0.0.1:70000", ":7946"])
def test_run_refuses_a_join_address_that_can_never_work(tmp_path: Path, join: str) -> None:
    """Retried forever before, as a warning; ``ciuic-node join`` refused the same at
    once. Before the credentials: the first thing wrong is the first said."""
    started = time.monotonic()
    result = subprocess.run(
        [ciuic_node(), "run", "--join", join, "--state-dir", str(tmp_path)],
        capture_output=True, text=True, check=False, timeout=60,
    )  # fmt: skip
    elapsed = time.monotonic() - started
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().count("\n") == 0 and "--join" in result.stderr
    assert "HOST:PORT" in result.stderr and "Traceback" not in result.stderr
    print(f"--join {join!r}: exit 2 after {elapsed:.2f} s")


def stated_exit_status(case: str) -> int:
    """The exit status docs/reference/cli.md's table gives for ``case``, a phrase of
    its row."""
    for line in CLI_REFERENCE.read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0].isdigit() and case in cells[1]:
            return int(cells[0])
    raise AssertionError(f"docs/reference/cli.md states no exit status for {case!r}")


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory whose socket paths fit AF_UNIX's 108 bytes, which tmp_path may not."""
    with tempfile.TemporaryDirectory(prefix="ciuic-cli-") as path:
        yield Path(path)


def stale_socket(directory: Path) -> Path:
    """A control.sock left by a daemon that died: the file is there, nothing listens."""
    path = directory / "control.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(path))
    return path


@pytest.mark.parametrize("command", ["status", "leave", "peers", "routes"])
@pytest.mark.parametrize("where", ["no socket", "no daemon in the state dir", "stale socket"])
def test_an_unreachable_daemon_exits_as_the_reference_says(
    short_dir: Path, command: str, where: str
) -> None:
    socket_args = {
        "no socket": ["--control", "/nonexistent/control.sock"],
        "no daemon in the state dir": ["--state-dir", str(short_dir)],
        "stale socket": ["--control", str(short_dir / "control.sock")],
    }[where]
    if where == "stale socket":
        stale_socket(short_dir)
    out = run_cli(command, *socket_args)
    assert out.returncode == stated_exit_status("cannot be reached"), (command, out.stderr)
    assert out.stderr.startswith("ciuic-node: error:") and out.stderr.count("\n") == 1


def answer_once_with(path: Path, answer: dict[str, object]) -> threading.Thread:
    """A stand-in daemon on ``path`` that answers one request with ``answer``."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)
    server.settimeout(60)

    def serve() -> None:
        with server, server.accept()[0] as conn:
            conn.makefile("rb").readline()
            conn.sendall(json.dumps(answer).encode() + b"\n")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("command", ["status", "leave", "peers"])
def test_a_daemon_that_refuses_the_request_exits_as_the_reference_says(
    short_dir: Path, command: str
) -> None:
    path = short_dir / "control.sock"
    server = answer_once_with(path, {"ok": False, "error": "not now"})
    out = run_cli(command, "--control", str(path))
    server.join(timeout=60)
    assert out.returncode == stated_exit_status("answered with an error"), out.stderr
    assert out.stderr == "ciuic-node: error: not now\n"
