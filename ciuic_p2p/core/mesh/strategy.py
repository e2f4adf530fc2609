"""How a round's payloads spread: three strategies, a cost model, and the choice.

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

The cost model (:func:`predict_round_s`) plays the round out on the published state:
every origin starts at once, each payload is cut into pieces of at most
``piece_bytes`` that travel store-and-forward, a link sends one piece after another
(FIFO, at its rate) behind a node's uplink, which passes one copy after another at
its own rate (at the link's where none is known), unless the links are known to be
independent. The round ends when the last node holds the last
piece. The chooser
(:class:`Chooser`) picks the strategy with the least predicted time, and leaves the
current one only for a gain of ``hysteresis``, and for a large round only for a
strategy whose links all have a published rate; it decides at round boundaries. Pure:
no clock, no I/O; the same state gives the same trees and the same choice.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from ciuic_p2p.config.sections import MeshSection
from ciuic_p2p.core.mesh.routing import build_tree

Strategy = Literal["tree", "ring", "hierarchical"]
STRATEGIES: tuple[Strategy, ...] = ("tree", "ring", "hierarchical")
"""In the order of their wire code (core.mesh.messages: a chunk names its route); only
append."""

Tree = dict[str, list[str]]
"""Children of every node in one origin's tree."""


INITIAL_WINDOW_BYTES = 10 * 1452
"""QUIC's initial window, ten datagrams (RFC 9002 section 7.2; qh3 and aioquic), which a
link idle for a while starts from again (qh3 after 2 s)."""

DelayFn = Callable[[str, str], float | None]
"""One-way delay from one node to another in seconds (None: not known)."""
RateFn = Callable[[str, str], float | None]
"""The published rate from one node to another in bits/s (None: not measured)."""


@dataclass(frozen=True, slots=True)
class LinkCosts:
    """The published state a plan is made from: nodes (in name order), the one-way
    delay and the rate of every directed link known (read as needed: a large mesh's
    map is never copied), and what a node's links share, ``uplink_bps``: 0 (not known)
    counts a node's copies one after another at their links' rates; infinity counts
    its links as independent; a rate counts the copies one after another through an
    uplink of that rate."""

    nodes: tuple[str, ...]
    delay_of: DelayFn
    rate_of: RateFn
    default_rate_bps: float = 1e9
    uplink_bps: float = 0.0
    relay_s: float = 0.002
    """What a relay adds per piece it forwards (receive, check, queue)."""
    initial_window_bytes: int = INITIAL_WINDOW_BYTES
    """QUIC's congestion window on a link that has been idle (slow start)."""
    rtt_both_of: DelayFn | None = None
    """The RTT of a pair as both its ends published it (the larger of the two; None
    unless both did): what clusters and leaders go by, so that no member can pull
    itself into every cluster, or make itself a leader, by claiming short links.
    None: twice the one-way delays."""

    def rtt_both(self, u: str, v: str) -> float | None:
        if self.rtt_both_of is not None:
            return self.rtt_both_of(u, v)
        a, b = self.delay(u, v), self.delay(v, u)
        return None if a is None or b is None else a + b

    @classmethod
    def from_tables(
        cls,
        nodes: Sequence[str],
        delay_s: Mapping[tuple[str, str], float],
        rate_bps: Mapping[tuple[str, str], float],
        default_rate_bps: float = 1e9,
        uplink_bps: float = 0.0,
        relay_s: float = 0.002,
    ) -> LinkCosts:
        return cls(
            tuple(sorted(nodes)),
            lambda u, v: delay_s.get((u, v)),
            lambda u, v: rate_bps.get((u, v)),
            default_rate_bps,
            uplink_bps,
            relay_s,
        )

    def delay(self, u: str, v: str) -> float | None:
        return self.delay_of(u, v)

    def rate(self, u: str, v: str) -> float:
        """The link's rate, never above ``default_rate_bps`` (a published rate may
        make a link slower than an unmeasured one, not faster: core.mesh.routing)."""
        r = self.rate_of(u, v)
        return min(r, self.default_rate_bps) if r else self.default_rate_bps

    def hop_s(self, u: str, v: str, size: int) -> float | None:
        """Delay plus serialization of ``size`` bytes from u to v (None: no link)."""
        d = self.delay(u, v)
        return None if d is None else d + size * 8 / self.rate(u, v)


