"""Vivaldi on the 11-city matrix: coordinates learned from probe RTTs estimate the
RTT of pairs, and the map prefers measurements."""

from __future__ import annotations

import statistics

from ciuic_p2p.config import MeshSection
from ciuic_p2p.core.mesh.rttmap import RttMap
from ciuic_p2p.core.mesh.suspicion import Suspicion
from ciuic_p2p.data import scenario_path
from ciuic_p2p.emulator.meshsim import SimMesh
from ciuic_p2p.emulator.scenarios import load_scenario


def test_coordinates_estimate_unmeasured_pairs_within_a_quarter() -> None:
    scenario = load_scenario(scenario_path("cities11"))
    sim = SimMesh(scenario, MeshSection(), seed=2)
    sim.start_all(join_through="Tokyo")
    sim.run_for(120)
    tokyo = sim.nodes["Tokyo"].rttmap
    errors = []
    names = scenario.node_names()
    for a in names:
        for b in names:
            if a < b and "Tokyo" not in (a, b):
                est = tokyo.estimate_s(a, b)
                assert est is not None
                errors.append(abs(est - scenario.rtt_s(a, b)) / scenario.rtt_s(a, b))
    assert statistics.median(errors) < 0.25
    # Where a pair was measured, the map uses the measurement.
    assert tokyo.source("Tokyo", "Sydney") == "measured"
    assert abs(tokyo.rtt_s("Tokyo", "Sydney") - scenario.rtt_s("Tokyo", "Sydney")) < 0.005  # type: ignore[operator]


def test_link_state_republishes_only_on_real_change() -> None:
    m = RttMap("a", MeshSection(link_publish_min_s=0.0))
    m.observe("b", m.vivaldi.coordinate, 0.100)
    first = m.publish(0.0)
    assert first is not None and first.entries[0].rtt_us == 100_000
    m.observe("b", m.vivaldi.coordinate, 0.102)
    assert m.publish(1.0) is None  # 2 ms of noise on 100 ms: not news
    for _ in range(30):
        m.observe("b", m.vivaldi.coordinate, 0.150)
    changed = m.publish(2.0)
    assert changed is not None and changed.version > first.version


def test_lifeguard_suspicion_shrinks_with_confirmations() -> None:
    s = Suspicion(started_at=10.0, expected=3, min_s=1.0, max_s=3.0, by="x")
    assert s.deadline() == 13.0
    assert s.confirm("y") and not s.confirm("y")
    assert 11.0 < s.deadline() < 13.0
    s.confirm("z")
    s.confirm("w")
    assert s.deadline() == 11.0
