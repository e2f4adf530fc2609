"""Routes and trees: detours taken and given back, hysteresis, fan-out, agreement."""

from __future__ import annotations

import itertools
from collections.abc import Callable

from ciuic_p2p.config import MeshSection
from ciuic_p2p.core.mesh.messages import Coordinate, LinkEntry, Links
from ciuic_p2p.core.mesh.routing import Router, build_tree, shortest_paths
from ciuic_p2p.core.mesh.rttmap import MAX_VERSION, RttMap
from ciuic_p2p.data import scenario_path
from ciuic_p2p.emulator.meshsim import SimMesh
from ciuic_p2p.emulator.model.scenario import scenario_from_mapping
from ciuic_p2p.emulator.scenarios import load_scenario


def detour_scenario() -> SimMesh:
    """a-c is slow (200 ms) while a-b-c is 80 ms: a triangle-inequality violation.
    At 60 s the a-c link gets fast (10 ms)."""
    link = {"symmetric": True, "jitter_ms": 0.5, "jitter_dist": "normal", "reorder": False}
    scenario = scenario_from_mapping(
        {
            "seed": 3,
            "nodes": [{"name": "a"}, {"name": "b"}, {"name": "c"}],
            "links": [
                {"src": "a", "dst": "b", "delay_ms": 20, **link},
                {"src": "b", "dst": "c", "delay_ms": 20, **link},
                {"src": "a", "dst": "c", "delay_ms": 100, **link},
            ],
            "schedule": [
                {
                    "at_s": 60,
                    "action": "set",
                    "src": "a",
                    "dst": "c",
                    "delay_ms": 5,
                    "symmetric": True,
                }
            ],
        }
    )
    sim = SimMesh(scenario, MeshSection(), seed=1)
    sim.start_all(join_through="a")
    return sim


def test_the_route_table_takes_the_detour_and_returns_to_the_direct_path() -> None:
    sim = detour_scenario()
    a = sim.nodes["a"]
    c = sim.nodes["c"]
    sim.run_until_true(
        lambda: a.routes().get("c") == ("a", "b", "c") and c.routes().get("a") == ("c", "b", "a"),
        30,
    )
    assert sim.now < 60
    sim.run_for(60 - sim.now)
    sim.run_until_true(lambda: a.routes().get("c") == ("a", "c"), 30)
    # The tree from a now reaches c directly as well.
    assert "c" in a.tree("a")["a"]


def test_hysteresis_keeps_a_route_through_small_changes() -> None:
    rtts = {("a", "b"): 0.04, ("b", "c"): 0.04, ("a", "c"): 0.1}

    def rtt(x: str, y: str) -> float:
        return rtts.get((x, y)) or rtts[(y, x)]

    router = Router("a", MeshSection())
    router.update(["a", "b", "c"], rtt)
    assert router.routes["c"] == ("a", "b", "c")
    rtts[("a", "c")] = 0.078  # direct is now 39 ms one way against 42 via b: 7% better
    router.update(["a", "b", "c"], rtt)
    assert router.routes["c"] == ("a", "b", "c")
    rtts[("a", "c")] = 0.06  # 30 ms against 42: well past the 10% hysteresis
    router.update(["a", "b", "c"], rtt)
    assert router.routes["c"] == ("a", "c")  # type: ignore[comparison-overlap]
    router.update(["a", "c"], rtt)  # b left: routes through it go at once
    assert "b" not in router.routes


def matrix_rtt(name: str) -> tuple[list[str], Callable[[str, str], float]]:
    scenario = load_scenario(scenario_path(name))
    return scenario.node_names(), scenario.rtt_s


def test_trees_cover_everyone_respect_fanout_and_beat_the_direct_star() -> None:
    names, rtt = matrix_rtt("multicloud8")
    settings = MeshSection(tree_max_fanout=3)
    for origin in names:
        tree = build_tree(origin, names, rtt, settings)
        reached = {c for kids in tree.values() for c in kids}
        assert reached == set(names) - {origin}
        assert all(len(kids) <= 3 for kids in tree.values())
        # Same inputs, same tree: every node computes the same one.
        assert build_tree(origin, list(reversed(names)), rtt, settings) == tree


def test_shortest_paths_use_relays_on_the_multicloud_matrix() -> None:
    names, rtt = matrix_rtt("multicloud8")
    relayed = 0
    for a, b in itertools.permutations(names, 2):
        cost, path = shortest_paths(a, names, rtt, 0.002)[b]
        assert cost <= rtt(a, b) / 2 + 1e-9
        relayed += len(path) > 2
    assert relayed >= 10  # the matrix's README: 10 of 28 pairs have a >10% detour


