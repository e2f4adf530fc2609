"""One node of the mesh as a pure state machine: membership, the RTT map, routing and
dissemination together, behind the interface the simulator and the daemon drive.

    node = MeshNode("tokyo", "127.0.0.1:7946", settings, now=0.0, identities=ids)
    node.join("10.0.0.2:7946", now)
    node.receive_datagram(src_address, data, now)   # every mesh message that arrives
    for address, data in node.datagrams_to_send(now): ...
    while (event := node.next_event()) is not None: ...   # one typed stream out
    node.get_timer(); node.handle_timer(now)
    node.broadcast(payload, now)

What the node tells its driver is one stream of events, as aioquic's connection does:
:class:`Joined`, :class:`LeaveSpread`, :class:`MemberEvent` (a member entered a
state), :class:`Delivered` (a chunk to hand up, once) and :class:`IncarnationRaised`
(persist it: a restart must come back above it). Everything else the driver reads
through accessors (``incarnation``, ``members()``, ``rtt_s``...), never the parts.

Messages are addressed by the member's address string (``host:port`` in the daemon,
the node's name in the simulator); the daemon checks that a message's sender name is
the authenticated peer of the link it came on. Bytes that do not decode are counted
and dropped (core.mesh.messages raises a typed error for each). Every part checks what
another node signed against the credentials in one :class:`Identities`
(core.mesh.identities): the daemon adds each link's certificate there
(:meth:`MeshNode.learn_identity`), gossip carries the others.
"""

from __future__ import annotations

import collections
import dataclasses
import types
from collections.abc import Mapping
from dataclasses import dataclass

from ciuic_p2p.config.sections import MeshSection
from ciuic_p2p.core.mesh.broadcast import Delivery, Disseminator, Resumed
from ciuic_p2p.core.mesh.carriedplan import plan_from_tree
from ciuic_p2p.core.mesh.identities import Identities
from ciuic_p2p.core.mesh.linkcosts import STRATEGIES, LinkCosts, Strategy
from ciuic_p2p.core.mesh.members import Member, MemberEvent, State
from ciuic_p2p.core.mesh.membership import Membership
from ciuic_p2p.core.mesh.messages import (
    CHUNK_KINDS,
    Alive,
    Chunk,
    Heads,
    Links,
    MeshDecodeError,
    MeshKind,
    Message,
    Ping,
    Plan,
    Want,
    decode_message,
    encode_message,
)
from ciuic_p2p.core.mesh.planners import LARGE_PIECE_BYTES
from ciuic_p2p.core.mesh.routing import Router
from ciuic_p2p.core.mesh.rttmap import RttMap
from ciuic_p2p.core.mesh.strategy import Plans

DISSEMINATION_KINDS = frozenset({*CHUNK_KINDS, MeshKind.HEADS, MeshKind.WANT})


@dataclass(frozen=True, slots=True)
class Joined:
    """A member answered this node's join: it is in the mesh."""


@dataclass(frozen=True, slots=True)
class LeaveSpread:
    """This node's leave announcement has gone out to the members it could tell."""


@dataclass(frozen=True, slots=True)
class Delivered:
    """A chunk whose origin signature checked, seen here for the first time."""

    delivery: Delivery


@dataclass(frozen=True, slots=True)
class IncarnationRaised:
    """A refutation raised this node's incarnation: a restart must come back above
    it, or the mesh would take the restarted node for its suspected past."""

    incarnation: int


MeshEvent = Joined | LeaveSpread | MemberEvent | Delivered | IncarnationRaised


