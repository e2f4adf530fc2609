"""The three strategies' planners: for every origin, the tree its payload travels down.

In a round every replica sends its payload (an outer-step pseudo-gradient, an update)
to every other: an all-gather. Each strategy is a pure planner that gives, for every
origin, the tree its payload travels down (children per node), from the published
link state (one-way delays, link rates) and the payload's size:

- ``tree``: the latency-optimal, fan-out-limited tree of core.mesh.routing, shaped for
  the payload's piece size (a large piece counts its serialization at each hop). A
  round's large pieces through uplinks of a known rate get trees planned together
  (:func:`tree_plan`): every origin sends at once, so a node's uplink carries its
  copies in every origin's tree, and a tree planned alone piles the relaying on the
  nodes nearest the rest.
- ``ring``: the nodes in one ring, ordered by measured cost as PCCL orders its ring
  (nearest neighbour from every start, then 2-opt, on delay plus serialization); each
  origin's payload goes once around it. Every node forwards N - 2 payloads to one
  neighbour, every link carries at most N - 1: the bandwidth-optimal all-gather when
  a node's uplink, not the path, limits.
- ``hierarchical``: clusters of nearby nodes (single linkage: RTTs under
  ``cluster_rtt_s``), a leader per cluster (the member nearest the other clusters);
  an origin sends to its own cluster and to its leader, the leader to the other
  leaders (a tree among them), each leader to its cluster. A payload crosses each
  slow inter-cluster path once per cluster instead of once per node.

The ring all-gathers the compressed payloads; it does not sum them on the way
(reduce-scatter). A relay that summed would have to decode, add and re-encode other
replicas' contributions: the union of sparse index sets grows at each hop, the values
are quantized again (error compounds), and the sum no longer carries any origin's
signature, so any member on the ring could change every other member's contribution.
Forwarding each signed payload untouched keeps a member's power to its own.

Pure: no clock, no I/O; the same published state gives the same trees.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence

from ciuic_p2p.config.sections import MeshSection
from ciuic_p2p.core.mesh.linkcosts import LinkCosts, Plan, Strategy, Tree
from ciuic_p2p.core.mesh.roundcost import predict_round_s
from ciuic_p2p.core.mesh.routing import build_tree

LARGE_PIECE_BYTES = 64 * 1024
"""A payload of more than this is a large piece: its trees are shaped for
``strategy_piece_bytes``, where its serialization counts; below, for
``tree_chunk_bytes``, where the delays do."""


TOGETHER_MAX_NODES = 12
"""A round's large trees are planned together (:func:`tree_plan`) in meshes up to this
size. Planning every origin's tree three times (alone, then twice with no fan-out
limit) and two rounds out costs 8 ms per published state at 12 nodes (one tree
alone: 0.2 ms), 22 ms at 16 and 0.27 s at 32, and published states change tens of
times in a large round (a member may republish at will): past it each tree is planned
alone, as it is needed."""


def plan(strategy: Strategy, costs: LinkCosts, piece_bytes: int, settings: MeshSection) -> Plan:
    """Every origin's tree under ``strategy``."""
    if strategy == "tree":
        return Plan("tree", tree_plan(costs, piece_bytes, settings))
    if strategy == "ring":
        order = ring_order(costs, piece_bytes)
        return Plan("ring", {o: ring_tree(o, order) for o in costs.nodes})
    groups = clusters(costs, settings.cluster_rtt_s)
    leaders = cluster_leaders(groups, costs, piece_bytes)
    return Plan(
        "hierarchical",
        {
            o: hierarchical_tree(o, groups, leaders, costs, piece_bytes, settings)
            for o in costs.nodes
        },
    )


def plans_trees_together(costs: LinkCosts, piece_bytes: int) -> bool:
    """Whether :func:`tree_plan` plans a round's trees together: large pieces, through
    uplinks whose rate the nodes know, in a mesh of at most ``TOGETHER_MAX_NODES``."""
    return (
        piece_bytes > LARGE_PIECE_BYTES
        and 0 < costs.uplink_bps < math.inf
        and 2 <= len(costs.nodes) <= TOGETHER_MAX_NODES
    )


