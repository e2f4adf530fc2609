"""`ciuic-node run` processes on the emulated 11-city WAN: join through one seed,
SIGKILL, restart with a new incarnation, a partition that heals; and the CLI's
join/leave/status against a running daemon."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from ciuic_p2p.admission import ClusterCA, write_pem
from ciuic_p2p.data import scenario_path
from ciuic_p2p.emulator.scenarios import load_scenario
from tests.daemon.fleet import NOW, Fleet, free_port_block

pytestmark = pytest.mark.processes

NAMES = ["Tokyo", "Singapore", "Sydney", "Frankfurt", "London", "Virginia", "SaoPaulo", "Oregon"]
PARTITION_AT_S = 45.0
# The split must be seen while it lasts: 15 s was too short for eight daemons on two
# loaded cores (CI saw the halves still one mesh after 15 s, once).
HEAL_AT_S = 80.0


def write_scenario(path: Path) -> Path:
    wan = scenario_path("cities11").parent.parent / "wan"
    asia = ["Tokyo", "Singapore", "Sydney", "Mumbai"]
    rest = ["Frankfurt", "London", "Paris", "Virginia", "Chicago", "SaoPaulo", "Oregon"]
    path.write_text(
        f"""seed = 11
rate_scale = 0.001
[matrix]
rtt_csv = "{wan / "rtt_cloudping_11cities.csv"}"
bandwidth_csv = "{wan / "bandwidth_11cities.csv"}"
[defaults]
jitter_ms = 0.4
jitter_dist = "normal"
reorder = false
[[schedule]]
at_s = {PARTITION_AT_S}
action = "partition"
groups = [{asia!r}, {rest!r}]
[[schedule]]
at_s = {HEAL_AT_S}
action = "heal_all"
""".replace("'", '"')
    )
    return path


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ciuic_p2p.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def members(fleet: Fleet, name: str) -> dict[str, dict[str, Any]] | None:
    status = fleet.status(name)
    if status is None:
        return None
    return {m["peer"]: m for m in status["members"]}


def test_eight_processes_join_fail_restart_and_heal(fleet: Fleet, tmp_path: Path) -> None:
    scenario_file = write_scenario(tmp_path / "wan.toml")
    order = load_scenario(scenario_file).node_names()
    base = free_port_block(len(order))
    start = time.monotonic()

    # Half the mesh runs the default QUIC backend (qh3), half aioquic: they interoperate.
    on_aioquic = set(NAMES[1::2])

    def launch(name: str, *extra: str) -> None:
        port = base + order.index(name)
        env = {"CIUIC_TRANSPORT_QUIC_BACKEND": "aioquic"} if name in on_aioquic else {}
        fleet.start(
            name,
            "--listen", f"127.0.0.1:{port}",
            "--emulate", str(scenario_file),
            "--emulate-node", name,
            "--emulate-ports", str(base),
            "--emulate-start", repr(start),
            *extra,
            env=env,
        )  # fmt: skip

    seed = f"127.0.0.1:{base + order.index('Tokyo')}"
    launch("Tokyo")
    fleet.wait(lambda: fleet.status("Tokyo") is not None, 30, "seed up")
    for name in NAMES[1:]:
        launch(name, "--join", seed)

    def alive_counts() -> list[int]:
        return [
            (fleet.status(n) or {}).get("alive", 0)
            for n in fleet.procs
            if fleet.procs[n].poll() is None
        ]

    fleet.wait(lambda: alive_counts() == [8] * 8, 40, "all eight agree")
    backends = {n: (fleet.status(n) or {}).get("quic_backend") for n in NAMES}
    assert {n for n, b in backends.items() if b == "aioquic"} == on_aioquic, backends
    assert set(backends.values()) == {"aioquic", "qh3"}, backends

    frankfurt = fleet.status("Frankfurt")
    assert frankfurt is not None
    victim, old_incarnation = frankfurt["peer"], frankfurt["incarnation"]
    fleet.kill("Frankfurt")
    survivors = [n for n in NAMES if n != "Frankfurt"]

    def all_mark_dead() -> bool:
        views = [members(fleet, n) for n in survivors]
        return all(v is not None and v[victim]["state"] == "dead" for v in views)

    fleet.wait(all_mark_dead, 20, "every survivor marks the killed node failed")

    launch("Frankfurt", "--join", f"127.0.0.1:{base + order.index('Sydney')}")

    def back_newer() -> bool:
        views = [members(fleet, n) for n in survivors]
        return all(
            v is not None
            and v[victim]["state"] == "alive"
            and int(v[victim]["incarnation"]) > int(old_incarnation)
            for v in views
        )

    fleet.wait(back_newer, 30, "the restarted node is back, newer")
    assert time.monotonic() - start < PARTITION_AT_S - 3, "too slow to reach the partition phase"

    fleet.wait(lambda: time.monotonic() - start > PARTITION_AT_S, 60, "partition time")
    fleet.wait(lambda: sorted(alive_counts()) == [3, 3, 3, 5, 5, 5, 5, 5], 33, "halves split")
    fleet.wait(lambda: time.monotonic() - start > HEAL_AT_S, 40, "heal time")
    fleet.wait(lambda: alive_counts() == [8] * 8, 40, "one mesh again")


def test_cli_join_leave_status_and_a_wrong_credential(fleet: Fleet, tmp_path: Path) -> None:
    base = free_port_block(3)
    fleet.start("a", "--listen", f"127.0.0.1:{base}")
    fleet.start("b", "--listen", f"127.0.0.1:{base + 1}")
    fleet.wait(lambda: fleet.status("a") and fleet.status("b"), 30, "daemons up")

    joined = run("join", f"127.0.0.1:{base}", "--state-dir", str(tmp_path / "b"))
    assert joined.returncode == 0, joined.stderr
    assert "2 members" in joined.stdout
    status = run("status", "--state-dir", str(tmp_path / "a"))
    assert status.returncode == 0 and "alive" in status.stdout

    # A node whose certificate another cluster's CA issued cannot get in.
    rogue_ca = ClusterCA.create("other-cluster", NOW)
    fleet.state_dir("rogue", ca=rogue_ca)
    fleet.start("rogue", "--listen", f"127.0.0.1:{base + 2}", "--join", f"127.0.0.1:{base}")
    proc = fleet.procs["rogue"]
    assert proc.wait(30) == 1
    assert "cannot join through" in fleet.logs["rogue"].read_text()
    # And the CLI says so clearly when asked to join through a non-daemon.
    nobody = run("join", f"127.0.0.1:{base}", "--control", str(tmp_path / "none.sock"))
    assert nobody.returncode == 2 and "no daemon here" in nobody.stderr

    left = run("leave", "--state-dir", str(tmp_path / "b"))
    assert left.returncode == 0
    assert fleet.procs["b"].wait(20) == 0
    fleet.wait(
        lambda: (
            (m := members(fleet, "a")) is not None and [v["state"] for v in m.values()] == ["left"]
        ),
        20,
        "a sees b as left",
    )


def test_a_node_whose_certificate_its_own_ca_did_not_issue_fails_at_start(
    tmp_path: Path,
) -> None:
    fleet = Fleet(tmp_path)
    d = fleet.state_dir("stray", ca=ClusterCA.create("other-cluster", NOW))
    write_pem(d / "ca.pem", fleet.ca.certificate)  # trusts a CA that did not issue it
    out = run("run", "--state-dir", str(d), "--listen", "127.0.0.1:0")
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert f"certificate {d / 'node.pem'} fails against the cluster CA {d / 'ca.pem'}" in (
        out.stderr
    )
    assert "O=other-cluster" in out.stderr and "O=test-fleet" in out.stderr


def test_run_without_credentials_says_what_is_missing_and_how_to_make_it(tmp_path: Path) -> None:
    out = run("run", "--state-dir", str(tmp_path), "--listen", "127.0.0.1:0")
    assert out.returncode == 2
    assert "no node key at" in out.stderr and "ciuic-node keygen" in out.stderr
    key_only = tmp_path / "node.key"
    assert run("keygen", "--out", str(key_only)).returncode == 0
    out = run("run", "--state-dir", str(tmp_path), "--listen", "127.0.0.1:0")
    assert out.returncode == 2 and "no node certificate at" in out.stderr
    assert "ca issue" in out.stderr


def test_user_mistakes_get_one_clear_line(fleet: Fleet, tmp_path: Path) -> None:
    base = free_port_block(2)
    fleet.start("a", "--listen", f"127.0.0.1:{base}")
    fleet.wait(lambda: fleet.status("a") is not None, 30, "daemon up")
    # Joining by host name works; joining oneself or a silent address is refused.
    d = tmp_path / "a"
    ok = run("join", f"localhost:{base}", "--state-dir", str(d))
    assert ok.returncode == 1 and "this node itself" in ok.stderr
    silent = run("join", f"127.0.0.1:{base + 1}", "--state-dir", str(d))
    assert silent.returncode == 1 and f"127.0.0.1:{base + 1}" in silent.stderr
    assert "('127.0.0.1'" not in silent.stderr
    # A second daemon on the same state directory stops before touching it.
    incarnation = (d / "incarnation").read_text()
    second = run("run", "--state-dir", str(d), "--listen", f"127.0.0.1:{base + 1}")
    assert second.returncode == 2 and "another ciuic-node daemon" in second.stderr
    assert (d / "incarnation").read_text() == incarnation
    # Listening on every interface needs an address to advertise.
    wild = run("run", "--state-dir", str(fleet.state_dir("b")), "--listen", "0.0.0.0:0")
    assert wild.returncode == 2 and "--advertise" in wild.stderr
    # A certificate issued for another key is refused at start, not at the first join.
    c = fleet.state_dir("c")
    (c / "node.pem").write_bytes((tmp_path / "a" / "node.pem").read_bytes())
    mismatch = run("run", "--state-dir", str(c), "--listen", "127.0.0.1:0")
    assert mismatch.returncode == 2 and "another key" in mismatch.stderr
    assert "Traceback" not in ok.stderr + silent.stderr + second.stderr + wild.stderr
