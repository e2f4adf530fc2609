"""Routes and dissemination trees, computed from the RTT map.

- **Routes** (unicast): for every destination the path of least one-way delay,
  ``rtt / 2`` per hop plus ``relay_penalty_s`` per relay (Dijkstra). Between clouds
  the direct path is often not the fastest (see data/wan/README.md); a route through
  one or more relays is taken when it is. Hysteresis: a new path replaces the current
  one only if it is faster by ``route_hysteresis`` (10%) of the current path's cost,
  re-evaluated on the current map, so routes do not flap on noise; a path through a
  node that left the view is replaced at once.
- **Dissemination trees**: for each origin, the tree along which its chunk reaches
  every live node soonest. A node's uplink is shared by its children, so the c-th
  child of a node receives ``c`` serialization times later; the tree is grown
  greedily (a Dijkstra in which the arrival time of v through u counts u's earlier
  children), and a node takes at most ``tree_max_fanout`` children. A relay must
  win by ``tree_relay_margin`` (10%): on the 11-city matrix Singapore to São Paulo
  direct and through Oregon differ by 4%, and RTTs measured on a busy node put that
  tie on either side from run to run (one node in four relayed, sent 2.4 times the
  bytes and its peers' chunks arrived later). Every node
  computes every tree from the same published link state, deterministically (ties
  go by node name), so nodes agree on who forwards to whom; where views briefly
  differ, duplicates are dropped and gaps repaired (core.mesh.broadcast).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Mapping, Sequence

from ciuic_p2p.config.sections import MeshSection

RttFn = Callable[[str, str], float | None]
RateFn = Callable[[str, str], float | None]
"""The published rate from one node to another, bits/s (None: not measured)."""


def path_cost_s(path: Sequence[str], rtt: RttFn, relay_penalty_s: float) -> float | None:
    """One-way delay along ``path`` (nodes in order, source first); None if a link is
    unknown."""
    total = 0.0
    for i in range(len(path) - 1):
        r = rtt(path[i], path[i + 1])
        if r is None:
            return None
        total += r / 2 + (relay_penalty_s if i > 0 else 0.0)
    return total


def shortest_paths(
    source: str, nodes: Sequence[str], rtt: RttFn, relay_penalty_s: float
) -> dict[str, tuple[float, tuple[str, ...]]]:
    """Least one-way delay and its path from ``source`` to every reachable node."""
    best: dict[str, tuple[float, tuple[str, ...]]] = {}
    heap: list[tuple[float, tuple[str, ...]]] = [(0.0, (source,))]
    while heap:
        cost, path = heapq.heappop(heap)
        u = path[-1]
        if u in best:
            continue
        best[u] = (cost, path)
        for v in nodes:
            if v in best or v == u:
                continue
            r = rtt(u, v)
            if r is None:
                continue
            heapq.heappush(
                heap, (cost + r / 2 + (relay_penalty_s if u != source else 0.0), (*path, v))
            )
    best.pop(source, None)
    return best


def build_tree(
    origin: str,
    nodes: Sequence[str],
    rtt: RttFn,
    settings: MeshSection,
    chunk_bytes: int | None = None,
    rate: RateFn | None = None,
    uplink_bps: float | None = None,
    load_s: Mapping[str, float] | None = None,
    max_children: int | None = None,
) -> dict[str, list[str]]:
    """Children of every node in ``origin``'s dissemination tree (see module doc).
    ``rate(u, v)``: the published rate from u to v in bits/s (None: not measured, and
    ``default_rate_bps`` is counted). A rate counts at most ``default_rate_bps``: a
    measurement may make a link slower than an unmeasured one, never faster, so what
    a member publishes cannot make it everyone's relay. ``uplink_bps``: what a node's
    links share (core.mesh.linkcosts): None counts its copies one after another at
    their links' rates, as the module docstring says; infinity counts its links as
    independent (and takes no fan-out limit); a rate counts the copies one after
    another at that rate. ``load_s``: how long each node's uplink is already busy
    with other origins' copies in the same round (core.mesh.planners' balanced
    trees): a node's children wait for that too. ``max_children``: the fan-out limit
    instead of ``tree_max_fanout``."""
    size = settings.tree_chunk_bytes if chunk_bytes is None else chunk_bytes
    copies = _Copies(size, settings.default_rate_bps, rate, uplink_bps)
    serialize_s, occupies_s = copies.serialize_s, copies.occupies_s

    load = load_s or {}
    busy: dict[str, float] = {origin: load.get(origin, 0.0)}
    """Per node, the serialization of the copies to the children it has so far."""
    fanout = max(1, settings.tree_max_fanout if max_children is None else max_children)
    if uplink_bps == math.inf:  # independent links: nothing shared to limit
        fanout = max(fanout, len(nodes))
    arrival = {origin: 0.0}
    children: dict[str, list[str]] = {origin: []}
    remaining = sorted(n for n in set(nodes) if n != origin)
    delay: dict[tuple[str, str], float | None] = {}
    while remaining:
        pick: tuple[float, str, str] | None = None
        for v in remaining:
            for u, t_u in arrival.items():
                kids = children[u]
                if len(kids) >= fanout:
                    continue
                key = (u, v)
                if key not in delay:
                    r = rtt(u, v)
                    delay[key] = None if r is None else r / 2
                d = delay[key]
                if d is None:
                    continue
                # The uplink sends its children one after the other: this one waits
                # for the copies before it (counted at the rate to each).
                t = t_u + busy[u] + serialize_s(u, v) + d
                if u != origin:
                    t = (t + settings.relay_penalty_s) * (1 + settings.tree_relay_margin)
                cand = (t, v, u)
                if pick is None or cand < pick:
                    pick = cand
        if pick is None:  # nodes no one can reach (unknown links): straight from the origin
            for v in remaining:
                children[origin].append(v)
                children[v] = []
            break
        t, v, u = pick
        arrival[v] = t
        busy[u] += occupies_s(u, v)
        busy[v] = load.get(v, 0.0)
        children[u].append(v)
        children[v] = []
        remaining.remove(v)
    return children


class _Copies:
    """What one copy of a chunk costs a tree's node (see :func:`build_tree`): its
    serialization on the link, and how long it keeps the node's uplink busy."""

    def __init__(
        self, size: int, default_bps: float, rate: RateFn | None, uplink_bps: float | None
    ) -> None:
        self.size, self.default_bps, self.rate, self.uplink_bps = (
            size,
            default_bps,
            rate,
            uplink_bps,
        )
        self._serialize: dict[tuple[str, str], float] = {}

    def serialize_s(self, u: str, v: str) -> float:
        key = (u, v)
        found = self._serialize.get(key)
        if found is None:
            bps = self.rate(u, v) if self.rate is not None else None
            bps = min(bps, self.default_bps) if bps else self.default_bps
            uplink = self.uplink_bps
            found = self._serialize[key] = self.size * 8 / (min(bps, uplink) if uplink else bps)
        return found

    def occupies_s(self, u: str, v: str) -> float:
        """How long a copy to v keeps u's uplink from its next copy."""
        if self.uplink_bps is None:
            return self.serialize_s(u, v)
        return self.size * 8 / self.uplink_bps  # 0 for an infinite uplink: independent