def tree_plan(costs: LinkCosts, piece_bytes: int, settings: MeshSection) -> dict[str, Tree]:
    """Every origin's ``tree``. Planned alone, each origin's tree sends through the
    nodes that reach the rest soonest, and a round, in which every origin sends at
    once, piles its relaying on them: on the 11-city matrix (six nodes, 10 Mbit/s
    uplinks, 1 MiB pieces) Paris would send 13 of the round's 30 copies, and the
    star's hub 19. So where :func:`plans_trees_together` says so, each origin's tree
    is planned again with every node's uplink already busy with the copies it sends
    in the other origins' trees (as first planned), and with no fan-out limit (the
    uplink's time, which the limit stands in for, is counted): the relaying goes to
    the nodes that have least to send (five copies each there, where the ring sends
    five too). One such pass can also move relaying onto slow links (every origin
    answers the same loads at once), so the trees planned alone stay where the model
    plays a round of two pieces per origin out faster on them. Every node plans from
    the same published state, so every node gets the same trees."""
    nodes = costs.nodes
    alone = {o: tree_for(o, costs, piece_bytes, settings) for o in nodes}
    if not plans_trees_together(costs, piece_bytes):
        return alone
    every = len(nodes)
    first = {o: tree_for(o, costs, piece_bytes, settings, max_children=every) for o in nodes}
    copy_s = piece_bytes * 8 / costs.uplink_bps
    copies = {o: {u: len(kids) for u, kids in t.items()} for o, t in first.items()}
    total = {u: sum(c.get(u, 0) for c in copies.values()) for u in nodes}
    together = {
        o: tree_for(
            o,
            costs,
            piece_bytes,
            settings,
            load_s={u: (total[u] - copies[o].get(u, 0)) * copy_s for u in nodes},
            max_children=every,
        )
        for o in nodes
    }
    alone_s = predict_round_s(Plan("tree", alone), costs, 2 * piece_bytes, piece_bytes)
    together_s = predict_round_s(Plan("tree", together), costs, 2 * piece_bytes, piece_bytes)
    return together if together_s < alone_s else alone


def tree_for(
    origin: str,
    costs: LinkCosts,
    piece_bytes: int,
    settings: MeshSection,
    load_s: Mapping[str, float] | None = None,
    max_children: int | None = None,
) -> Tree:
    """core.mesh.routing's tree, shaped for pieces of ``piece_bytes`` (``load_s`` and
    ``max_children``: as core.mesh.routing.build_tree takes them)."""

    def rtt(u: str, v: str) -> float | None:
        d = costs.delay(u, v)
        return None if d is None else 2 * d

    return build_tree(
        origin,
        costs.nodes,
        rtt,
        settings,
        chunk_bytes=piece_bytes,
        rate=costs.rate_of,
        uplink_bps=costs.uplink_bps or None,
        load_s=load_s,
        max_children=max_children,
    )


RING_STARTS = 8
"""Nearest-neighbour rings started from at most this many nodes (all of them in small
meshes), each improved by 2-opt."""
RING_UNREACHABLE = 1e9
"""The cost of a hop with no known delay, or above a ring's bound on its slowest hop."""


def ring_order(costs: LinkCosts, piece_bytes: int) -> tuple[str, ...]:
    """The ring, as PCCL orders one, by measured cost: each hop's delay plus a piece's
    serialization (directed), and the slowest hop's serialization once for every
    payload the ring carries over it (``n - 1``): every link of a ring carries all
    payloads but one, so the slowest link holds the whole round, and the least total
    alone will take one very slow link to save a little on every other (an 11-city
    ring through one 3.6 Mbit/s link instead of several of 5). Candidates: the least
    total cost (nearest neighbour from several starts, then 2-opt), and the least
    total among rings whose hops are all at most as slow as the lowest bound one is
    found under (bisected over the links' serialization times). Ties by name. Starts
    at the first node by name."""
    nodes = costs.nodes
    n = len(nodes)
    if n <= 3:
        return tuple(nodes)
    index = {v: i for i, v in enumerate(nodes)}
    table = [[0.0] * n for _ in nodes]
    serial = [[0.0] * n for _ in nodes]
    for u in nodes:
        for v in nodes:
            if u != v:
                h = costs.hop_s(u, v, piece_bytes)
                table[index[u]][index[v]] = RING_UNREACHABLE if h is None else h
                serial[index[u]][index[v]] = piece_bytes * 8 / costs.rate(u, v)

    def score(order: list[int]) -> float:
        hops = [(order[t], order[(t + 1) % n]) for t in range(n)]
        slowest = max(serial[i][j] for i, j in hops)
        return sum(table[i][j] for i, j in hops) + (n - 1) * slowest

    candidates = [_least_cycle(table)]
    levels = sorted({serial[i][j] for i in range(n) for j in range(n) if i != j})
    lo, hi = 0, len(levels) - 2  # the slowest level allows every link: the first candidate
    while lo <= hi:
        mid = (lo + hi) // 2
        bounded = [
            [RING_UNREACHABLE if serial[i][j] > levels[mid] else table[i][j] for j in range(n)]
            for i in range(n)
        ]
        order = _least_cycle(bounded)
        if all(bounded[order[t]][order[(t + 1) % n]] < RING_UNREACHABLE for t in range(n)):
            candidates.append(order)
            hi = mid - 1
        else:
            lo = mid + 1
    best = min(candidates, key=score)  # the first of equals: the least total
    i = best.index(0)
    return tuple(nodes[k] for k in best[i:] + best[:i])


