"""Membership on virtual time: 8 nodes of the 11-city scenario (seeded, bounded)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from ciuic_p2p.config import MeshSection
from ciuic_p2p.core.mesh.members import State
from ciuic_p2p.core.mesh.membership import MAX_DEATHS_WITHHELD
from ciuic_p2p.core.mesh.messages import Suspect
from ciuic_p2p.data import scenario_path
from ciuic_p2p.emulator.meshsim import SimMesh
from ciuic_p2p.emulator.scenarios import load_scenario

NAMES = ["Tokyo", "Singapore", "Sydney", "Frankfurt", "London", "Virginia", "SaoPaulo", "Oregon"]


def cities(**defaults: Any) -> SimMesh:
    scenario = load_scenario(scenario_path("cities11")).subset(NAMES)
    if defaults:
        scenario = dataclasses.replace(
            scenario,
            links={k: dataclasses.replace(v, **defaults) for k, v in scenario.links.items()},
        )
    return SimMesh(scenario, MeshSection(), seed=5)


@pytest.fixture
def mesh() -> SimMesh:
    sim = cities()
    sim.start_all(join_through="Tokyo")
    sim.run_until_true(sim.agree, limit_s=10)
    return sim


def test_all_join_through_one_seed_and_agree(mesh: SimMesh) -> None:
    assert mesh.agree(NAMES)
    for name, node in mesh.nodes.items():
        assert node.joined
        assert all(e.state == State.ALIVE for e in mesh.member_events[name])


def test_a_crash_is_seen_by_every_survivor_and_a_restart_comes_back_newer(mesh: SimMesh) -> None:
    mesh.run_for(10)
    mesh.kill("Frankfurt")
    took = mesh.run_until_true(lambda: mesh.all_mark("Frankfurt"), limit_s=10)
    assert took < 5
    survivors = [n for n in NAMES if n != "Frankfurt"]
    assert mesh.agree(survivors)
    old = mesh.nodes["Tokyo"].membership.members["Frankfurt"].incarnation

    mesh.start("Frankfurt", join_through="Sydney")

    def back_newer() -> bool:
        return all(
            node.membership.state_of("Frankfurt") == State.ALIVE
            and node.membership.members["Frankfurt"].incarnation > old
            for name, node in mesh.nodes.items()
            if name != "Frankfurt"
        )

    mesh.run_until_true(back_newer, limit_s=10)
    assert mesh.agree(NAMES)


def test_a_restart_without_saved_state_refutes_its_own_death(mesh: SimMesh) -> None:
    mesh.kill("Oregon")
    mesh.run_until_true(lambda: mesh.all_mark("Oregon"), limit_s=10)
    mesh.incarnations["Oregon"] = -1  # comes back at incarnation 0: it lost its disk
    mesh.start("Oregon", join_through="Tokyo")
    mesh.run_until_true(mesh.agree, limit_s=10)
    assert mesh.nodes["Oregon"].membership.incarnation > 0


def test_a_partition_heals_into_one_mesh(mesh: SimMesh) -> None:
    asia, rest = NAMES[:3], NAMES[3:]
    mesh.emulated.partition(asia, rest)
    mesh.run_until_true(
        lambda: (
            all(mesh.nodes[n].view() == sorted(asia) for n in asia)
            and all(mesh.nodes[n].view() == sorted(rest) for n in rest)
        ),
        limit_s=15,
    )
    mesh.run_for(20)
    mesh.emulated.heal_all()
    took = mesh.run_until_true(lambda: mesh.agree(NAMES), limit_s=30)
    assert took < 15


def test_a_graceful_leave_is_left_not_dead(mesh: SimMesh) -> None:
    leaver = mesh.nodes["London"]
    leaver.leave(mesh.now)
    mesh.net.poke("London")
    mesh.run_until_true(leaver.membership.left_spread, limit_s=5)
    mesh.kill("London")
    mesh.run_until_true(lambda: mesh.all_mark("London", (State.LEFT,)), limit_s=5)
    mesh.run_for(30)
    assert mesh.all_mark("London", (State.LEFT,))


def test_no_false_declarations_under_loss_and_jitter() -> None:
    """2% loss and 30 ms jitter (normal, reordering) on every link for 5 minutes."""
    sim = cities(loss=0.02, jitter_s=0.03, reorder=True)
    sim.start_all(join_through="Tokyo")
    sim.run_until_true(sim.agree, limit_s=20)
    sim.run_for(300)
    declared = [
        (n, e.node)
        for n, events in sim.member_events.items()
        for e in events
        if e.state >= State.DEAD
    ]
    assert declared == []
    assert sim.agree(NAMES)


def test_probe_deadlines_follow_each_peers_rtt(mesh: SimMesh) -> None:
    mesh.run_for(20)
    tokyo = mesh.nodes["Tokyo"].membership
    near, far = tokyo._direct_timeout("Singapore"), tokyo._direct_timeout("SaoPaulo")
    scenario = mesh.emulated.scenario
    assert scenario.rtt_s("Tokyo", "Singapore") < near < far
    assert far > scenario.rtt_s("Tokyo", "SaoPaulo") > 2 * near


def test_a_member_whose_traffic_keeps_coming_is_not_declared_dead(mesh: SimMesh) -> None:
    """A node streaming 1 MiB pieces over a saturated uplink answers probes seconds
    late: members were declared dead while their chunks kept arriving (2.1 MB rounds,
    emulated multi-cloud matrix). Any message on a member's own link since the probe
    (or the suspicion) counts; a member that goes quiet is declared dead as before."""
    london = "London"
    others = [n for n in NAMES if n != london]
    mesh.run_for(5)
    mesh.emulated.partition([london], others)  # every probe, ack and refutation lost
    for _ in range(60):  # 30 s in which its other traffic still arrives
        mesh.run_for(0.5)
        for n in others:
            mesh.nodes[n].membership.heard(london, mesh.now)
    declared = [(n, e.state) for n in others for e in mesh.member_events[n] if e.node == london]
    assert all(state < State.DEAD for _, state in declared), declared
    answered = sum(mesh.nodes[n].membership.probes_answered_by_traffic for n in others)
    assert answered > 0
    took = mesh.run_until_true(lambda: mesh.all_mark(london), limit_s=15)
    assert took < 10


def test_a_member_that_keeps_sending_but_never_refutes_is_declared_dead_in_bounded_time(
    mesh: SimMesh,
) -> None:
    """Review: a member that ignores its suspicion and only keeps sending would stay
    live here and dead elsewhere (split trees). Its traffic extends a suspicion at most
    ``MAX_DEATHS_WITHHELD`` times."""
    london, tokyo = "London", mesh.nodes["Tokyo"].membership
    mesh.run_for(5)
    mesh.emulated.partition([london], [n for n in NAMES if n != london])  # cannot refute
    incarnation = tokyo.members[london].incarnation
    tokyo.apply(Suspect(london, incarnation, "Sydney"), mesh.now)
    start = mesh.now
    while tokyo.state_of(london) != State.DEAD:
        assert mesh.now - start < 20, "never declared dead"
        mesh.run_for(0.25)
        tokyo.heard(london, mesh.now)
    assert tokyo.deaths_withheld == MAX_DEATHS_WITHHELD


def test_force_leave_takes_a_dead_member_as_left_and_refuses_a_live_one(mesh: SimMesh) -> None:
    """``ciuic-node force-leave`` (serf's): a failed member is taken as departed on this
    node's word; one that may still be alive, an unknown one or itself are refused."""
    tokyo = mesh.nodes["Tokyo"]
    assert tokyo.force_leave("London", mesh.now) is not None  # alive: refused
    assert tokyo.force_leave("Atlantis", mesh.now) is not None  # unknown
    assert tokyo.force_leave("Tokyo", mesh.now) is not None  # itself
    assert tokyo.state_of("London") == State.ALIVE
    mesh.kill("London")
    mesh.run_until_true(lambda: mesh.all_mark("London"), limit_s=10)
    assert tokyo.force_leave("London", mesh.now) is None
    assert tokyo.state_of("London") == State.LEFT
    mesh.run_for(60)  # nothing the others gossip (their Dead, its old Alive) undoes it
    assert [e.state for e in mesh.member_events["Tokyo"] if e.node == "London"][-1] == State.LEFT
    assert tokyo.state_of("London") == State.LEFT
    assert tokyo.force_leave("London", mesh.now) is None  # again: nothing to do
    mesh.start("London", join_through="Sydney")  # back, newer: taken back
    mesh.run_until_true(lambda: tokyo.state_of("London") == State.ALIVE, limit_s=15)