class Router:
    """The route table and the tree cache of one node."""

    def __init__(self, node: str, settings: MeshSection) -> None:
        self.node = node
        self.settings = settings
        self.routes: dict[str, tuple[str, ...]] = {}
        """Destination -> path (this node first)."""
        self._trees: dict[str, dict[str, list[str]]] = {}
        self._view: tuple[str, ...] = ()
        self._rtt: RttFn = lambda a, b: None
        self._rate: RateFn | None = None

    def update(self, view: Sequence[str], rtt: RttFn, rate: RateFn | None = None) -> None:
        """Recompute after the view or the map changed."""
        self._view = tuple(sorted(view))
        self._rtt = rtt
        self._rate = rate
        self._trees.clear()
        s = self.settings
        best = shortest_paths(self.node, self._view, rtt, s.relay_penalty_s)
        alive = set(self._view)
        for dst in list(self.routes):
            if dst not in alive:
                del self.routes[dst]
        for dst, (cost, path) in best.items():
            current = self.routes.get(dst)
            if current is not None and all(n in alive for n in current):
                current_cost = path_cost_s(current, rtt, s.relay_penalty_s)
                if current_cost is not None and cost >= current_cost * (1 - s.route_hysteresis):
                    continue
            if current != path:
                self.routes[dst] = path

    def tree(self, origin: str) -> dict[str, list[str]]:
        tree = self._trees.get(origin)
        if tree is None:
            view = self._view if origin in self._view else (*self._view, origin)
            tree = build_tree(origin, view, self._rtt, self.settings, rate=self._rate)
            self._trees[origin] = tree
        return tree

    def children(self, origin: str, node: str | None = None) -> list[str]:
        return list(self.tree(origin).get(self.node if node is None else node, []))