@dataclass(frozen=True, slots=True)
class Plan:
    """One strategy's trees, one per origin."""

    strategy: Strategy
    trees: Mapping[str, Tree]


# -- the planners ---------------------------------------------------------------------


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


# -- the cost model -------------------------------------------------------------------


def predict_round_s(plan_: Plan, costs: LinkCosts, payload_bytes: int, piece_bytes: int) -> float:
    """When the last node holds the last piece of every origin's payload, every origin
    starting at time 0 (see the module docstring; each link idle at the start, so its
    first piece pays QUIC's slow start). Infinite if a tree misses a node or uses a
    link with no known delay."""
    pieces = _pieces(payload_bytes, piece_bytes)
    link_free: dict[tuple[str, str], float] = {}
    up_free: dict[str, float] = {}
    done = 0.0
    events: list[tuple[float, int, str, str, int]] = []
    order = itertools.count()
    for origin in costs.nodes:
        for k in range(len(pieces)):
            heapq.heappush(events, (0.0, next(order), origin, origin, k))
    held: set[tuple[str, str, int]] = set()
    while events:
        t, _, node, origin, k = heapq.heappop(events)
        if (node, origin, k) in held:
            continue
        held.add((node, origin, k))
        done = max(done, t)
        size = pieces[k]
        ready = t + (costs.relay_s if node != origin else 0.0)
        for child in plan_.trees[origin].get(node, []):
            d = costs.delay(node, child)
            if d is None:
                return float("inf")
            link_s = size * 8 / costs.rate(node, child)
            uplink = costs.uplink_bps
            if (node, child) not in link_free:  # the link's first piece: slow start
                pace = min(costs.rate(node, child), uplink or math.inf)
                link_s += slow_start_s(size, pace, 2 * d, costs.initial_window_bytes)
            if uplink == math.inf:  # independent links: each its own FIFO
                leave = max(ready, link_free.get((node, child), 0.0)) + link_s
            else:
                # The uplink passes the copy's datagrams at its rate, one copy after
                # another (0: at the link's, as a node that sends one copy at a time);
                # the link takes them at its own, behind what it still carries: the
                # slower of the two paces the copy, as in the emulator.
                up_s = size * 8 / uplink if uplink > 0 else link_s
                up_start = max(ready, up_free.get(node, 0.0))
                up_free[node] = up_start + up_s
                link_start = max(up_start, link_free.get((node, child), 0.0))
                leave = max(up_start + up_s, link_start + link_s)
            link_free[(node, child)] = leave
            heapq.heappush(events, (leave + d, next(order), child, origin, k))
    if len(held) < len(costs.nodes) ** 2 * len(pieces):
        return float("inf")
    return done


def slow_start_s(size: int, rate_bps: float, rtt_s: float, window: int) -> float:
    """What QUIC's slow start adds to ``size`` bytes sent on an idle link of this rate
    and RTT, over sending them at the rate: the window doubles each RTT from
    ``window`` until it holds the path's bandwidth-delay product, so B = min(size,
    BDP) bytes take ``rtt * log2(B / window + 1)`` where the rate alone takes B / rate
    (and the rest goes at the rate)."""
    bdp = rate_bps * rtt_s / 8
    b = min(size, bdp)
    if b <= window or rtt_s <= 0:
        return 0.0
    return max(0.0, rtt_s * math.log2(b / window + 1) - b * 8 / rate_bps)


def _pieces(payload_bytes: int, piece_bytes: int) -> list[int]:
    piece = max(1, piece_bytes)
    full, rest = divmod(max(1, payload_bytes), piece)
    return [piece] * full + ([rest] if rest else [])


