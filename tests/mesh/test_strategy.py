"""The three sync strategies as pure planners (core.mesh.planners), the cost model
(core.mesh.roundcost) and the choice (core.mesh.strategy): each plan reaches every node
once per origin, the model plays a round out as the emulator would carry it, and the
choice is the least predicted time, kept against noise."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import random

import pytest

from ciuic_p2p.config import Config, MeshSection
from ciuic_p2p.core.mesh.linkcosts import STRATEGIES, LinkCosts, Plan
from ciuic_p2p.core.mesh.messages import MAX_ROUTE
from ciuic_p2p.core.mesh.planners import (
    cluster_leaders,
    clusters,
    plan,
    ring_order,
    ring_tree,
    tree_for,
)
from ciuic_p2p.core.mesh.roundcost import predict_round_s, slow_start_s
from ciuic_p2p.core.mesh.strategy import Chooser, Plans, same_plan
from ciuic_p2p.data import scenario_path
from ciuic_p2p.emulator.meshsim import SimMesh
from ciuic_p2p.emulator.model.scenario import EmulatedNetwork, scenario_from_mapping
from ciuic_p2p.emulator.scenarios import load_scenario

MESH = Config.wan().mesh


def _uniform(
    n: int, delay_s: float = 0.05, rate_bps: float = 8e6, uplink_bps: float = math.inf
) -> LinkCosts:
    nodes = tuple(f"n{i}" for i in range(n))
    pairs = [(u, v) for u in nodes for v in nodes if u != v]
    return LinkCosts.from_tables(
        nodes,
        dict.fromkeys(pairs, delay_s),
        dict.fromkeys(pairs, rate_bps),
        default_rate_bps=1e12,
        uplink_bps=uplink_bps,
        relay_s=0.0,
    )


def _two_regions(uplink_bps: float = math.inf) -> LinkCosts:
    """Four nodes in each of two regions: 1 ms and 100 Mbit/s inside, 40 ms and
    4 Mbit/s between."""
    nodes = tuple([f"a{i}" for i in range(4)] + [f"b{i}" for i in range(4)])
    delay, rate = {}, {}
    for u, v in itertools.permutations(nodes, 2):
        same = u[0] == v[0]
        delay[(u, v)] = 0.001 if same else 0.04
        rate[(u, v)] = 1e8 if same else 4e6
    return LinkCosts.from_tables(nodes, delay, rate, 1e12, uplink_bps, 0.0)


def _reaches_everyone_once(p: Plan, nodes: tuple[str, ...]) -> None:
    for origin, tree in p.trees.items():
        reached = [c for kids in tree.values() for c in kids]
        assert sorted(reached) == sorted(n for n in nodes if n != origin), (p.strategy, origin)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("costs", [_uniform(2), _uniform(7), _two_regions()])
def test_every_plan_reaches_every_node_once_from_every_origin(
    strategy: str, costs: LinkCosts
) -> None:
    p = plan(strategy, costs, 4096, MESH)  # type: ignore[arg-type]
    assert set(p.trees) == set(costs.nodes)
    _reaches_everyone_once(p, costs.nodes)


def test_the_ring_follows_the_cheap_links_and_each_origin_goes_once_around() -> None:
    """Two regions: the best ring crosses between them only twice."""
    order = ring_order(_two_regions(), 65536)
    crossings = sum(order[i][0] != order[(i + 1) % len(order)][0] for i in range(len(order)))
    assert crossings == 2 and order[0] == "a0"
    tree = ring_tree("b1", order)
    hops, node = [], "b1"
    while tree[node]:
        (node,) = tree[node]
        hops.append(node)
    assert len(hops) == len(order) - 1 and "b1" not in hops


def test_the_ring_avoids_one_very_slow_link_that_would_hold_every_round() -> None:
    """Five nodes; the ring a-b-c-d-e has the least total (four 10 Mbit/s hops and
    one of 2), every ring around the 2 Mbit/s hop crosses two or more of 3 Mbit/s.
    Each link of a ring carries four payloads: the slow hop holds the round."""
    nodes = ("a", "b", "c", "d", "e")
    fast = {frozenset(p) for p in ("ab", "bc", "cd", "de", "ea")}
    delay, rate = {}, {}
    for u, v in itertools.permutations(nodes, 2):
        delay[(u, v)] = 0.01
        pair = frozenset((u, v))
        rate[(u, v)] = (2e6 if pair == frozenset("ab") else 10e6) if pair in fast else 3e6
    costs = LinkCosts.from_tables(nodes, delay, rate, 1e12, 0.0, 0.0)
    order = ring_order(costs, 1 << 20)
    hops = {frozenset((order[i], order[(i + 1) % 5])) for i in range(5)}
    assert frozenset("ab") not in hops
    # The cost model agrees: the ring chosen is the faster for a 2.1 MB round.
    least_total = ("a", "b", "c", "d", "e")
    times = [
        predict_round_s(
            Plan("ring", {o: ring_tree(o, ring) for o in nodes}), costs, 2_100_000, 1 << 20
        )
        for ring in (order, least_total)
    ]
    assert times[0] < 0.8 * times[1]


def test_clusters_are_joined_by_short_links_and_leaders_relay_between_them() -> None:
    costs = _two_regions()
    groups = clusters(costs, 0.02)
    assert groups == (("a0", "a1", "a2", "a3"), ("b0", "b1", "b2", "b3"))
    p = plan("hierarchical", costs, 65536, MESH)
    crossing = [(u, v) for u, kids in p.trees["a2"].items() for v in kids if u[0] != v[0]]
    assert len(crossing) == 1  # a2's payload crosses once, leader to leader
    assert clusters(costs, 0.0) == tuple((n,) for n in costs.nodes)


def test_the_model_gives_the_closed_forms_of_simple_rounds() -> None:
    """Uniform links, no uplink limit, no slow start: a star (the tree with a fan-out
    past N) delivers in one hop's time; the ring in N - 1 hops' (each link carries
    N - 1 payloads, one after the other, and the last starts N - 2 payloads late)."""
    n, size, delay, rate = 5, 100_000, 0.05, 8e6
    costs = dataclasses.replace(_uniform(n, delay, rate), initial_window_bytes=1 << 40)
    star = dataclasses.replace(MESH, tree_max_fanout=n)
    hop = delay + size * 8 / rate
    got = predict_round_s(plan("tree", costs, size, star), costs, size, size)
    assert got == pytest.approx(hop)
    got = predict_round_s(plan("ring", costs, size, star), costs, size, size)
    assert got == pytest.approx((n - 1) * hop)
    # In ten pieces the ring pipelines: each link still carries N - 1 payloads' bytes
    # back to back, but the delays overlap.
    piece = size // 10
    got = predict_round_s(plan("ring", costs, piece, star), costs, size, piece)
    assert (n - 1) * size * 8 / rate <= got < (n - 1) * hop


def test_a_shared_uplink_makes_the_ring_the_fastest_for_large_rounds() -> None:
    """With every node's uplink the limit, a star sends N - 1 copies of each payload
    through it, and so does the ring, but spread over the round: equal bytes; with
    relays counted, the tree never beats the ring by much, and for a large payload in
    pieces the ring wins."""
    costs = _uniform(8, 0.02, 8e7, uplink_bps=8e6)
    size = 1_000_000
    times = {
        s: predict_round_s(plan(s, costs, 65536, MESH), costs, size, 65536) for s in STRATEGIES
    }
    assert min(times, key=times.__getitem__) == "ring"
    # The bound: every node must send (N - 1) payloads' bytes through its uplink.
    assert times["ring"] >= 7 * size * 8 / 8e6


def test_the_model_matches_the_emulators_links() -> None:
    """The model's arithmetic is the emulator's: a payload's pieces sent back to back
    on one link arrive when the link's FIFO and delay say."""
    scenario = scenario_from_mapping(
        {
            "defaults": {"delay_ms": 30.0, "rate_mbps": 8.0, "queue_bytes": 10_000_000},
            "nodes": [{"name": "a"}, {"name": "b"}],
        }
    )
    net = EmulatedNetwork(scenario)
    arrivals = [net.transmit("a", "b", 0.0, 1000)[0] for _ in range(100)]
    both = [("a", "b"), ("b", "a")]
    costs = LinkCosts.from_tables(
        ("a", "b"), dict.fromkeys(both, 0.03), dict.fromkeys(both, 8e6), 1e12, 0.0, 0.0
    )
    p = Plan("tree", {"a": {"a": ["b"], "b": []}, "b": {"b": ["a"], "a": []}})
    assert predict_round_s(p, costs, 100_000, 1000) == pytest.approx(max(arrivals), rel=1e-6)


