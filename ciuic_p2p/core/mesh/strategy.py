"""How a round's payloads spread: the choice of strategy, and a node's plans kept
current.

The strategies' trees are planned by core.mesh.planners from the published link state
(core.mesh.linkcosts), and a round under each is played out by the cost model
(core.mesh.roundcost). The chooser (:class:`Chooser`) picks the strategy with the least
predicted time, and leaves the current one only for a gain of ``hysteresis``, and for
a large round only for a strategy whose links all have a published rate; it decides at
round boundaries. :class:`Plans` keeps one node's trees of every strategy for the
published state it has. Pure: no clock, no I/O; the same state gives the same trees
and the same choice.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ciuic_p2p.config.sections import MeshSection
from ciuic_p2p.core.mesh.linkcosts import STRATEGIES, LinkCosts, Plan, Strategy, Tree
from ciuic_p2p.core.mesh.planners import (
    LARGE_PIECE_BYTES,
    cluster_leaders,
    clusters,
    hierarchical_tree,
    plan,
    plans_trees_together,
    ring_order,
    ring_tree,
    tree_for,
    tree_plan,
)
from ciuic_p2p.core.mesh.roundcost import predict_round_s

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
