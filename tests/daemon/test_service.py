"""ciuic-node as a service: the systemd unit, the notify protocol, joining when the
seeds are down at boot, reload on SIGHUP and clean stops."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
import urllib.request
from pathlib import Path

import pytest

from ciuic_p2p.admission import ClusterCA, Trust, load_certificate, write_pem
from ciuic_p2p.config import SECTIONS, Config, WebSection, config_from_toml, load_config
from ciuic_p2p.config.example import example_toml
from ciuic_p2p.daemon.assembly import bare_daemon
from ciuic_p2p.daemon.control import request
from ciuic_p2p.daemon.incarnation import next_incarnation
from ciuic_p2p.identity import NodeKey
from tests.daemon.fleet import NOW, Fleet, free_port_block

pytestmark = pytest.mark.processes

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "systemd" / "ciuic-node.service"
IN_CI = os.environ.get("CI") == "true"


def _systemd_analyze() -> str:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        if IN_CI:
            pytest.fail("systemd-analyze is missing on the CI machine")
        pytest.skip("systemd-analyze is not installed")
    return tool


def test_unit_verifies_and_its_exposure_is_at_most_2(tmp_path: Path) -> None:
    tool = _systemd_analyze()
    installed = shutil.which("ciuic-node") or str(Path(sys.executable).parent / "ciuic-node")
    assert Path(installed).exists(), installed
    text = UNIT.read_text()
    assert "ExecStart=/usr/local/bin/ciuic-node run" in text
    unit = tmp_path / "ciuic-node.service"
    unit.write_text(text.replace("/usr/local/bin/ciuic-node", installed))
    verify = subprocess.run(
        [tool, "verify", str(unit)], capture_output=True, text=True, timeout=60, check=False
    )
    assert verify.returncode == 0 and verify.stdout + verify.stderr == "", verify.stderr
    # --threshold=20 (the scale is 0-10 x 10): systemd-analyze exits non-zero above 2.0.
    security = subprocess.run(
        [tool, "security", "--offline=true", "--threshold=20", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    tail = security.stdout.rsplit("exposure level for ciuic-node.service:", 1)[-1].split()
    assert security.returncode == 0 and float(tail[0]) <= 2.0, security.stdout[-500:]
    # The example config the unit names is the generated one, and loads.
    shipped = (ROOT / "systemd" / "node.example.toml").read_text()
    assert shipped == example_toml(), "regenerate: ciuic-node config example > systemd/..."
    example = load_config(ROOT / "systemd" / "node.example.toml")
    assert example.node.runtime_dir == "/run/ciuic" and example.preset == "wan"
    assert example.codec == Config.wan().codec  # defaults only commented: the preset rules
    # Uncommenting every default shown gives a valid config naming every setting.
    full = re.sub(r"(?m)^# (\w+ = )", r"\1", shipped)
    everything = tomllib.loads(full)
    for section in SECTIONS:
        assert set(everything[section]) == set(getattr(Config(), section).__dataclass_fields__)
    assert config_from_toml(full) == example


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ciuic_p2p.cli", *args],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


class NotifySocket:
    """The systemd end of sd_notify: a datagram socket collecting messages."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.messages: list[dict[str, str]] = []

    def wait_for(self, key: str, timeout_s: float, value: str | None = None) -> dict[str, str]:
        """The first message not yet consumed that sets ``key`` (bounded)."""
        deadline = time.monotonic() + timeout_s
        while True:
            for i, m in enumerate(self.messages):
                if key in m and (value is None or m[key] == value):
                    del self.messages[: i + 1]
                    return m
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {key} within {timeout_s} s; got {self.messages}")
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            self.messages.append(dict(line.split("=", 1) for line in data.decode().splitlines()))

    def close(self) -> None:
        self.sock.close()


def test_notify_ready_watchdog_reload_and_stopping(fleet: Fleet, tmp_path: Path) -> None:
    notify = NotifySocket(tmp_path / "notify.sock")
    try:
        fleet.start(
            "a",
            "--listen",
            "127.0.0.1:0",
            env={"NOTIFY_SOCKET": str(notify.path), "WATCHDOG_USEC": "300000"},
        )
        ready = notify.wait_for("READY", 60)
        assert ready["READY"] == "1" and "listening on 127.0.0.1:" in ready["STATUS"]
        # Keep-alives every half watchdog interval, from the event loop.
        for _ in range(3):
            notify.wait_for("WATCHDOG", 2)
        # `run` serves the status page and metrics; status names the URL.
        status = fleet.status("a")
        assert status is not None and status["web"]["url"].startswith("http://127.0.0.1:")
        with urllib.request.urlopen(status["web"]["url"] + "metrics", timeout=10) as answer:
            assert "ciuic_uptime_seconds" in answer.read().decode()
        proc = fleet.procs["a"]
        proc.send_signal(signal.SIGHUP)
        notify.wait_for("RELOADING", 10)
        notify.wait_for("READY", 10)
        assert fleet.status("a")["service"]["reloads"] == 1  # type: ignore[index]
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        stopping = notify.wait_for("STOPPING", 10)
        assert "leaving" in stopping["STATUS"]
        assert proc.wait(10) == 0
        assert time.monotonic() - t0 < 5.0
        # Not a terminal: every line it wrote is JSON (journald, jq, log shippers).
        lines = fleet.logs["a"].read_text().splitlines()
        events = [json.loads(line)["event"] for line in lines]
        assert "listening" in events and "web_started" in events and "ready" in events
    finally:
        notify.close()