def test_a_plan_that_misses_a_node_or_a_link_never_wins() -> None:
    costs = _uniform(3)
    broken = Plan("tree", {o: {o: []} for o in costs.nodes})
    assert predict_round_s(broken, costs, 1000, 1000) == float("inf")
    holes = dataclasses.replace(
        costs, delay_of=lambda u, v: 0.01 if (u, v) == ("n0", "n1") else None
    )
    assert predict_round_s(plan("ring", costs, 1000, MESH), holes, 1000, 1000) == float("inf")


def test_the_choice_is_the_fastest_and_moves_only_past_the_hysteresis() -> None:
    mesh = dataclasses.replace(MESH, strategy_hysteresis=0.2)
    chooser = Chooser(mesh, piece_bytes=65536)
    small = chooser.decide(_two_regions(uplink_bps=8e6), 4096)
    assert small.strategy == min(small.predicted_s, key=small.predicted_s.__getitem__)
    big = chooser.decide(_two_regions(uplink_bps=8e6), 4_000_000)
    fastest = min(big.predicted_s, key=big.predicted_s.__getitem__)
    held = big.predicted_s[small.strategy] <= big.predicted_s[fastest] / 0.8
    assert big.strategy == (small.strategy if held else fastest)
    # The same state gives the same choice on every node: deterministic.
    again = Chooser(mesh, piece_bytes=65536)
    again.decide(_two_regions(uplink_bps=8e6), 4096)
    assert again.decide(_two_regions(uplink_bps=8e6), 4_000_000) == big