def _least_cycle(table: Sequence[Sequence[float]]) -> list[int]:
    """The directed cycle of least total cost found by nearest neighbour from up to
    ``RING_STARTS`` starts, each improved by 2-opt."""
    n = len(table)
    step = max(1, n // RING_STARTS)
    best: list[int] | None = None
    best_cost = float("inf")
    for start in range(0, n, step):
        order = [start]
        left = set(range(n)) - {start}
        while left:
            here = table[order[-1]]
            nxt = min(sorted(left), key=lambda v: here[v])
            order.append(nxt)
            left.remove(nxt)
        order, c = _two_opt(order, table)
        if c < best_cost - 1e-12:
            best, best_cost = order, c
    assert best is not None
    return best


def _two_opt(order: list[int], c: Sequence[Sequence[float]]) -> tuple[list[int], float]:
    """Reverse segments while that shortens the directed cycle (first improvement; each
    candidate costed in O(1) from prefix sums of the hops forward and backward)."""
    n = len(order)
    passes = 0
    while passes < 4 * n:
        passes += 1
        cyc = [*order, order[0]]
        fwd, rev = [0.0], [0.0]
        for t in range(n):
            fwd.append(fwd[-1] + c[cyc[t]][cyc[t + 1]])
            rev.append(rev[-1] + c[cyc[t + 1]][cyc[t]])
        total = fwd[n]
        found = False
        for i in range(1, n - 1):
            a = order[i - 1]
            for j in range(i + 1, n):
                b = cyc[j + 1]
                old = c[a][order[i]] + fwd[j] - fwd[i] + c[order[j]][b]
                new = c[a][order[j]] + rev[j] - rev[i] + c[order[i]][b]
                if new < old - 1e-12:
                    order = order[:i] + order[i : j + 1][::-1] + order[j + 1 :]
                    found = True
                    break
            if found:
                break
        if not found:
            return order, total
    return order, sum(c[order[t]][order[(t + 1) % n]] for t in range(n))


def ring_tree(origin: str, order: Sequence[str]) -> Tree:
    """The origin's payload once around the ring: each node's child is the next."""
    n = len(order)
    i = order.index(origin)
    tree: Tree = {node: [] for node in order}
    for k in range(n - 1):
        tree[order[(i + k) % n]] = [order[(i + k + 1) % n]]
    return tree


def clusters(costs: LinkCosts, cluster_rtt_s: float) -> tuple[tuple[str, ...], ...]:
    """Single linkage: two nodes share a cluster when a chain of links of RTT under
    ``cluster_rtt_s`` (as both ends published it) joins them. In name order."""
    parent = {n: n for n in costs.nodes}

    def find(x: str) -> str:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for u, v in itertools.combinations(costs.nodes, 2):
        rtt = costs.rtt_both(u, v)
        if rtt is not None and rtt < cluster_rtt_s:
            ru, rv = find(u), find(v)
            if ru != rv:
                parent[max(ru, rv)] = min(ru, rv)
    groups: dict[str, list[str]] = {}
    for n in costs.nodes:
        groups.setdefault(find(n), []).append(n)
    return tuple(tuple(g) for _, g in sorted(groups.items()))


def cluster_leaders(
    groups: Sequence[Sequence[str]], costs: LinkCosts, piece_bytes: int
) -> dict[tuple[str, ...], str]:
    """Per cluster, the member with the least total cost of a piece to the other
    clusters' nodes, each RTT as both ends published it (ties by name); the lone
    member of a cluster of one."""
    out: dict[tuple[str, ...], str] = {}
    for g in groups:
        others = [n for h in groups if h is not g for n in h]

        def reach(u: str, others: list[str] = others) -> float:
            total = 0.0
            for v in others:
                rtt = costs.rtt_both(u, v)
                total += 1e9 if rtt is None else rtt / 2 + piece_bytes * 8 / costs.rate(u, v)
            return total

        out[tuple(g)] = min(sorted(g), key=reach)
    return out


def hierarchical_tree(
    origin: str,
    groups: Sequence[Sequence[str]],
    leaders: Mapping[tuple[str, ...], str],
    costs: LinkCosts,
    piece_bytes: int,
    settings: MeshSection,
) -> Tree:
    """Inside the origin's cluster, the routing tree from the origin; among the
    leaders, the routing tree from the origin's leader; inside every other cluster,
    the routing tree from its leader (each fan-out-limited as any tree)."""
    tree: Tree = {n: [] for n in costs.nodes}

    def merge(root: str, members: Sequence[str]) -> None:
        sub = dataclasses.replace(costs, nodes=tuple(sorted(members)))
        for node, kids in tree_for(root, sub, piece_bytes, settings).items():
            tree[node] = tree[node] + [k for k in kids if k not in tree[node]]

    home = next(tuple(g) for g in groups if origin in g)
    merge(origin, home)
    merge(leaders[home], list(leaders.values()))
    for g in groups:
        if tuple(g) != home:
            merge(leaders[tuple(g)], g)
    return tree