def test_seeds_down_at_boot_ready_anyway_then_joins_in_the_background(
    fleet: Fleet, tmp_path: Path
) -> None:
    base = free_port_block(2)
    notify = NotifySocket(tmp_path / "notify.sock")
    try:
        fleet.start(
            "b",
            "--listen",
            f"127.0.0.1:{base + 1}",
            env={
                "NOTIFY_SOCKET": str(notify.path),
                "CIUIC_NODE_JOIN": f'["127.0.0.1:{base}"]',
                "CIUIC_NODE_FIRST_JOIN_TIMEOUT_S": "1.5",
                "CIUIC_NODE_JOIN_RETRY_S": "0.5",
            },
        )
        ready = notify.wait_for("READY", 60)
        assert ready["STATUS"].startswith("joining"), ready
        status = fleet.status("b")
        assert status is not None and status["service"]["state"] == "joining"
        assert f"127.0.0.1:{base}" in status["service"]["join_error"]
        # The seed comes up: b joins on its own, without a restart.
        fleet.start("a", "--listen", f"127.0.0.1:{base}")
        fleet.wait(
            lambda: (
                (s := fleet.status("b")) is not None
                and s["service"]["state"] == "running"
                and s["alive"] == 2
            ),
            60,
            "b joined a in the background",
        )
        assert fleet.procs["b"].poll() is None
        notify.wait_for("STATUS", 10)
    finally:
        notify.close()


def test_ctrl_c_leaves_announced_and_a_second_one_exits_at_once(fleet: Fleet) -> None:
    base = free_port_block(3)
    fleet.start("a", "--listen", f"127.0.0.1:{base}")
    fleet.wait(lambda: fleet.status("a") is not None, 60, "a up")
    for i, name in enumerate(("b", "c"), 1):
        fleet.start(name, "--listen", f"127.0.0.1:{base + i}", "--join", f"127.0.0.1:{base}")
    fleet.wait(
        lambda: all((s := fleet.status(n)) is not None and s["alive"] == 3 for n in "abc"),
        60,
        "three members",
    )
    # The inspection commands, for people and for scripts.
    a_dir = str(fleet.root / "a")
    peers = cli("peers", "--json", "--state-dir", a_dir)
    assert peers.returncode == 0, peers.stderr
    listed = json.loads(peers.stdout)["members"]
    assert sorted(m["state"] for m in listed) == ["alive"] * 2  # the others
    routes = cli("routes", "--json", "--state-dir", a_dir)
    table = json.loads(routes.stdout)["routes"]
    me = json.loads(peers.stdout)["peer"]
    assert len(table) == 2 and all(r["path"][0] == me and len(r["path"]) >= 2 for r in table)
    readable = cli("routes", "--state-dir", a_dir)
    assert readable.returncode == 0 and "(direct" in readable.stdout
    # Found through a config file, even one broken since the daemon started on it.
    broken = fleet.root / "broken.toml"
    broken.write_text(f'[node]\nstate_dir = "{a_dir}"\n[audit]\nbogus = 1\n')
    status = cli("status", "--config", str(broken))
    assert status.returncode == 0, status.stderr
    assert "status page: http://127.0.0.1:" in status.stdout and "audit log:" in status.stdout
    b = fleet.procs["b"]
    t0 = time.monotonic()
    b.send_signal(signal.SIGINT)
    assert b.wait(10) == 0
    assert time.monotonic() - t0 < 5.0
    fleet.wait(
        lambda: any(
            m["state"] == "left" for m in (fleet.status("a") or {"members": []})["members"]
        ),
        20,
        "a sees b's announced leave",
    )
    # Twice: the second signal does not wait for the leave.
    c = fleet.procs["c"]
    c.send_signal(signal.SIGINT)
    c.send_signal(signal.SIGINT)
    assert c.wait(10) in (0, 128 + signal.SIGINT)
    log = fleet.logs["c"].read_text()
    assert "Traceback" not in log