def test_a_near_tie_does_not_switch_the_strategy() -> None:
    chooser = Chooser(MESH, piece_bytes=65536)
    first = chooser.decide(_uniform(4), 50_000, allowed=("tree", "hierarchical"))
    for _ in range(5):
        assert (
            chooser.decide(_uniform(4), 50_000, allowed=("tree", "hierarchical")).strategy
            == first.strategy
        )
    assert chooser.switches == 0


def _star(measured_leaf_links: bool) -> LinkCosts:
    """A hub and five leaves (bench/strategy.py's star at rate scale 0.01): 10 ms and
    25 Mbit/s hub to leaf, 150 ms and 2.5 Mbit/s leaf to leaf, behind 10 Mbit/s
    uplinks that unmeasured links are taken at. The leaf-to-leaf links are measured
    or not (no tree uses them, so only the rate probes measure them)."""
    nodes = ("hub", *(f"leaf{i}" for i in range(5)))
    delay, rate = {}, {}
    for u, v in itertools.permutations(nodes, 2):
        hub = "hub" in (u, v)
        delay[(u, v)] = 0.005 if hub else 0.075
        if hub:
            rate[(u, v)] = 25e6
        elif measured_leaf_links:
            rate[(u, v)] = 2.5e6
    return LinkCosts.from_tables(nodes, delay, rate, 10e6, 10e6, 0.002)