class MeshNode:
    def __init__(
        self,
        node: str,
        address: str,
        settings: MeshSection,
        now: float,
        *,
        identities: Identities,
        region: str = "",
        name: str = "",
        incarnation: int = 0,
        seed: int = 0,
        resume: Mapping[str, Resumed] | None = None,
    ) -> None:
        """``resume``: what this node's previous life delivered (core.mesh.broadcast
        ``Disseminator.delivered``)."""
        self.node = node
        self.settings = settings
        self.identities = identities
        self.rttmap = RttMap(node, settings, seed, sign=self._sign_links)
        self.membership = Membership(
            node,
            address,
            settings,
            now,
            identities=identities,
            region=region,
            name=name,
            incarnation=incarnation,
            seed=seed,
            coordinate=lambda: self.rttmap.vivaldi.coordinate,
            estimate_rtt_s=self.rttmap.rtt_s,
            links_for_sync=self.rttmap.all_links,
            links_digest=self.rttmap.digest,
        )
        self.router = Router(node, settings)
        self.plans = Plans(settings, piece_bytes=settings.strategy_piece_bytes)
        """Every strategy's trees and this node's choice for its rounds
        (core.mesh.strategy)."""
        self.dissemination = Disseminator(
            node,
            settings,
            children=self._children,
            live=self.membership.live,
            identities=identities,
            seed=seed,
            session=incarnation,
            plan_for=self._plan_for,
            parent=self._parent,
            resume=resume,
        )
        # A relay that fails this node: the link from it is published as not worth
        # taking, so that every node's trees route around it (core.mesh.broadcast).
        self.rttmap.distrusted = self.dissemination.distrusted
        self._events: collections.deque[MeshEvent] = collections.deque()
        self._joined_told = True  # nothing to tell until join() is called
        self._left_told = False
        self._incarnation_told = incarnation
        self.decode_errors = 0
        self.messages_sent = 0
        self._routing_key: tuple[int, int] | None = None
        self._view_version = 0
        self._view: frozenset[str] = frozenset()
        self.replans = 0
        """Times the routes and trees were computed again (a new view or link state)."""

    # -- the Endpoint interface (emulator.model.simulator) --------------------------------

    def receive_datagram(self, src: str, data: bytes, now: float) -> None:
        """Bytes from ``src``, whose sender nothing has checked (the simulator's
        datagrams): not taken as a sign of that sender's life."""
        try:
            msg = decode_message(data)
        except MeshDecodeError:
            self.decode_errors += 1
            return
        self._receive(src, msg, now)

    def receive_message(self, src: str, msg: Message, now: float) -> None:
        """A message whose sender the adapter checked against the authenticated link
        it came on: that member is alive (core.mesh.membership counts it as an
        answer)."""
        if msg.sender != self.node:
            self.membership.heard(msg.sender, now)
        self._receive(src, msg, now)

    def _receive(self, src: str, msg: Message, now: float) -> None:
        if msg.sender == self.node:
            return
        if msg.kind in DISSEMINATION_KINDS:
            self.dissemination.handle(msg, now)
        else:
            if isinstance(msg.body, Ping):
                self.rttmap.coords[msg.sender] = msg.body.coordinate
            self.membership.handle(msg, src, now)
        self._settle(now)

    def datagrams_to_send(self, now: float) -> list[tuple[str, bytes]]:
        return [(addr, encode_message(msg)) for addr, msg in self.messages_to_send()]

    def messages_to_send(self) -> list[tuple[str, Message]]:
        out = self.membership.messages_to_send()
        for node, msg in self.dissemination.messages_to_send():
            address = self.address_of(node)
            if address is not None:
                out.append((address, msg))
        self.messages_sent += len(out)
        return out

    def get_timer(self) -> float | None:
        timers = (
            self.membership.get_timer(),
            self.dissemination.get_timer(),
            self.rttmap.get_timer(),
        )
        times = [t for t in timers if t is not None]
        return min(times) if times else None

    def handle_timer(self, now: float) -> None:
        self.membership.handle_timer(now)
        self.dissemination.handle_timer(now)
        self._settle(now)

    def next_event(self) -> MeshEvent | None:
        """The next thing this node has to tell its driver, oldest first."""
        return self._events.popleft() if self._events else None

    # -- the application's side -----------------------------------------------------------------

    def join(self, address: str, now: float) -> None:
        """Join through the member at ``address`` (retried until it answers); a
        :class:`Joined` event follows its answer."""
        self.membership.join(address, now)
        self._joined_told = False
        self._settle(now)

    def learn_identity(self, node: str, credential: bytes) -> bool:
        """A credential checked elsewhere too (an authenticated link's certificate);
        False when it does not make ``node`` a member."""
        return self.identities.learn(node, credential, keep=self.membership.members.__contains__)

    def leave(self, now: float) -> None:
        """Announce a graceful departure; :class:`LeaveSpread` follows once it went
        out. Keep driving the node until then (or ``leave_propagate_s``)."""
        self.membership.leave(now)
        self._settle(now)

    def force_leave(self, node: str, now: float) -> str | None:
        """Take a failed member as departed on this node's word (core.mesh.membership's
        :meth:`~Membership.force_leave`); why not, None when done."""
        refused = self.membership.force_leave(node, now)
        self._settle(now)
        return refused

    def rtt_estimate_s(self, a: str, b: str) -> float | None:
        """The pair's RTT by the Vivaldi coordinates alone (None: no coordinate)."""
        return self.rttmap.estimate_s(a, b)

    def broadcast(
        self,
        payload: bytes,
        now: float,
        round_id: object = None,
        round_bytes: int | None = None,
    ) -> int:
        """Send ``payload`` to every live node. A piece of a round (``round_id``: the
        origin's step, say; ``round_bytes``: what this node sends in that round) goes
        by the strategy chosen for the round (``mesh.strategy``); anything else down
        the ``tree``."""
        self._route()
        route = 0
        if round_id is not None and self.settings.dissemination == "tree":
            route = self.plans.route_for(round_id, round_bytes or len(payload))
        seq = self.dissemination.publish(payload, now, route)
        self._settle(now)
        return seq

    def predict_round_s(self, strategy: Strategy, round_bytes: int) -> float:
        """The cost model's round time of ``strategy`` for rounds of ``round_bytes``
        per origin, on this node's published state (core.mesh.strategy)."""
        self._route()
        return self.plans.predict(strategy, round_bytes)

    def same_plan(self, round_bytes: int) -> tuple[tuple[Strategy, ...], ...]:
        """The strategies that would send rounds of ``round_bytes`` by the same trees
        on this node's published state (core.mesh.strategy.same_plan)."""
        self._route()
        return self.plans.same_plan(round_bytes)

    def strategy(self) -> dict[str, object]:
        """The strategy this node's rounds spread by, and what the cost model predicted
        for each (core.mesh.strategy)."""
        self._route()
        return self.plans.status()

    def bootstrap(self, alive: list[Alive], now: float) -> None:
        """Start knowing these members alive (large simulations skip the joins)."""
        self.membership.bootstrap(alive, now)
        self._settle(now)

    # -- what it knows (accessors: the driver never reaches into the parts) ----------------

    @property
    def incarnation(self) -> int:
        return self.membership.incarnation

    @property
    def joined(self) -> bool:
        """In the mesh: no join pending (a node that never joined counts as in it)."""
        return self.membership.joined

    @property
    def health_score(self) -> int:
        """Lifeguard's local health: 0 when healthy (core.mesh.suspicion)."""
        return self.membership.awareness.score

    @property
    def health_reasons(self) -> dict[str, int]:
        """What raised ``health_score`` since it was last 0, and by how much
        (core.mesh.suspicion's ``PROBE_UNANSWERED``, ``NACKS_MISSING``, ``SUSPECTED``)."""
        return dict(self.membership.awareness.reasons)

    def members(self) -> Mapping[str, Member]:
        """The member table, read-only: every member this node knows, in any state."""
        return types.MappingProxyType(self.membership.members)

    def state_of(self, node: str) -> State | None:
        return self.membership.state_of(node)

    def rtt_s(self, a: str, b: str) -> float | None:
        """The RTT between two members as this node's map has it (core.mesh.rttmap)."""
        return self.rttmap.rtt_s(a, b)

    def rate_bps(self, a: str, b: str) -> float | None:
        """The published rate from ``a`` to ``b`` (bits/s), None where not measured."""
        return self.rttmap.rate_bps(a, b)

    def observe_rate(self, peer: str, rate_bps: float) -> None:
        """The rate ``peer``'s bytes reach this node, measured by the link (the
        adapter's transport; core.link.throughput): published with the link state."""
        if peer != self.node:
            self.rttmap.observe_rate(peer, rate_bps)

    def refused_claims(self, member: str) -> int:
        """How many of ``member``'s published links this node's map does not take at
        its word (a link shorter than its other end or the triangle bound say:
        core.mesh.rttmap)."""
        return self.rttmap.refused_claims(member)

    def distrusted_relays(self) -> dict[str, float]:
        """Relays whose copies failed this node, until when it does not count on them
        (core.mesh.broadcast)."""
        return dict(self.dissemination.distrusted)

    def rtt_source(self, a: str, b: str) -> str:
        """Where that RTT comes from: measured here, published by a member, Vivaldi."""
        return self.rttmap.source(a, b)

    def loss_of(self, a: str, b: str) -> float | None:
        return self.rttmap.loss_of(a, b)

    def public_key_of(self, node: str) -> bytes | None:
        """A member's key, from its checked credential."""
        return self.identities.public_key(node)

    def recheck_identities(self) -> list[str]:
        """Check every member's credential again (a reloaded revocation list); the
        members now refused (they can no longer sign anything that counts here)."""
        return self.identities.recheck()

    def address_of(self, node: str) -> str | None:
        m: Member | None = self.membership.members.get(node)
        return None if m is None else m.address

    def routes(self) -> dict[str, tuple[str, ...]]:
        """Destination -> path (this node first), current with the map."""
        self._route()
        return dict(self.router.routes)

    def tree(self, origin: str, payload_bytes: int | None = None) -> dict[str, list[str]]:
        """The ``tree`` strategy's tree of ``origin`` for payloads of this size (the
        default: ``tree_chunk_bytes``), as chunks spread by it."""
        self._route()
        size = self.settings.tree_chunk_bytes if payload_bytes is None else payload_bytes
        return self.plans.tree("tree", origin, size)

    def view(self) -> list[str]:
        """Live nodes (this one included), sorted."""
        return sorted(self.membership.alive_view())

    # -- gluing the parts -------------------------------------------------------------------------

    def _settle(self, now: float) -> None:
        m = self.membership
        for peer, coord, rtt_s in m.rtt_samples:
            self.rttmap.observe(peer, coord, rtt_s)
            member = m.members.get(peer)
            if member is not None:
                self.rttmap.observe_loss(peer, member.probes, member.acks)
        m.rtt_samples.clear()
        for links in m.links_received:
            # Not a departed member's (a late sync's copy): its links were forgotten
            # with it, and would linger, passed from node to node, until it came back.
            state = m.state_of(links.origin)
            if state is None or state < State.DEAD:
                self.rttmap.apply_links(links, now)
        m.links_received.clear()
        self.rttmap.release(now)
        if m.events:
            for event in m.events:
                if event.state >= State.DEAD:
                    self.rttmap.forget(event.node)
                    self.dissemination.forget_relay(event.node)
                if event.state == State.LEFT:
                    self.dissemination.forget(event.node, now)
            self._events.extend(m.events)
            m.events.clear()
            # Routes and plans follow the view, not the events: a member accusing
            # itself (or an honest node, which refutes at once) moves no one in or out
            # of the view, and would otherwise make every node replan for every event.
            view = frozenset(m.alive_view())
            if view != self._view:
                self._view = view
                self._view_version += 1
        published = self.rttmap.publish(now)
        if published is not None:
            m.queue.put(published)
        self._tell(m)

    def _tell(self, m: Membership) -> None:
        """Turn what changed in the parts into events."""
        if m.incarnation > self._incarnation_told:
            self._incarnation_told = m.incarnation
            self._events.append(IncarnationRaised(m.incarnation))
        if not self._joined_told and m.joined:
            self._joined_told = True
            self._events.append(Joined())
        if not self._left_told and m.left_spread():
            self._left_told = True
            self._events.append(LeaveSpread())
        for delivery in self.dissemination.take_deliveries():
            self._events.append(Delivered(delivery))

    def _route(self) -> None:
        key = (self._view_version, self.rttmap.changes)
        if key != self._routing_key:
            self._routing_key = key
            self.replans += 1
            view = self.view()
            self.router.update(view, self.rttmap.rtt_s, self.rttmap.rate_bps)
            self.plans.update(key, self._costs(view))

    def _costs(self, view: list[str]) -> LinkCosts:
        rtt_s = self.rttmap.rtt_s

        def delay(u: str, v: str) -> float | None:
            r = rtt_s(u, v)
            return None if r is None else r / 2

        s = self.settings
        return LinkCosts(
            tuple(view),
            delay,
            self.rttmap.rate_bps,
            s.default_rate_bps,
            s.node_uplink_bps,
            s.relay_penalty_s,
            rtt_both_of=self.rttmap.rtt_both_s,
        )

    def _sign_links(self, links: Links) -> Links:
        return dataclasses.replace(links, signature=self.identities.sign(links))

    def _children(self, origin: str, route: int, payload_bytes: int) -> list[str]:
        self._route()
        return self.plans.children(route, origin, self.node, payload_bytes)

    def _parent(self, origin: str, route: int, payload_bytes: int) -> str | None:
        """Who sends this node ``origin``'s chunks of ``route`` by its own trees."""
        self._route()
        if self.plans.costs is None or not 0 <= route < len(STRATEGIES):
            return None
        tree = self.plans.tree(STRATEGIES[route], origin, payload_bytes)
        return next((u for u, kids in tree.items() if self.node in kids), None)

    def _plan_for(self, route: int, payload_bytes: int) -> Plan:
        """The tree this node's chunk of ``route`` carries: planned for large pieces
        only (``mesh.carry_plans``; core.mesh.carriedplan says why)."""
        if not self.settings.carry_plans or payload_bytes <= LARGE_PIECE_BYTES:
            return ()
        self._route()
        if self.plans.costs is None or not 0 <= route < len(STRATEGIES):
            return ()
        return plan_from_tree(
            self.plans.tree(STRATEGIES[route], self.node, payload_bytes), self.node
        )


__all__ = [
    "Chunk",
    "Delivered",
    "Delivery",
    "Heads",
    "IncarnationRaised",
    "Joined",
    "LeaveSpread",
    "MemberEvent",
    "MeshEvent",
    "MeshNode",
    "Want",
]
