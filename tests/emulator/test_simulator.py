from __future__ import annotations

import struct

from ciuic_p2p.data import scenario_path
from ciuic_p2p.emulator.model.scenario import scenario_from_mapping
from ciuic_p2p.emulator.model.simulator import VirtualNetwork
from ciuic_p2p.emulator.scenarios import load_scenario


class Pinger:
    """Pings every peer once per second and answers pings: a pure endpoint."""

    def __init__(self, name: str, peers: list[str]) -> None:
        self.name, self.peers = name, peers
        self.out: list[tuple[str, bytes]] = []
        self.next_ping = 0.0
        self.rtts: dict[str, list[float]] = {p: [] for p in peers}
        self.sent = 0

    def receive_datagram(self, src: str, data: bytes, now: float) -> None:
        kind, sent_at = struct.unpack("<Bd", data)
        if kind == 0:
            self.out.append((src, struct.pack("<Bd", 1, sent_at)))
        else:
            self.rtts[src].append(now - sent_at)

    def datagrams_to_send(self, now: float) -> list[tuple[str, bytes]]:
        out, self.out = self.out, []
        return out

    def get_timer(self) -> float | None:
        return self.next_ping

    def handle_timer(self, now: float) -> None:
        for p in self.peers:
            self.out.append((p, struct.pack("<Bd", 0, now)))
            self.sent += 1
        self.next_ping = now + 1.0


def run(
    scenario_name: str, hours: float, names: list[str]
) -> tuple[VirtualNetwork, dict[str, Pinger]]:
    scenario = load_scenario(scenario_path(scenario_name)).subset(names)
    net = VirtualNetwork(scenario)
    nodes = {n: Pinger(n, [m for m in names if m != n]) for n in names}
    for n, node in nodes.items():
        net.add(n, node)
    net.run_until(hours * 3600)
    return net, nodes


def test_an_hour_of_virtual_time_runs_in_seconds_with_the_configured_delays() -> None:
    net, nodes = run("cities11", 1.0, ["Tokyo", "Frankfurt", "Sydney"])
    assert net.now == 3600
    scenario = load_scenario(scenario_path("cities11"))
    rtts = nodes["Tokyo"].rtts["Frankfurt"]
    assert len(rtts) > 3500
    assert abs(min(rtts) - scenario.rtt_s("Tokyo", "Frankfurt")) < 0.002


def test_loss_over_hours_matches_the_scenario() -> None:
    _, nodes = run("harsh", 2.0, ["Tokyo", "Paris"])
    sent = sum(n.sent for n in nodes.values())
    answered = sum(len(r) for n in nodes.values() for r in n.rtts.values())
    # A round trip survives two lossy crossings; each loses about 2% + GE bursts.
    loss = 1 - (answered / sent) ** 0.5
    assert 0.015 < loss < 0.05


def test_same_scenario_same_run() -> None:
    a = run("harsh", 0.2, ["Tokyo", "Paris", "London"])[1]
    b = run("harsh", 0.2, ["Tokyo", "Paris", "London"])[1]
    assert a["Tokyo"].rtts == b["Tokyo"].rtts


def test_schedule_applies_on_virtual_time() -> None:
    scenario = scenario_from_mapping(
        {
            "nodes": [{"name": "a"}, {"name": "b"}],
            "defaults": {"delay_ms": 10},
            "schedule": [
                {"at_s": 100, "action": "cut", "between": ["a", "b"]},
                {"at_s": 200, "action": "heal", "between": ["a", "b"]},
            ],
        }
    )
    net = VirtualNetwork(scenario)
    nodes = {n: Pinger(n, ["b" if n == "a" else "a"]) for n in "ab"}
    for n, node in nodes.items():
        net.add(n, node)
    net.run_until(300)
    answered = len(nodes["a"].rtts["b"])
    assert 195 <= answered <= 202  # about 100 s of the 300 had the link cut