def test_a_large_round_never_switches_to_a_strategy_on_unmeasured_links() -> None:
    """The star's leaf-to-leaf links, taken at the 10 Mbit/s default, made the ring
    look fastest for a 2.1 MB round; the ring round on the real 2.5 Mbit/s links took
    53 s against the tree's 29 s (bench/strategy.py, auto's first round). A large
    round stays on the strategy in force until another's links are all measured;
    with them measured the choice is the model's; small rounds are not held back."""
    size = 2_100_000
    guessed = Chooser(MESH, piece_bytes=1 << 20).decide(_star(False), size)
    # What went wrong: the ring looked faster than the trees (planned alone then).
    alone = {o: tree_for(o, _star(False), 1 << 20, MESH) for o in _star(False).nodes}
    alone_s = predict_round_s(Plan("tree", alone), _star(False), size, 1 << 20)
    assert guessed.predicted_s["ring"] < alone_s
    assert guessed.strategy == "tree" and "ring" in guessed.unmeasured
    measured = Chooser(MESH, piece_bytes=1 << 20).decide(_star(True), size)
    assert not measured.unmeasured
    assert measured.strategy == min(measured.predicted_s, key=measured.predicted_s.__getitem__)
    assert measured.strategy != "ring"
    small = Chooser(MESH, piece_bytes=1 << 20).decide(_star(False), 2_400)
    assert not small.unmeasured
    # A strategy chosen for a small round is not carried into a large one on
    # unmeasured links.
    chooser = Chooser(MESH, piece_bytes=1 << 20)
    chooser.current = dataclasses.replace(small, strategy="ring")
    assert chooser.decide(_star(False), size).strategy == "tree"


def test_config_rules_for_the_strategy() -> None:
    from ciuic_p2p.config import config_from_mapping  # noqa: PLC0415
    from ciuic_p2p.errors import ConfigError  # noqa: PLC0415

    assert config_from_mapping({"mesh": {"strategy": "ring"}}).mesh.strategy == "ring"
    for bad in ({"strategy": "star"}, {"strategy_hysteresis": 1.0}, {"node_uplink_bps": -1}):
        with pytest.raises(ConfigError):
            config_from_mapping({"mesh": bad})
    assert isinstance(MESH, MeshSection)


@pytest.mark.parametrize("strategy", ["tree", "ring", "hierarchical", "auto"])
def test_rounds_reach_every_node_exactly_once_by_the_origins_strategy(strategy: str) -> None:
    """Six nodes of the 11-city WAN on virtual time, 1% loss: every origin's round
    pieces go by its strategy (named in each chunk, followed by every relay) and reach
    every node once; the ring relays each piece N - 2 times."""
    names = ["Tokyo", "Singapore", "Frankfurt", "London", "Virginia", "Oregon"]
    scenario = load_scenario(scenario_path("cities11")).subset(names)
    scenario = dataclasses.replace(
        scenario,
        links={k: dataclasses.replace(v, loss=0.01) for k, v in scenario.links.items()},
    )
    mesh = dataclasses.replace(MESH, strategy=strategy)  # type: ignore[arg-type]
    sim = SimMesh(scenario, mesh, seed=3)
    sim.start_all(join_through="Tokyo")
    sim.run_until_true(sim.agree, limit_s=10)
    sim.run_for(15)
    sent = []
    for r in range(3):
        for origin in names:
            for piece in range(2):
                seq = sim.broadcast(
                    origin, bytes([r, piece]) * 3000, round_id=r, round_bytes=12_000
                )
                sent.append((origin, seq))
        sim.run_for(2.0)
    sim.run_for(10)
    for name in names:
        got = collections.Counter((d.origin, d.seq) for d in sim.take_deliveries(name))
        assert set(got) == {s for s in sent if s[0] != name}, name
        assert max(got.values()) == 1
    for name in names:
        status = sim.nodes[name].strategy()
        assert status["configured"] == strategy
        assert status["strategy"] in STRATEGIES
        if strategy != "auto":
            assert status["strategy"] == strategy
        else:
            assert set(status["predicted_s"]) == set(STRATEGIES)  # type: ignore[call-overload]


def test_a_ring_round_is_relayed_around_the_ring() -> None:
    names = ["Tokyo", "Singapore", "Frankfurt", "London", "Virginia"]
    scenario = load_scenario(scenario_path("cities11")).subset(names)
    sim = SimMesh(scenario, dataclasses.replace(MESH, strategy="ring"), seed=5)
    sim.start_all(join_through="Tokyo")
    sim.run_until_true(sim.agree, limit_s=10)
    sim.run_for(15)
    seq = sim.broadcast("London", b"r" * 5000, round_id=1, round_bytes=5000)
    sim.run_for(5)
    hops = {}
    for name in names:
        for d in sim.take_deliveries(name):
            if d.seq == seq:
                hops[name] = d.hops
    assert sorted(hops.values()) == list(range(len(names) - 1))  # one after another