# -- the choice -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Choice:
    """A decision: the strategy, and every strategy's predicted round time."""

    strategy: Strategy
    predicted_s: Mapping[Strategy, float]
    payload_bytes: int
    unmeasured: frozenset[Strategy] = frozenset()
    """Strategies whose trees send a large payload over a link with no published rate:
    their predictions rest on ``default_rate_bps``, and none of them is switched to."""


def same_plan(trees: Mapping[Strategy, Mapping[str, Tree]]) -> tuple[tuple[Strategy, ...], ...]:
    """The strategies grouped by the trees they send by (every origin's, children in
    any order): where all nodes form one cluster (a star whose leaves are all near
    its hub) or every cluster is one node, ``hierarchical`` is the ``tree``. Two
    names for one plan are one strategy: a round of each measures the same thing,
    and the faster of two such rounds is only the luckier."""
    groups: dict[object, list[Strategy]] = {}
    for s, per_origin in trees.items():
        shape = tuple(
            sorted(
                (o, tuple(sorted((u, tuple(sorted(kids))) for u, kids in t.items() if kids)))
                for o, t in per_origin.items()
            )
        )
        groups.setdefault(shape, []).append(s)
    return tuple(tuple(g) for g in groups.values())


def unmeasured_links(plan_: Plan, costs: LinkCosts) -> int:
    """Links of ``plan_``'s trees that carry a payload and have no published rate."""
    edges = {(u, v) for tree in plan_.trees.values() for u, kids in tree.items() for v in kids}
    return sum(1 for u, v in edges if not costs.rate_of(u, v))


@dataclass
class Chooser:
    """The strategy in force and when it changes (at round boundaries, by
    :meth:`decide`): the least predicted round time, leaving the current strategy
    only when another is faster by ``hysteresis`` of its time."""

    settings: MeshSection
    piece_bytes: int
    current: Choice | None = None
    switches: int = 0
    plans: dict[Strategy, Plan] = field(default_factory=dict)

    def decide(
        self, costs: LinkCosts, payload_bytes: int, allowed: Sequence[Strategy] = STRATEGIES
    ) -> Choice:
        piece = min(self.piece_bytes, max(1, payload_bytes))
        predicted: dict[Strategy, float] = {}
        unmeasured: set[Strategy] = set()
        for s in allowed:
            p = plan(s, costs, piece, self.settings)
            self.plans[s] = p
            predicted[s] = predict_round_s(p, costs, payload_bytes, self.piece_bytes)
            if payload_bytes > LARGE_PIECE_BYTES and unmeasured_links(p, costs):
                unmeasured.add(s)
        now = self.current
        # A large round's time is its links' serialization, which an unmeasured link's
        # default rate only guesses (a star's leaf-to-leaf links, which no tree uses,
        # looked four times faster than they were, and a ring round on them took twice
        # the tree's): the strategy in force (the tree at first) stays until another's
        # links are measured (core.link.throughput, and the rate probes of the links
        # nothing else measures).
        # The incumbent of a small round does not count: unmeasured links cost it
        # nothing there, and large rounds would inherit it.
        large = payload_bytes > LARGE_PIECE_BYTES
        incumbent: Strategy = "tree"
        if now is not None and (not large or now.payload_bytes > LARGE_PIECE_BYTES):
            incumbent = now.strategy
        candidates = [s for s in allowed if s not in unmeasured or s == incumbent]
        if not candidates:
            candidates = list(allowed)
        best = min(candidates, key=lambda s: (predicted[s], STRATEGIES.index(s)))
        keep = now is not None and now.strategy in candidates
        if keep:
            assert now is not None
            current_s = predicted[now.strategy]
            if predicted[best] < current_s * (1.0 - self.settings.strategy_hysteresis):
                keep = False
        chosen: Strategy = now.strategy if keep and now is not None else best
        if now is not None and chosen != now.strategy:
            self.switches += 1
        self.current = Choice(chosen, predicted, payload_bytes, frozenset(unmeasured))
        return self.current