def test_a_tree_goes_direct_on_a_near_tie_and_relays_on_a_clear_detour() -> None:
    # The 11-city matrix's Singapore-Sao Paulo pair: direct 163.7 ms one way, through
    # Oregon 169.6 ms. A busy node's measurements land either side of such a tie from
    # run to run; the margin keeps the tree direct unless the relay clearly wins.
    def tree_of(direct_rtt_s: float, settings: MeshSection) -> dict[str, list[str]]:
        rtts = {
            frozenset({"sin", "sao"}): direct_rtt_s,
            frozenset({"sin", "ore"}): 0.1605,
            frozenset({"ore", "sao"}): 0.1747,
        }
        return build_tree(
            "sin", ["sin", "sao", "ore"], lambda a, b: rtts[frozenset({a, b})], settings
        )

    default = MeshSection()
    assert tree_of(0.3274, default)["sin"] == ["ore", "sao"]  # as measured: direct
    assert tree_of(0.3450, default)["sin"] == ["ore", "sao"]  # noise: relay 1.7% sooner
    assert tree_of(0.4000, default)["ore"] == ["sao"]  # a 15% detour: through Oregon
    # Without the margin the noisy measurement flips the tree.
    assert tree_of(0.3450, MeshSection(tree_relay_margin=0.0))["ore"] == ["sao"]


def test_trees_count_each_links_published_rate_for_the_chunk_size() -> None:
    """A large chunk over a slow direct link: with the link's measured rate the tree
    relays through the node with fast links; without rates (the default rate for
    every link) it goes direct, as the RTTs alone say."""
    rtts = {
        frozenset({"o", "a"}): 0.020,
        frozenset({"o", "b"}): 0.030,
        frozenset({"a", "b"}): 0.020,
    }
    rates = {("o", "a"): 100e6, ("o", "b"): 2e6, ("a", "b"): 100e6}

    def rtt(x: str, y: str) -> float | None:
        return rtts[frozenset({x, y})]

    def rate(x: str, y: str) -> float | None:
        return rates.get((x, y)) or rates.get((y, x))

    settings = MeshSection(default_rate_bps=100e6, tree_relay_margin=0.1)
    nodes = ["o", "a", "b"]
    assert build_tree("o", nodes, rtt, settings, chunk_bytes=1_000_000)["o"] == ["a", "b"]
    relayed = build_tree("o", nodes, rtt, settings, chunk_bytes=1_000_000, rate=rate)
    assert relayed["o"] == ["a"] and relayed["a"] == ["b"]
    # A small chunk's serialization is negligible even at 2 Mbit/s: direct again.
    assert build_tree("o", nodes, rtt, settings, chunk_bytes=512, rate=rate)["o"] == ["a", "b"]


def test_a_measured_rate_is_published_with_the_link_and_only_a_real_move_republishes() -> None:
    settings = MeshSection(link_publish_min_s=0.0, link_refresh_s=1e9)
    a, b = RttMap("a", settings), RttMap("b", settings)
    a.observe("b", Coordinate(), 0.050)
    first = a.publish(now=1.0)
    assert first is not None and first.entries[0].rate_kbps == 0  # no rate measured yet
    a.observe_rate("b", 19.4e6)  # b's bulk frames reach a at 19.4 Mbit/s
    rated = a.publish(now=2.0)
    assert rated is not None and rated.entries[0].rate_kbps == 19_400
    assert b.apply_links(rated, now=2.0)
    # b learns the rate of its own uplink to a from a's word, and a holds it too.
    assert b.rate_bps("b", "a") == a.rate_bps("b", "a") == 19.4e6
    # The other way only b's word would count (a sender's claim about its own uplink
    # is never taken), and b measured nothing.
    assert b.rate_bps("a", "b") is None
    a.observe_rate("b", 21e6)  # +8%: noise, not republished
    assert a.publish(now=3.0) is None
    a.observe_rate("b", 30e6)  # +55%: a real change
    moved = a.publish(now=4.0)
    assert moved is not None and moved.entries[0].rate_kbps == 30_000
    for bogus in (0.0, -5.0, float("inf"), 2e12):  # what a broken estimate could say
        a.observe_rate("b", bogus)
    assert a.rates["b"] == 30e6


def test_a_members_link_state_is_taken_at_most_once_per_publish_interval() -> None:
    """Review: a member could republish its links at will, and every version taken
    changed the map every route and tree is computed from, so every node replanned for
    every chunk it forwarded. Now a node takes one version of a member's links per
    link_publish_min_s (no honest node publishes more often); a sooner one is held,
    the newest replacing an older held one, and taken when its time comes."""
    settings = MeshSection(link_publish_min_s=0.5)
    a = RttMap("a", settings)

    def version(v: int) -> Links:
        return Links("m", v, (LinkEntry("a", 40_000 + v),))

    assert a.apply_links(version(1), now=10.0) and a.versions["m"] == 1
    changes = a.changes
    for i in range(200):  # a flood: a new version every millisecond
        assert a.apply_links(version(2 + i), now=10.001 + i * 0.001)
        a.release(now=10.001 + i * 0.001)
    assert a.versions["m"] == 1 and a.changes == changes  # none taken yet...
    assert a.links_held == 200 and a.held["m"].version == 201  # ...the newest held
    assert not a.apply_links(version(150), now=10.3)  # older than the held one
    assert a.get_timer() == 10.5
    a.release(now=10.499)
    assert a.versions["m"] == 1
    a.release(now=10.5)
    assert a.versions["m"] == 201 and a.changes == changes + 1 and not a.held
    assert a.measured_s("m", "a") == 0.040201
    assert a.get_timer() is None
    # An honest node's versions, half a second apart or more, are taken on arrival.
    assert a.apply_links(version(202), now=11.0) and a.versions["m"] == 202
    # A departed member's held version goes with it; its time does not: come back at
    # once, and its links still wait their turn.
    a.apply_links(version(203), now=11.1)
    a.forget("m")
    assert not a.held and a.get_timer() is None and "m" not in a.published
    assert a.apply_links(version(204), now=11.2) and a.held["m"].version == 204
    a.release(now=11.5)
    assert a.versions["m"] == 204