def test_the_model_matches_the_emulators_uplink_in_front_of_slower_links() -> None:
    """An 8 Mbit/s uplink in front of two 4 Mbit/s links: the uplink passes the copy to
    b, then the one to c, each at its own rate; each link paces its copy at its rate.
    The model gives the emulator's last arrival, copies sent one after the other."""
    link = {"delay_ms": 10.0, "rate_mbps": 4.0, "queue_bytes": 10_000_000}
    scenario = scenario_from_mapping(
        {
            "defaults": link,
            "nodes": [{"name": "a", "uplink_gbps": 0.008}, {"name": "b"}, {"name": "c"}],
        }
    )
    net = EmulatedNetwork(scenario)
    arrivals = [net.transmit("a", dst, 0.0, 1000)[0] for dst in ("b", "c") for _ in range(100)]
    pairs = [(u, v) for u in "abc" for v in "abc" if u != v]
    costs = LinkCosts.from_tables(
        ("a", "b", "c"), dict.fromkeys(pairs, 0.01), dict.fromkeys(pairs, 4e6), 1e12, 8e6, 0.0
    )
    # Every node does what a does, each over its own uplink: the round ends when a's does.
    p = Plan("tree", {o: {o: [n for n in "abc" if n != o]} for o in "abc"})
    got = predict_round_s(p, costs, 100_000, 100_000)
    assert got == pytest.approx(max(arrivals), rel=0.02)


def test_an_idle_links_first_piece_pays_slow_start_and_the_next_does_not() -> None:
    """QUIC starts an idle link's window at ten datagrams and doubles it each RTT: a
    piece as large as the path's bandwidth-delay product takes log2(BDP / window + 1)
    RTTs instead of one; the piece behind it on the same link goes at the rate."""
    delay, rate = 0.05, 8e6
    bdp = int(rate * 2 * delay / 8)  # 100 kB
    costs = _uniform(2, delay, rate)
    window = costs.initial_window_bytes
    ramp = slow_start_s(bdp, rate, 2 * delay, window)
    assert ramp == pytest.approx(2 * delay * math.log2(bdp / window + 1) - bdp * 8 / rate)
    star = dataclasses.replace(MESH, tree_max_fanout=2)
    one = predict_round_s(plan("tree", costs, bdp, star), costs, bdp, bdp)
    assert one == pytest.approx(delay + bdp * 8 / rate + ramp)
    two = predict_round_s(plan("tree", costs, bdp, star), costs, 2 * bdp, bdp)
    assert two == pytest.approx(delay + 2 * bdp * 8 / rate + ramp)
    assert slow_start_s(window, rate, 2 * delay, window) == 0.0


def test_every_route_code_a_chunk_may_name_is_a_strategy() -> None:
    assert len(STRATEGIES) - 1 == MAX_ROUTE


def test_an_origin_outside_the_view_gets_a_tree_and_leaves_the_views_plans_alone() -> None:
    """A chunk of a member that just left (or just joined) is forwarded down a tree of
    its own; the ring and clusters of the view are not replanned around it."""
    costs = _two_regions()
    plans = Plans(dataclasses.replace(MESH, strategy="ring"), piece_bytes=1 << 20)
    plans.update(1, costs)
    before = {o: plans.tree(s, o, 5000) for o in costs.nodes for s in STRATEGIES}
    for route in range(len(STRATEGIES)):
        kids = plans.children(route, "outsider", "outsider", 5000)
        assert kids and "outsider" not in kids
    assert {o: plans.tree(s, o, 5000) for o in costs.nodes for s in STRATEGIES} == before
    _reaches_everyone_once(plan("ring", costs, 4096, MESH), costs.nodes)


