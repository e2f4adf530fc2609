"""`ciuic-node run` as an operator runs it, attacked (findings 1 and 3 of the hardening
issue): strangers' datagrams must not end it, nor must a full disk."""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.daemon.fleet import Fleet, free_port_block
from tests.hostile.attack import long_header, random_datagrams, source_hosts

pytestmark = pytest.mark.processes


def spray(target: tuple[str, int], datagrams: list[bytes], hosts: list[str]) -> None:
    sockets = []
    try:
        for host in hosts:
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.bind((host, 0))
            sockets.append(s)
        for i, data in enumerate(datagrams):
            sockets[i % len(sockets)].sendto(data, target)
    finally:
        for s in sockets:
            s.close()


def dropped(fleet: Fleet, name: str) -> int:
    status = fleet.status(name) or {}
    return sum(status.get("strangers", {}).get("dropped", {}).values())


def test_a_flood_of_bad_datagrams_leaves_the_daemon_serving(fleet: Fleet) -> None:
    """Finding 1: about 8 datagrams of an unsupported QUIC version stopped a daemon
    (exit status 1: aioquic's IndexError, then the log limiter's DropEvent out of the
    loop's exception handler); each also leaked a connection for good."""
    base = free_port_block(2)
    fleet.start("a", "--listen", f"127.0.0.1:{base}")
    fleet.wait(lambda: fleet.status("a") is not None, 30, "a answers on its control socket")
    rng = random.Random(4)
    floods = [long_header(0x1A2A3A4A, rng=rng) for _ in range(100)]
    floods += [long_header(0xFF00001D, rng=rng) for _ in range(50)] + random_datagrams(200)
    spray(("127.0.0.1", base), floods, source_hosts(64))
    fleet.wait(lambda: dropped(fleet, "a") >= len(floods), 30, "a saw every datagram")
    status = fleet.status("a")
    assert status is not None and fleet.procs["a"].poll() is None
    assert status["internal_errors"] == {}
    assert status["strangers"]["pending_connections"] == 0
    assert status["strangers"]["dropped"]["unsupported QUIC version"] >= 150
    fleet.start("b", "--listen", f"127.0.0.1:{base + 1}", "--join", f"127.0.0.1:{base}")
    fleet.wait(
        lambda: all((s := fleet.status(n)) is not None and s["alive"] == 2 for n in "ab"),
        30,
        "a member still joins it",
    )


def _can_mount_tmpfs(root: Path) -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = root / "probe"
    probe.mkdir()
    done = subprocess.run(
        ["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {probe}"],
        capture_output=True,
        timeout=30,
        check=False,
    )
    return done.returncode == 0


def test_a_full_disk_is_an_error_in_status_not_an_exit(fleet: Fleet, tmp_path: Path) -> None:
    """Finding 3: a full state directory crashed the daemon, and restarting on it said
    "cannot listen ... No space left on device". The state directory here is a full
    tmpfs in a mount namespace of the daemon's own."""
    if not _can_mount_tmpfs(tmp_path):
        pytest.skip("needs root and unshare to mount a small tmpfs in a mount namespace")
    source = fleet.state_dir("full")
    disk = tmp_path / "disk"
    disk.mkdir()
    runtime = tmp_path / "run"
    base = free_port_block(2)
    script = (
        f"mount -t tmpfs -o size=192k tmpfs {disk} && cp -a {source}/. {disk}/ && "
        f"(dd if=/dev/zero of={disk}/filler bs=4k 2>/dev/null || true) && "
        f"exec {sys.executable} -m ciuic_p2p.cli run --state-dir {disk} --name full "
        f"--listen 127.0.0.1:{base} --trainer-socket none"
    )
    env = {**os.environ, "CIUIC_NODE_RUNTIME_DIR": str(runtime), "CIUIC_WEB_PORT": "0"}
    log = tmp_path / "full.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            ["unshare", "-m", "sh", "-c", script], stdout=out, stderr=subprocess.STDOUT, env=env
        )
    fleet.procs["full"] = proc  # type: ignore[assignment]  # ended with the fleet, by PID
    fleet.logs["full"] = log
    control = runtime / "control.sock"
    fleet.wait(control.exists, 60, "the daemon on a full disk listens")
    from ciuic_p2p.daemon.control import request  # noqa: PLC0415

    status = request(control, {"cmd": "status"}, timeout_s=10)
    assert status["ok"] and proc.poll() is None, log.read_text()[-2000:]
    assert "No space left" in status["audit"]["error"] and status["audit"]["write_errors"] >= 1
    text = log.read_text()
    assert "incarnation_not_saved" in text and "cannot listen" not in text
    fleet.start("b", "--listen", f"127.0.0.1:{base + 1}", "--join", f"127.0.0.1:{base}")
    fleet.wait(
        lambda: (s := fleet.status("b")) is not None and s["alive"] == 2,
        30,
        "a member joins the node on a full disk",
    )
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(15) == 0, log.read_text()[-2000:]