def test_a_reloaded_revocation_list_drops_a_linked_node(fleet: Fleet) -> None:
    base = free_port_block(2)
    fleet.start("a", "--listen", f"127.0.0.1:{base}")
    fleet.wait(lambda: fleet.status("a") is not None, 60, "a up")
    fleet.start("b", "--listen", f"127.0.0.1:{base + 1}", "--join", f"127.0.0.1:{base}")
    fleet.wait(lambda: (s := fleet.status("a")) is not None and s["alive"] == 2, 60, "joined")
    b_cert = load_certificate(fleet.root / "b" / "node.pem")
    write_pem(
        fleet.root / "a" / "revoked.pem", fleet.ca.revocation_list([b_cert.serial_number], NOW)
    )
    fleet.procs["a"].send_signal(signal.SIGHUP)
    fleet.wait(
        lambda: (s := fleet.status("a")) is not None and len(s["banned"]) == 1,
        30,
        "a drops b",
    )
    before = fleet.status("a")["counters"].get("chunks_delivered", 0)  # type: ignore[index]
    request(fleet.control("b"), {"cmd": "broadcast", "size": 1000})
    fleet.wait(
        lambda: (
            (s := fleet.status("a")) is not None
            and all(m["state"] != "alive" for m in s["members"])
        ),
        30,
        "b no longer alive at a",
    )
    assert fleet.status("a")["counters"].get("chunks_delivered", 0) == before  # type: ignore[index]


def test_a_taken_port_exits_1_for_systemd_to_retry(fleet: Fleet) -> None:
    base = free_port_block(1)
    fleet.start("a", "--listen", f"127.0.0.1:{base}")
    fleet.wait(lambda: fleet.status("a") is not None, 60, "a up")
    b = cli("run", "--state-dir", str(fleet.state_dir("b")), "--listen", f"127.0.0.1:{base}")
    assert b.returncode == 1, b.stderr  # 2 would be a user mistake: RestartPreventExitStatus
    assert b.stderr.count("\n") == 1 and f"cannot listen on 127.0.0.1:{base}" in b.stderr


def test_an_incarnation_raised_by_a_refutation_survives_a_restart(tmp_path: Path) -> None:
    async def main() -> None:
        ca = ClusterCA.create("incarnations", NOW)
        key = NodeKey.generate()
        cfg = dataclasses.replace(
            Config.lan(), node=dataclasses.replace(Config.lan().node, listen_port=0)
        )
        daemon = bare_daemon(
            cfg, key, ca.issue(key.public_key, NOW), Trust(ca.certificate), state_dir=tmp_path
        )
        await daemon.start()
        try:
            assert (tmp_path / "incarnation").read_text().strip() == "0"
            # What a refutation does: the member raises its own incarnation.
            daemon.mesh.membership.incarnation += 3
            daemon.broadcast(b"any")  # the next turn of the machine saves it
            assert (tmp_path / "incarnation").read_text().strip() == "3"
        finally:
            await daemon.close()
        assert next_incarnation(tmp_path) == 4

    asyncio.run(main())


def test_two_daemons_on_one_host_each_get_a_page_with_web_port(fleet: Fleet) -> None:
    base = free_port_block(3)
    for i, name in enumerate("ab"):
        fleet.start(name, "--listen", f"127.0.0.1:{base + i}", "--web-port", "0")

    def web(name: str) -> dict[str, str]:
        status = fleet.status(name)
        return status.get("web") or {} if status else {}

    fleet.wait(lambda: all(web(n) for n in "ab"), 60, "both up, with their pages")
    urls = [web(n)["url"] for n in "ab"]
    ports = {int(u.rsplit(":", 1)[1].rstrip("/")) for u in urls}
    assert len(ports) == 2 and 0 not in ports
    for name, url in zip("ab", urls, strict=True):  # the chosen port, printed at start
        events = [json.loads(line) for line in fleet.logs[name].read_text().splitlines()]
        assert any(e["event"] == "web_started" and e.get("url") == url for e in events)
    # A third given a taken port stops at once and says what to do: its operator
    # asked for the page there.
    taken = min(ports)
    fleet.start("c", "--listen", f"127.0.0.1:{base + 2}", "--web-port", str(taken))
    code = fleet.procs["c"].wait(60)
    said = fleet.logs["c"].read_text()
    assert code == 2, said[-2000:]
    assert f"cannot listen on 127.0.0.1:{taken}" in said and "--web-port" in said


def test_a_taken_default_web_port_is_said_at_start_and_in_status(fleet: Fleet) -> None:
    """Only the default port: the daemon trains on without a page, and says so."""
    default = WebSection().port
    holder = socket.socket()
    try:
        holder.bind(("127.0.0.1", default))
        holder.listen()
    except OSError:
        pass  # taken already, by someone else: as good for this test
    try:
        # The fleet gives every daemon port 0; this one the default, as if unset.
        fleet.start(
            "a", "--listen", f"127.0.0.1:{free_port_block(1)}",
            env={"CIUIC_WEB_PORT": str(default)},
        )  # fmt: skip
        fleet.wait(lambda: bool((fleet.status("a") or {}).get("web")), 60, "a up")
        status = fleet.status("a") or {}
        assert f"cannot listen on 127.0.0.1:{default}" in status["web"]["error"]
        events = [json.loads(line) for line in fleet.logs["a"].read_text().splitlines()]
        assert any(e["event"] == "web_unavailable" for e in events)
    finally:
        holder.close()