def test_auto_plays_rounds_out_again_only_for_a_new_state_or_size() -> None:
    """Each round's first chunk asks for the strategy; the rounds are played out once
    per published state and size (within a factor of two), not per round."""
    plans = Plans(dataclasses.replace(MESH, strategy="auto"), piece_bytes=1 << 20)
    plans.update(1, _two_regions(uplink_bps=8e6))
    plans.route_for(1, 4096)
    first = plans.chooser.current
    plans.route_for(2, 5000)
    assert plans.chooser.current is first
    plans.route_for(3, 4_000_000)  # another size: played out for it
    assert plans.chooser.current is not first and plans.chooser.current is not None
    assert plans.chooser.current.payload_bytes == 4_000_000
    again = plans.chooser.current
    plans.update(2, _two_regions(uplink_bps=8e6))  # a new published state
    plans.route_for(4, 4_000_000)
    assert plans.chooser.current is not again


def test_a_leader_spreads_inside_its_cluster_by_a_fan_out_limited_tree() -> None:
    """A big cluster is not one leader's N - 1 copies of every chunk."""
    nodes = tuple([f"a{i:02d}" for i in range(12)] + ["far"])
    pairs = [(u, v) for u in nodes for v in nodes if u != v]
    delay = {(u, v): 0.001 if "far" not in (u, v) else 0.05 for u, v in pairs}
    costs = LinkCosts.from_tables(nodes, delay, dict.fromkeys(pairs, 8e6), 1e12, 8e6, 0.0)
    p = plan("hierarchical", costs, 65536, MESH)
    _reaches_everyone_once(p, nodes)
    # A leader's children: its cluster's tree and the leaders' tree, each limited.
    assert max(len(k) for t in p.trees.values() for k in t.values()) <= 2 * MESH.tree_max_fanout


def test_a_member_claiming_short_links_joins_no_cluster_and_leads_none() -> None:
    """Clusters and leaders go by the RTT both ends published: a member that says its
    links are 0.1 ms, where its peers measured 80 ms, stays alone."""
    costs = _two_regions()
    liar = "x"
    nodes = (*costs.nodes, liar)
    published = {
        (u, v): (costs.delay(u, v) or 0.0) * 2 for u in costs.nodes for v in costs.nodes if u != v
    }
    for n in costs.nodes:
        published[(liar, n)] = 0.0001  # its own claim
        published[(n, liar)] = 0.08  # what its peers measured

    def both(u: str, v: str) -> float | None:
        a, b = published.get((u, v)), published.get((v, u))
        return None if a is None or b is None else max(a, b)

    honest = dataclasses.replace(costs, nodes=tuple(sorted(nodes)), rtt_both_of=both)
    groups = clusters(honest, 0.02)
    assert (liar,) in groups and len(groups) == 3
    leaders = cluster_leaders(groups, honest, 65536)
    assert [leader for g, leader in leaders.items() if g != (liar,)] != [liar]
    assert liar not in {leader for g, leader in leaders.items() if len(g) > 1}


def test_strategies_that_send_by_the_same_trees_are_told_apart_from_those_that_do_not() -> None:
    """Where every cluster is one node (no link under ``cluster_rtt_s``),
    ``hierarchical`` sends by the tree's own trees: one plan under two names, which
    the benchmark measures as one; the ring's differ. Children count in any order."""
    plans = Plans(MESH, piece_bytes=1 << 20)
    assert plans.same_plan(4096) == tuple((s,) for s in STRATEGIES)  # no state yet
    plans.update(1, _uniform(7, delay_s=0.05))
    groups = plans.same_plan(4096)
    assert ("tree", "hierarchical") in groups and ("ring",) in groups
    a = {"o": {"o": ["x", "y"], "x": [], "y": []}}
    b = {"o": {"o": ["y", "x"]}}
    c = {"o": {"o": ["x"], "x": ["y"]}}
    assert same_plan({"tree": a, "ring": b, "hierarchical": c}) == (
        ("tree", "ring"),
        ("hierarchical",),
    )


def _copies_sent(trees: dict[str, dict[str, list[str]]]) -> dict[str, int]:
    sent: collections.Counter[str] = collections.Counter()
    for tree in trees.values():
        for u, kids in tree.items():
            sent[u] += len(kids)
    return dict(sent)