# -- a node's plans and choice, kept current ------------------------------------------

AUTO_MAX_NODES = 32
"""Rings and clusters are planned for meshes up to this size (``auto`` plays rounds
out, and a relay follows a chunk's route); past it every chunk goes down the
``tree``: planning a ring or clusters costs O(N^3) per published state (0.08 s at
80 nodes here), and a member could make every node pay it with each new link state."""


TOGETHER_MAX_NODES = 12
"""A round's large trees are planned together (:func:`tree_plan`) in meshes up to this
size. Planning every origin's tree three times (alone, then twice with no fan-out
limit) and two rounds out costs 8 ms per published state at 12 nodes (one tree
alone: 0.2 ms), 22 ms at 16 and 0.27 s at 32, and published states change tens of
times in a large round (a member may republish at will): past it each tree is planned
alone, as it is needed."""


LARGE_PIECE_BYTES = 64 * 1024
"""A payload of more than this is a large piece: its trees are shaped for
``strategy_piece_bytes``, where its serialization counts; below, for
``tree_chunk_bytes``, where the delays do."""


def piece_class(payload_bytes: int, settings: MeshSection) -> int:
    """The size a payload's trees are shaped for: one of two, so that a node plans at
    most two shapes per strategy and published state, whatever sizes members send.
    Every node computes it from the payload it holds, so all shape a chunk's trees
    alike."""
    if payload_bytes > LARGE_PIECE_BYTES:
        return max(settings.tree_chunk_bytes, settings.strategy_piece_bytes)
    return settings.tree_chunk_bytes