def test_two_link_states_signed_under_one_version_end_as_one_everywhere() -> None:
    """Review: a member could sign two different link states under one version and
    send one to each node. Versions alone decided, and digests covered only versions,
    so the nodes kept different maps (and different trees) and never synced them. Now
    the greater signature wins a tie, and the digest covers the signatures."""
    settings = MeshSection(link_publish_min_s=0.0)
    x, y = RttMap("x", settings), RttMap("y", settings)
    near = Links("m", 7, (LinkEntry("x", 1_000),), b"\x01" * 64)
    far = Links("m", 7, (LinkEntry("x", 300_000),), b"\x02" * 64)
    assert x.apply_links(near, now=1.0) and y.apply_links(far, now=1.0)
    assert x.digest() != y.digest()  # their probes' digests differ: they sync...
    assert x.apply_links(far, now=2.0) and not y.apply_links(near, now=2.0)
    assert x.digest() == y.digest() and x.measured_s("m", "x") == y.measured_s("m", "x") == 0.3
    assert not x.apply_links(far, now=3.0)  # the same again changes nothing


def test_a_restarted_node_publishes_above_its_previous_lifes_link_state() -> None:
    """Review: a node's link-state version starts at 0 again when its daemon restarts,
    and the others keep the newest they hold: its previous life's. Its new links were
    refused until its count passed the old one (at a republish every 30 s, a day for a
    node that ran a day), and every node whose digest differed from its own pushed it
    the whole link state every second meanwhile. Now a node that hears its own links
    at a version it has not reached publishes above it at once."""
    settings = MeshSection(link_publish_min_s=0.5, link_refresh_s=30.0)
    before, other = RttMap("a", settings), RttMap("b", settings)
    before.observe("b", Coordinate(), 0.050)
    old = None
    for t in range(500):  # the previous life: 500 versions, one per refresh
        old = before.publish(now=t * 30.0) or old
    assert old is not None and old.version == 500 and other.apply_links(old, now=500.0)
    after = RttMap("a", settings)  # restarted
    after.observe("b", Coordinate(), 0.030)
    first = after.publish(now=1000.0)
    assert first is not None and first.version == 1
    assert not other.apply_links(first, now=1000.0)  # older than what b holds
    assert not after.apply_links(old, now=1000.1)  # its own, as b's sync brings it back
    assert after.publish(now=1000.2) is None  # the publish interval still holds...
    again = after.publish(now=1000.5)  # ...then above the old life, without a change
    assert again is not None and again.version == 501
    assert other.apply_links(again, now=1000.6) and other.measured_s("a", "b") == 0.030
    assert not after.apply_links(again, now=1001.0)  # its current one: nothing to do
    assert after.publish(now=1002.0) is None
    # At the end of the wire's u32 the last version stands: none is signed above it.
    top = Links("a", MAX_VERSION - 1, (LinkEntry("b", 30_000),))
    assert not after.apply_links(top, now=1003.0)
    last = after.publish(now=1003.5)
    assert last is not None and last.version == MAX_VERSION
    assert after.publish(now=2000.0) is None  # a refresh would be due: nothing fits


def test_a_members_rate_claims_cannot_make_it_everyones_relay() -> None:
    """Review: a member publishing 1 Tbit/s for its links became a relay for half the
    nodes in every origin's tree (the rate from it was taken from its own word when
    no receiver had measured it). Now only a receiver's measurement counts for a
    link, and no rate counts above default_rate_bps."""
    honest = [f"h{i}" for i in range(8)]
    nodes = ["o", "m", *honest]
    settings = MeshSection(default_rate_bps=100e6, tree_max_fanout=4)
    maps = {n: RttMap(n, settings) for n in nodes}
    published = {}
    for n in nodes:
        for p in nodes:
            if p != n:
                maps[n].observe(p, Coordinate(), 0.040)
                if n == "m":
                    maps[n].observe_rate(p, 1e12 - 1)  # the lie: every link 1 Tbit/s
                elif p != "m":  # m forwarded nothing large: no one measured it
                    maps[n].observe_rate(p, 100e6)
    for n in nodes:
        links = maps[n].publish(now=1.0)
        assert links is not None
        published[n] = links
    view = maps["o"]
    for n in nodes:
        view.apply_links(published[n], now=1.0)
    for size in (4096, 1_000_000):
        tree = build_tree("o", nodes, view.rtt_s, settings, chunk_bytes=size, rate=view.rate_bps)
        fair = build_tree("o", nodes, view.rtt_s, settings, chunk_bytes=size)
        assert tree == fair and tree.get("m", []) == []