def test_a_rounds_large_trees_are_planned_together_so_no_node_relays_for_all() -> None:
    """Every origin sends at once, so a node's uplink carries its copies in every
    origin's tree. Planned alone, each leaf's tree goes through the hub, which then
    sends most of the round's 30 copies through one 10 Mbit/s uplink; planned
    together (large pieces, known uplinks), each node sends about as many copies as
    it receives, and the model's round takes about half as long."""
    piece, payload = 1 << 20, 2_100_000
    costs = _star(True)
    alone = {o: tree_for(o, costs, piece, MESH) for o in costs.nodes}
    together = plan("tree", costs, piece, MESH)
    _reaches_everyone_once(together, costs.nodes)
    assert _copies_sent(alone)["hub"] >= 15
    assert max(_copies_sent(dict(together.trees)).values()) <= len(costs.nodes)
    before = predict_round_s(Plan("tree", alone), costs, payload, piece)
    after = predict_round_s(together, costs, payload, piece)
    assert after < 0.6 * before
    # What a node forwards by is what the chooser played out; small pieces, and
    # links whose shared uplink is not known, keep the trees planned alone.
    plans = Plans(MESH, piece_bytes=piece)
    plans.update(1, costs)
    assert {o: plans.tree("tree", o, payload) for o in costs.nodes} == together.trees
    for small, c in ((4096, costs), (piece, dataclasses.replace(costs, uplink_bps=0.0))):
        assert plan("tree", c, small, MESH).trees == {
            o: tree_for(o, c, small, MESH) for o in c.nodes
        }


def _random_mesh(n: int, seed: int, uplink_bps: float) -> LinkCosts:
    """Nodes on a unit square: delay grows with distance, rates 2-50 Mbit/s."""
    rng = random.Random(seed)
    nodes = tuple(f"n{i:02d}" for i in range(n))
    at = {v: (rng.random(), rng.random()) for v in nodes}
    delay, rate = {}, {}
    for u, v in itertools.permutations(nodes, 2):
        delay[(u, v)] = 0.005 + 0.15 * math.dist(at[u], at[v])
        rate[(u, v)] = rng.uniform(2e6, 50e6)
    return LinkCosts.from_tables(nodes, delay, rate, 1e9, uplink_bps, 0.002)


def test_trees_planned_together_never_make_the_models_round_longer() -> None:
    """One pass of planning together can move relaying onto slow links (every origin
    answers the same loads at once); where the model plays the round out slower
    that way, the trees planned alone stay."""
    piece = 1 << 20
    for seed in range(40):
        costs = _random_mesh(3 + seed % 8, seed, (5e6, 20e6, 100e6)[seed % 3])
        alone = Plan("tree", {o: tree_for(o, costs, piece, MESH) for o in costs.nodes})
        chosen = plan("tree", costs, piece, MESH)
        _reaches_everyone_once(chosen, costs.nodes)
        assert predict_round_s(chosen, costs, 2 * piece, piece) <= predict_round_s(
            alone, costs, 2 * piece, piece
        ), seed


def test_a_node_that_does_not_see_the_origin_yet_plans_its_tree_as_those_that_do() -> None:
    """A joiner's first chunks reach nodes whose view lacks it: planned together, its
    tree depends on every other origin's, so such a node plans the round its view
    would with the joiner in it, and forwards as the nodes that see the joiner do."""
    piece = 1 << 20
    costs = _random_mesh(8, 3, 20e6)
    joiner = costs.nodes[3]
    seen = Plans(MESH, piece_bytes=piece)
    seen.update(1, costs)
    unseen = Plans(MESH, piece_bytes=piece)
    unseen.update(1, dataclasses.replace(costs, nodes=tuple(n for n in costs.nodes if n != joiner)))
    assert unseen.tree("tree", joiner, 2_100_000) == seen.tree("tree", joiner, 2_100_000)
    # The view's own trees are not replanned around the joiner.
    before = unseen.tree("tree", costs.nodes[0], 2_100_000)
    assert joiner not in {k for kids in before.values() for k in kids}