class Plans:
    """One node's trees of every strategy for the published state it has (rebuilt as
    needed after :meth:`update` brings a new state), and its own choice of strategy
    for its rounds (``mesh.strategy``; ``auto``: :class:`Chooser`)."""

    def __init__(self, settings: MeshSection, piece_bytes: int) -> None:
        self.settings = settings
        self.piece_bytes = piece_bytes
        """The most a chunk carries (rounds travel in pieces of at most this)."""
        self.chooser = Chooser(settings, piece_bytes)
        self.costs: LinkCosts | None = None
        self._key: object = None
        self._trees: dict[tuple[Strategy, int, str, bool], Tree] = {}
        self._rings: dict[int, tuple[str, ...]] = {}
        self._groups: dict[int, tuple[tuple[tuple[str, ...], ...], dict[tuple[str, ...], str]]] = {}
        self._round: object = None
        self._decided_for: object = None

    def update(self, key: object, costs: LinkCosts) -> None:
        """The published state (``key`` names it: a new key, new plans)."""
        if key != self._key:
            self._key = key
            self.costs = costs
            self._trees.clear()
            self._rings.clear()
            self._groups.clear()

    def children(self, route: int, origin: str, node: str, payload_bytes: int) -> list[str]:
        """``node``'s children in ``origin``'s tree of strategy ``route`` (its code)
        for a payload of this size."""
        if self.costs is None or not 0 <= route < len(STRATEGIES):
            return []
        return list(self.tree(STRATEGIES[route], origin, payload_bytes).get(node, []))

    def tree(self, strategy: Strategy, origin: str, payload_bytes: int) -> Tree:
        costs = self.costs
        assert costs is not None
        if origin not in costs.nodes or len(costs.nodes) > AUTO_MAX_NODES:
            # An origin outside the view (it just left, or it just joined) gets a tree
            # of its own, never a ring or clusters, which are kept for the view; and a
            # large mesh plans trees only (AUTO_MAX_NODES).
            strategy = "tree"
            if origin not in costs.nodes:
                costs = dataclasses.replace(costs, nodes=tuple(sorted((*costs.nodes, origin))))
        piece = piece_class(payload_bytes, self.settings)
        # Planned together, one origin's tree depends on every other's (a node that
        # does not see the origin yet plans the round its view would, with the origin
        # in it, as the nodes that see it do); the chooser plans together only for
        # large payloads, and so does this.
        together = (
            strategy == "tree"
            and payload_bytes > LARGE_PIECE_BYTES
            and plans_trees_together(costs, piece)
        )
        key = (strategy, piece, origin, together)
        tree = self._trees.get(key)
        if tree is None:
            if together:
                planned = tree_plan(costs, piece, self.settings)
                if costs is self.costs:
                    for o, t in planned.items():
                        self._trees[(strategy, piece, o, True)] = t
                tree = self._trees[key] = planned[origin]
            else:
                tree = self._trees[key] = self._plan(strategy, origin, piece, costs)
        return tree

    def _plan(self, strategy: Strategy, origin: str, piece: int, costs: LinkCosts) -> Tree:
        if strategy == "tree":
            return tree_for(origin, costs, piece, self.settings)
        if strategy == "ring":
            order = self._rings.get(piece)
            if order is None:
                order = self._rings[piece] = ring_order(costs, piece)
            return ring_tree(origin, order)
        found = self._groups.get(piece)
        if found is None:
            groups = clusters(costs, self.settings.cluster_rtt_s)
            found = self._groups[piece] = (groups, cluster_leaders(groups, costs, piece))
        groups, leaders = found
        return hierarchical_tree(origin, groups, leaders, costs, piece, self.settings)

    def route_for(self, round_id: object, round_bytes: int) -> int:
        """The code of the strategy this node's round ``round_id`` (of ``round_bytes``
        per origin) spreads by: the configured one, or under ``auto`` the chooser's,
        taken at the round's first chunk, from the published state."""
        fixed = self.settings.strategy
        if fixed != "auto":
            return STRATEGIES.index(fixed)
        costs = self.costs
        if costs is None or len(costs.nodes) < 2 or len(costs.nodes) > AUTO_MAX_NODES:
            return 0
        if round_id != self._round or self.chooser.current is None:
            self._round = round_id
            # Played out again only for a new published state or rounds of another
            # size (within a factor of two): three strategies' rounds cost 1.5 ms at 8
            # nodes, at each round's first chunk, ahead of the chunk.
            decided_for = (self._key, round_bytes.bit_length())
            if decided_for != self._decided_for:
                self._decided_for = decided_for
                self.chooser.decide(costs, round_bytes)
        current = self.chooser.current
        assert current is not None
        return STRATEGIES.index(current.strategy)

    def predict(self, strategy: Strategy, round_bytes: int) -> float:
        """The cost model's round time of ``strategy`` on this node's published state
        (infinite before a state)."""
        costs = self.costs
        if costs is None:
            return math.inf
        piece = min(self.piece_bytes, max(1, round_bytes))
        return predict_round_s(
            plan(strategy, costs, piece, self.settings), costs, round_bytes, self.piece_bytes
        )

    def same_plan(self, round_bytes: int) -> tuple[tuple[Strategy, ...], ...]:
        """Which strategies send rounds of ``round_bytes`` by the same trees on this
        node's published state (:func:`same_plan`; each alone before a state)."""
        costs = self.costs
        if costs is None:
            return tuple((s,) for s in STRATEGIES)
        return same_plan(
            {s: {o: self.tree(s, o, round_bytes) for o in costs.nodes} for s in STRATEGIES}
        )

    def status(self) -> dict[str, object]:
        """The choice in force, for ``status``, metrics and the page."""
        c = self.chooser.current
        configured = self.settings.strategy
        in_force = configured if configured != "auto" else "tree" if c is None else c.strategy
        return {
            "configured": configured,
            "strategy": in_force,
            "round_bytes": None if c is None else c.payload_bytes,
            "predicted_s": {} if c is None else {k: round(v, 4) for k, v in c.predicted_s.items()},
            "unmeasured": [] if c is None else sorted(c.unmeasured),
            "switches": self.chooser.switches,
            "same_plan": (
                []
                if c is None
                else [list(g) for g in self.same_plan(c.payload_bytes) if len(g) > 1]
            ),
        }
