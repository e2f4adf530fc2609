"""Membership and failure detection: SWIM with Lifeguard, as a pure state machine.

SWIM (Das et al., 2002) with the refinements memberlist ships and Lifeguard
(core.mesh.suspicion) adds:

- Every ``probe_interval_s`` (times the local health multiplier) the node probes one
  member, round robin over a shuffled list. The direct deadline follows that member's
  measured RTT (``srtt + 4 rttvar``), so a peer across the ocean is not held to a
  deadline meant for one next door. Past it, ``indirect_probes`` helpers probe the
  target for us and answer with its ack or a nack.
- A member that answers neither is *suspected*, not declared dead. The suspicion is
  gossiped and also sent to the member itself, which refutes it by raising its
  *incarnation* number. The timeout shrinks as other members confirm (Lifeguard).
  Unrefuted, the member is declared *dead*.
- Traffic is evidence too: any message that came from a member on its own
  authenticated link (a chunk, a repair, an announcement) since a probe was sent
  counts as that probe's answer, and since a suspicion began, as a reason not to
  declare it dead here yet (the suspicion stays until the member refutes it, and is
  extended so at most ``MAX_DEATHS_WITHHELD`` times: a member that keeps sending but
  never refutes is not kept live here while others hold it dead). Only messages the
  adapter checked against the link's key count (``MeshNode.receive_message``). A node
  sending 1 MiB pieces over a saturated uplink answers probes seconds late, behind
  its own queue: 2.1 MB rounds on the emulated multi-cloud matrix at rate scale 0.01
  had members suspected dozens of times per run and declared dead while they were
  streaming chunks, and a member declared dead drops out of every tree until it
  refutes. A member that sends nothing is held to the deadlines as before.
- For one member, a higher incarnation wins; at equal incarnation left > dead >
  suspect > alive. Only the member itself raises its incarnation, so stale news
  never resurrects anyone, and a restarted node that learns it was declared dead (or
  knew by an older incarnation) refutes with a higher one.
- No member can speak for another (core.mesh.identities): a member enters the table only
  with a credential that was checked (from the handshake of a link to it, or carried
  in gossip with its first Alive), and its Alive and Left (its address, region and
  incarnation) and its link state count only with its own signature. An accusation
  (Suspect, Dead) is any member's word, taken only at the incarnation its subject
  signed: one above it is ignored (a forged ``Suspect(x, 2^64 - 1)`` once made x
  refute into an incarnation that cannot be encoded), and at the subject only an
  accusation at its current incarnation is refuted. A Dead from another member
  counts as a suspicion here (and as a confirmation of one): this node declares a
  member dead only when its own suspicion times out, so a lying member cannot have
  anyone declared dead faster than its subject can refute. A helper of an indirect
  probe probes the target at the address the target signed, never at one the
  requester names (that would make honest nodes send datagrams anywhere). The table
  holds at most ``max_members``. A member that left (its own signed word, which it
  can give at will) is taken back at most ``rejoin_min_s`` after its departure, its
  newest Alive held till then: one leaving and rejoining in a loop would move every
  node's view, and routes and trees, each time.
- Updates are piggybacked on probes and acks and pushed every ``gossip_interval_s``
  to ``gossip_fanout`` members (core.mesh.gossipqueue); members that died recently still
  get gossip, so a healed partition hears the refutations.
- Joining is a full state exchange (SYNC) with any member; the same exchange runs
  every ``sync_interval_s`` with a random member (anti-entropy) and every
  ``reconnect_interval_s`` with one member believed dead: that is how the two sides
  of a healed partition find each other and merge.

The machine is driven with ``now``; it returns messages addressed by the member's
address string and never reads a clock or touches a socket (aioquic's model).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import random
from collections.abc import Callable
from dataclasses import dataclass

from ciuic_p2p.config.sections import MeshSection
from ciuic_p2p.core.mesh.gossipqueue import GossipQueue
from ciuic_p2p.core.mesh.identities import Identities
from ciuic_p2p.core.mesh.members import Member, MemberTable, State
from ciuic_p2p.core.mesh.messages import (
    MAX_INCARNATION,
    MAX_MESSAGE_BYTES,
    Ack,
    Alive,
    Coordinate,
    Credential,
    Dead,
    Gossip,
    Left,
    Links,
    Message,
    Nack,
    Ping,
    PingReq,
    Suspect,
    Sync,
    Update,
    update_size,
)
from ciuic_p2p.core.mesh.suspicion import (
    NACKS_MISSING,
    PROBE_UNANSWERED,
    SUSPECTED,
    Awareness,
    Suspicion,
)

MAX_DEATHS_WITHHELD = 3
"""Timeouts a suspicion may be extended by the suspect's traffic: a member that keeps
sending but never refutes (a hostile one ignoring its suspicion) is declared dead
after at most this many more, or it would stay live here and dead elsewhere."""

MAX_WAITING = 256
"""Alives held for a credential that has not arrived yet (it travels as its own
update and may come in a later message)."""


@dataclass(slots=True)
class _Probe:
    target: str
    sent_at: float
    direct_deadline: float
    final_deadline: float
    helpers: int = 0
    nacks: int = 0
    indirect_sent: bool = False


@dataclass(slots=True)
class _Relay:
    requester_address: str
    seq: int
    deadline: float


Outgoing = tuple[str, Message]


class Membership:
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
        coordinate: Callable[[], Coordinate] = Coordinate,
        estimate_rtt_s: Callable[[str, str], float | None] = lambda a, b: None,
        links_for_sync: Callable[[], list[Links]] = list,
        links_digest: Callable[[], int] = lambda: 0,
    ) -> None:
        """The callables are what the RTT map (core.mesh.rttmap) lends membership:
        this node's coordinate, an RTT estimate between two members, the link state
        to hand a syncing member, and its digest (carried on every probe)."""
        self.node = node
        self.address = address
        self.region = region
        self.name = name
        self.incarnation = min(max(0, incarnation), MAX_INCARNATION)
        self.settings = settings
        self.identities = identities
        self.rng = random.Random(seed)
        self.table = MemberTable(self.rng, settings.max_members)
        self.members = self.table.members
        self.events = self.table.events
        self.queue = GossipQueue(settings.retransmit_mult)
        self.awareness = Awareness(settings.awareness_max)
        self.coordinate = coordinate
        self.estimate_rtt_s = estimate_rtt_s
        self.rtt_samples: list[tuple[str, Coordinate, float]] = []
        """(peer, its coordinate, RTT) from direct probes, for the RTT map to take."""
        self.links_received: list[Links] = []
        """Link-state updates that arrived, for the RTT map to take."""
        self.links_for_sync = links_for_sync
        self.links_digest = links_digest
        self.leaving = False
        self.joined = True
        """False from :meth:`join` until the member joined through answers."""
        self._out: list[Outgoing] = []
        self._seq = 0
        self._probes: dict[int, _Probe] = {}
        self._heard: dict[str, float] = {}
        """When each member was last heard from (any message on its own link)."""
        self.probes_answered_by_traffic = 0
        """Probes unanswered in time whose target's traffic came meanwhile."""
        self.deaths_withheld = 0
        """Suspicions that timed out here while the suspect's traffic still came."""
        self._relays: dict[int, _Relay] = {}
        self._next_probe = now + self.rng.uniform(0, settings.probe_interval_s)
        self._next_gossip = now + settings.gossip_interval_s
        self._next_sync = now + settings.sync_interval_s * (1 + self.rng.random())
        self._next_reconnect = now + settings.reconnect_interval_s * (1 + self.rng.random())
        self._join_address: str | None = None
        self._next_join: float | None = None
        self._introduced: dict[str, float] = {}
        self._answered_sync: dict[str, float] = {}
        self._aware_refuted_at = float("-inf")
        self._links_pushed_at = float("-inf")
        self._now = now
        self._own_alive: Alive | None = None
        self._waiting: collections.OrderedDict[str, Alive] = collections.OrderedDict()
        self._returning: dict[str, Alive] = {}
        """The newest Alive of each member that left, held until ``rejoin_min_s`` after
        its departure."""
        self.refused: collections.Counter[str] = collections.Counter()
        """Updates not taken, by reason (``alive_signature``, ``no_credential``,
        ``accusation_above_incarnation``, ``table_full``...): each is either a fault or
        a member lying."""
        self.queue.put(self._self_alive())

    # -- the table --------------------------------------------------------------------------

    def _self_alive(self) -> Alive:
        own = self._own_alive
        if own is None or (own.incarnation, own.address, own.region, own.name) != (
            self.incarnation,
            self.address,
            self.region,
            self.name,
        ):
            unsigned = Alive(self.node, self.incarnation, self.address, self.region, name=self.name)
            own = dataclasses.replace(unsigned, signature=self.identities.sign(unsigned))
            self._own_alive = own
        return own

    def live(self) -> list[str]:
        """Members believed alive or suspected (not this node), sorted."""
        return self.table.live()

    def alive_view(self) -> set[str]:
        """This node and every member it believes alive or suspected."""
        return {self.node, *self.live()}

    def state_of(self, node: str) -> State | None:
        if node == self.node:
            return State.LEFT if self.leaving else State.ALIVE
        m = self.members.get(node)
        return None if m is None else m.state

    def bootstrap(self, alive: list[Alive], now: float) -> None:
        """Start with members already known alive (simulations of a formed mesh)."""
        self.table.bootstrap([a for a in alive if a.node != self.node], now)
        self.joined = True

    # -- applying updates ---------------------------------------------------------------------

    def apply(self, u: Update, now: float, sender: str | None = None) -> None:
        """Take one update; ``sender``: the member whose message carried it (its
        credential checks are bounded per sender: core.mesh.identities)."""
        if isinstance(u, Credential):
            self._on_credential(u, now, sender)
            return
        if isinstance(u, Links):
            if len(u.entries) > self.settings.link_state_max_peers:
                # No node publishes more (core.mesh.rttmap): more would ride in every sync.
                self.refused["links_too_many"] += 1
            elif self.identities.verify(u.origin, u):  # our own too: see core.mesh.rttmap
                self.links_received.append(u)
            else:
                self.refused["links_signature"] += 1
            return
        if u.node == self.node:
            self._about_me(u, now)
            return
        m = self.members.get(u.node)
        if isinstance(u, Alive):
            self._on_alive(m, u, now)
        elif isinstance(u, Left):
            if m is None or u.incarnation < m.incarnation or m.state == State.LEFT:
                return
            if not self.identities.verify(u.node, u):
                self.refused["left_signature"] += 1
                return
            m.left = u
            self.table.set_state(m, State.LEFT, u.incarnation, now)
            self.queue.put(u)
        else:
            self._on_accusation(m, u, now)

    def _on_credential(self, u: Credential, now: float, sender: str | None) -> None:
        if u.node == self.node:
            return
        if not self.identities.learn(
            u.node, u.credential, keep=self.members.__contains__, sender=sender, now=now
        ):
            self.refused["credential"] += 1
            return
        waiting = self._waiting.pop(u.node, None)
        if waiting is not None:
            self.apply(waiting, now)

    def _on_alive(self, m: Member | None, u: Alive, now: float) -> None:
        if m is not None and u.incarnation <= m.incarnation:
            return  # nothing new: no signature to check
        if not self.identities.knows(u.node):
            # Its credential may be in a later message: hold the Alive (bounded).
            self.refused["no_credential"] += 1
            self._waiting[u.node] = u
            self._waiting.move_to_end(u.node)
            while len(self._waiting) > MAX_WAITING:
                self._waiting.popitem(last=False)
            return
        if not self.identities.verify(u.node, u):
            self.refused["alive_signature"] += 1
            return
        if m is not None and m.state == State.LEFT and now < self._back_at(m):
            held = self._returning.get(u.node)
            if held is None or u.incarnation > held.incarnation:
                self._returning[u.node] = u
            self.refused["rejoin_held"] += 1
            return
        if m is None:
            if self.table.add(u, now) is None:
                self.refused["table_full"] += 1
                return
            self.queue.put(u)
            credential = self.identities.credential_of(u.node)
            if credential is not None:  # for the members that never linked to it
                self.queue.put(credential)
            return
        if u.address != m.address:
            # A node moves rarely; one that keeps moving would make every member dial
            # each new address (a member can sign any address as its own).
            if now - m.address_since < self.settings.address_change_min_s:
                self.refused["address_change_too_soon"] += 1
                return
            m.address_since = now
        m.address, m.region, m.alive, m.left = u.address, u.region, u, None
        m.name = u.name
        self.table.set_state(m, State.ALIVE, u.incarnation, now)
        self.queue.put(u)

    def _on_accusation(self, m: Member | None, u: Suspect | Dead, now: float) -> None:
        if m is None or u.incarnation < m.incarnation:
            return
        if u.incarnation > m.incarnation:
            # Its subject never signed that incarnation: a lie, or news of a
            # refutation not here yet (which its subject's Alive will bring).
            self.refused["accusation_above_incarnation"] += 1
            return
        if u.by != self.node and u.by not in self.members:
            self.refused["accuser_unknown"] += 1
            return
        if m.state == State.SUSPECT and m.suspicion is not None:
            if m.suspicion.confirm(u.by):  # a confirmation spreads as well
                self.queue.put(Suspect(m.node, m.incarnation, u.by))
        elif m.state == State.ALIVE:
            # A Dead from elsewhere is a suspicion here: this node's own timer
            # decides (see the module docstring).
            self._suspect(m, u.incarnation, u.by, now)

    def _about_me(self, u: Update, now: float) -> None:
        if self.leaving:
            return
        if isinstance(u, Alive | Left):
            # Signed by this node's key: a previous life of ours (a restart that lost
            # its incarnation file). Anything else is forged and ignored.
            if u.incarnation > self.incarnation and self.identities.verify(self.node, u):
                self._refute(u.incarnation)
            return
        assert isinstance(u, Suspect | Dead)
        if u.incarnation > self.incarnation:
            self.refused["accusation_above_incarnation"] += 1
            return
        if u.incarnation == self.incarnation:
            self._refute(u.incarnation)
        if u.by != self.node:
            # Gossip of the refutation can miss the accuser (it is probabilistic),
            # and a stale accusation is never answered by gossip again: answer the
            # accuser directly, every time it accuses.
            self._send(u.by, Gossip((self._self_alive(),)))

    def _refute(self, incarnation: int) -> None:
        self.incarnation = min(max(self.incarnation, incarnation) + 1, MAX_INCARNATION)
        # Lifeguard: being suspected hints that our own links are slow, but a member
        # that accuses us hundreds of times a second must not stretch every deadline
        # of ours to its maximum: at most once per (awareness_max + 1) probe intervals,
        # fewer than the successful probes that bring the score down again.
        s = self.settings
        if self._now - self._aware_refuted_at >= s.probe_interval_s * (s.awareness_max + 1):
            self._aware_refuted_at = self._now
            self.awareness.apply(1, SUSPECTED)
        alive = self._self_alive()
        self.queue.put(alive)
        # Straight to a few members as well: the suspicion is already spreading.
        for peer in self._gossip_targets(self.settings.gossip_fanout):
            self._send(peer, Gossip((alive,)))

    def _suspect(self, m: Member, incarnation: int, by: str, now: float) -> None:
        s = self.settings
        n = len(self.live()) + 1
        min_s = s.suspicion_mult * max(1.0, math.log10(max(n, 1))) * s.probe_interval_s
        expected = min(s.suspicion_confirmations, max(0, n - 2))
        self.table.set_state(m, State.SUSPECT, incarnation, now)
        m.suspicion = Suspicion(now, expected, min_s, s.suspicion_max_mult * min_s, by)
        update = Suspect(m.node, incarnation, by)
        self.queue.put(update)
        # Lifeguard's buddy system: tell the suspect at once so it can refute.
        self._send(m.node, Gossip((update,)))

    # -- input ------------------------------------------------------------------------------

    def handle(self, msg: Message, src_address: str, now: float) -> None:
        self._now = now
        b = msg.body
        if msg.sender not in self.members and not isinstance(b, Sync):
            self._introduce(msg.sender, src_address, now)
        if isinstance(b, Ping):
            if b.target != self.node:
                return
            self._apply_all(b.updates, now, msg.sender)
            self._reply(
                src_address,
                Ack(b.seq, self.coordinate(), self.links_digest(), self._piggyback()),
            )
            self._compare_links(msg.sender, src_address, b.links_digest, now)
        elif isinstance(b, Ack):
            self._apply_all(b.updates, now, msg.sender)
            if msg.sender in self.members:
                self._compare_links(msg.sender, src_address, b.links_digest, now)
            self._on_ack(msg.sender, b, now)
        elif isinstance(b, PingReq):
            target = self.members.get(b.target)
            if target is None or target.state > State.SUSPECT:
                self._reply(src_address, Nack(b.seq))  # probed only where it signed
                return
            seq = self._next_seq()
            timeout = self._direct_timeout(b.target)
            self._relays[seq] = _Relay(src_address, b.seq, now + timeout)
            self._reply(target.address, Ping(seq, b.target, self.coordinate(), self.links_digest()))
        elif isinstance(b, Nack):
            probe = self._probes.get(b.seq)
            if probe is not None:
                probe.nacks += 1
        elif isinstance(b, Gossip):
            self._apply_all(b.updates, now, msg.sender)
        elif isinstance(b, Sync):
            self._apply_all(b.updates, now, msg.sender)
            if b.reply:
                if not self.joined:
                    self.joined = True
                    self._next_join = None
            elif self._may_answer_sync(msg.sender, now):
                self._reply(src_address, Sync(True, self._full_state()))
            else:
                self.refused["sync_too_often"] += 1

    def _compare_links(self, peer: str, address: str, digest: int, now: float) -> None:
        """Link state rides on piggyback and can miss a node; nodes whose link-state
        digests differ push theirs to each other, so every node ends up with the same
        map and the same trees. At most one push per ``link_sync_interval_s``: in a
        large mesh digests differ all the time, and a push is the whole link state."""
        if digest == 0 or len(self.live()) >= self.settings.link_sync_max_members:
            return
        if digest == self.links_digest():
            return
        if now - self._links_pushed_at < self.settings.link_sync_interval_s:
            return
        self._links_pushed_at = now
        links: list[Update] = []
        budget = MAX_MESSAGE_BYTES // 2
        for u in self.links_for_sync():
            size = update_size(u)
            if size <= budget:
                links.append(u)
                budget -= size
        if links:
            self._reply(address, Gossip(tuple(links)))

    def _may_answer_sync(self, sender: str, now: float) -> bool:
        """A full state answers a sync at most once per ``join_retry_s`` per member:
        a 43-byte SYNC is answered with up to 64 KiB, which must not be a lever."""
        last = self._answered_sync.get(sender)
        if last is not None and now - last < self.settings.join_retry_s:
            return False
        if len(self._answered_sync) > 4096:
            self._answered_sync.clear()
        self._answered_sync[sender] = now
        return True

    def _introduce(self, sender: str, address: str, now: float) -> None:
        """A message from a member we have not heard of: the news of its arrival
        did not reach us (gossip is probabilistic). A state exchange fixes that at
        once, rather than at the next periodic sync; once per ``join_retry_s``."""
        last = self._introduced.get(sender)
        if last is not None and now - last < self.settings.join_retry_s:
            return
        if len(self._introduced) > 4096:
            self._introduced.clear()
        self._introduced[sender] = now
        self._reply(address, Sync(False, self._full_state()))

    def _apply_all(self, updates: tuple[Update, ...], now: float, sender: str) -> None:
        # Credentials first: an Alive in the same message is checked against them.
        for u in updates:
            if isinstance(u, Credential):
                self.apply(u, now, sender)
        # Of one node's Alives in a message only the newest can change anything: one
        # signature check each, not one per copy a member packed in.
        newest: dict[str, Alive] = {}
        for u in updates:
            if isinstance(u, Alive) and (
                u.node not in newest or u.incarnation > newest[u.node].incarnation
            ):
                newest[u.node] = u
        for u in updates:
            if isinstance(u, Credential) or (isinstance(u, Alive) and newest[u.node] is not u):
                continue
            self.apply(u, now)

    def _on_ack(self, sender: str, ack: Ack, now: float) -> None:
        relay = self._relays.pop(ack.seq, None)
        if relay is not None:
            self._reply(relay.requester_address, Ack(relay.seq, ack.coordinate, 0))
            return
        probe = self._probes.pop(ack.seq, None)
        if probe is None:
            return
        m = self.members.get(probe.target)
        if m is None:
            return
        m.acks += 1
        direct = sender == probe.target
        self._record_rtt(probe.target, ack.coordinate, now - probe.sent_at if direct else None, now)
        self.awareness.apply(-1)

    def _record_rtt(self, peer: str, coord: Coordinate, rtt_s: float | None, now: float) -> None:
        m = self.members.get(peer)
        if m is not None and rtt_s is not None:
            m.rtt.add(rtt_s)
            self.rtt_samples.append((peer, coord, rtt_s))

    # -- timers -------------------------------------------------------------------------------

    def get_timer(self) -> float | None:
        times = [self._next_probe, self._next_sync, self._next_reconnect]
        if self.queue.urgent():
            times.append(self._next_gossip)
        if self._next_join is not None:
            times.append(self._next_join)
        for p in self._probes.values():
            times.append(p.final_deadline if p.indirect_sent else p.direct_deadline)
        times += [r.deadline for r in self._relays.values()]
        for node in self.table.suspected:
            suspicion = self.members[node].suspicion
            if suspicion is not None:
                times.append(suspicion.deadline())
        times += [self._back_at(self.members[n]) for n in self._returning if n in self.members]
        return min(times)

    def handle_timer(self, now: float) -> None:
        self._now = now
        self._expire_probes(now)
        self._run_periodic(now)
        self._take_back(now)

    def _back_at(self, m: Member) -> float:
        # One expression for the timer and the test against it (as in core.mesh.rttmap).
        return m.since + self.settings.rejoin_min_s

    def _take_back(self, now: float) -> None:
        """The held Alives of members that left whose time has come."""
        for node in list(self._returning):
            m = self.members.get(node)
            if m is None or m.state != State.LEFT:  # reaped, or back by another way
                del self._returning[node]
            elif now >= self._back_at(m):
                self._on_alive(m, self._returning.pop(node), now)

    def _expire_probes(self, now: float) -> None:
        """Probes, relays and suspicions whose deadline has passed."""
        for seq, probe in list(self._probes.items()):
            if not probe.indirect_sent and now >= probe.direct_deadline:
                self._go_indirect(seq, probe, now)
            elif probe.indirect_sent and now >= probe.final_deadline:
                del self._probes[seq]
                self._probe_failed(probe, now)
        for seq, relay in list(self._relays.items()):
            if now >= relay.deadline:
                del self._relays[seq]
                self._reply(relay.requester_address, Nack(relay.seq))
        for node in list(self.table.suspected):
            m = self.members[node]
            if m.suspicion is not None and now >= m.suspicion.deadline():
                suspicion = m.suspicion
                if (
                    self._heard_since(node, suspicion.started_at)
                    and suspicion.withheld < MAX_DEATHS_WITHHELD
                ):
                    # Alive by its traffic: not dead by our word yet; it has another
                    # timeout to refute, and others may still declare it.
                    self.deaths_withheld += 1
                    suspicion.withheld += 1
                    suspicion.started_at = now
                    continue
                dead = Dead(m.node, m.incarnation, self.node)
                self.table.set_state(m, State.DEAD, m.incarnation, now)
                self.queue.put(dead)

    def _run_periodic(self, now: float) -> None:
        """The fixed-interval duties: probe, gossip, sync, reconnect, join retry."""
        s = self.settings
        if now >= self._next_probe:
            self._next_probe = now + self.awareness.scale(s.probe_interval_s)
            if not self.leaving:
                self._probe(now)
        if now >= self._next_gossip:
            self._next_gossip = now + s.gossip_interval_s
            if self.queue.urgent():
                self._gossip()
        if now >= self._next_sync:
            self._next_sync = now + s.sync_interval_s
            live = self.live()
            if live:
                self._send(self.rng.choice(live), Sync(False, self._full_state()))
        if now >= self._next_reconnect:
            self._next_reconnect = now + s.reconnect_interval_s
            self._reconnect(now)
            self.table.reap(now, s.dead_reap_s)
        if self._next_join is not None and now >= self._next_join and self._join_address:
            self._next_join = now + s.join_retry_s
            self._reply(self._join_address, Sync(False, self._full_state()))

    # -- probing ------------------------------------------------------------------------------

    def _direct_timeout(self, node: str) -> float:
        s = self.settings
        m = self.members.get(node)
        if m is None or m.rtt.smoothed_s is None or m.rtt.var_s is None:
            est = self.estimate_rtt_s(self.node, node)
            base = s.probe_timeout_initial_s if est is None else 2 * est + s.probe_margin_s
        else:
            base = m.rtt.smoothed_s + 4 * m.rtt.var_s + s.probe_margin_s
        base = min(s.probe_timeout_max_s, max(s.probe_timeout_min_s, base))
        return self.awareness.scale(base)

    def _probe(self, now: float) -> None:
        target = self.table.next_probe_target()
        if target is None:
            return
        m = self.members[target]
        seq = self._next_seq()
        timeout = self._direct_timeout(target)
        self._probes[seq] = _Probe(target, now, now + timeout, now + 2 * timeout)
        m.probes += 1
        updates = self._piggyback()
        if m.state == State.SUSPECT:  # the buddy system again, on every probe
            updates = (Suspect(target, m.incarnation, self.node), *updates)
        self._send(target, Ping(seq, target, self.coordinate(), self.links_digest(), updates))

    def _go_indirect(self, seq: int, probe: _Probe, now: float) -> None:
        probe.indirect_sent = True
        candidates = [n for n in self.live() if n != probe.target]
        helpers = self.rng.sample(candidates, min(self.settings.indirect_probes, len(candidates)))
        target = self.members.get(probe.target)
        if target is None:
            probe.final_deadline = now
            return
        window = 0.0
        for h in helpers:
            via = self.estimate_rtt_s(h, probe.target)
            leg = self.settings.probe_timeout_initial_s if via is None else 2 * via
            window = max(window, self._direct_timeout(h) + leg)
            self._send(h, PingReq(seq, probe.target, target.address))
        probe.helpers = len(helpers)
        probe.final_deadline = now + max(window, probe.direct_deadline - probe.sent_at)

    def heard(self, node: str, now: float) -> None:
        """A message from ``node`` came on its own authenticated link at ``now``."""
        if node in self.members:
            self._heard[node] = now
            if len(self._heard) > 2 * len(self.members) + 64:  # forgotten members' go
                self._heard = {n: t for n, t in self._heard.items() if n in self.members}

    def _heard_since(self, node: str, since: float) -> bool:
        heard = self._heard.get(node)
        return heard is not None and heard >= since

    def _probe_failed(self, probe: _Probe, now: float) -> None:
        if self._heard_since(probe.target, probe.sent_at):
            self.probes_answered_by_traffic += 1  # answered, late: not our links' fault
            return
        # Lifeguard: helpers that did not even send a nack point at our own links.
        if probe.helpers:
            self.awareness.apply(probe.helpers - probe.nacks, NACKS_MISSING)
        else:
            self.awareness.apply(1, PROBE_UNANSWERED)
        m = self.members.get(probe.target)
        if m is None:
            return
        if m.state == State.ALIVE:
            self._suspect(m, m.incarnation, self.node, now)
        elif m.state == State.SUSPECT and m.suspicion and m.suspicion.confirm(self.node):
            self.queue.put(Suspect(m.node, m.incarnation, self.node))

    # -- gossip, sync, join, leave --------------------------------------------------------------

    def _gossip_targets(self, k: int) -> list[str]:
        pool = self.live()
        if self.table.recent_dead:
            horizon = self.settings.gossip_to_dead_s
            pool = pool + [n for n, t in self.table.recent_dead.items() if self._now - t <= horizon]
        return self.rng.sample(pool, min(k, len(pool)))

    def _gossip(self) -> None:
        for peer in self._gossip_targets(self.settings.gossip_fanout):
            updates = self._piggyback(budget=MAX_MESSAGE_BYTES // 4)
            if not updates:
                break
            self._send(peer, Gossip(updates))

    def _piggyback(self, budget: int | None = None) -> tuple[Update, ...]:
        n = len(self.members) + 1
        return tuple(self.queue.take(budget or self.settings.piggyback_bytes, n))

    def _full_state(self) -> tuple[Update, ...]:
        """This node's view, member by member (each with its credential, so that the
        receiver can check what the member signed), then link state; what does not fit
        one message is left out whole, member by member."""
        groups: list[list[Update]] = [[Credential(self.node, self.identities.credential),
                                       self._self_alive()]]  # fmt: skip
        for node, records in self.table.records(self.node):
            credential = self.identities.credential_of(node)
            groups.append(([] if credential is None else [credential]) + records)
        groups += [[links] for links in self.links_for_sync()]
        budget = MAX_MESSAGE_BYTES - 256
        kept: list[Update] = []
        for group in groups:
            if budget < 512:  # no member's group is smaller: stop encoding
                break
            size = sum(update_size(u) for u in group)
            if size <= budget:
                kept += group
                budget -= size
        return tuple(kept)

    def join(self, address: str, now: float) -> None:
        """Join through the member at ``address``; retried until it answers."""
        self._now = now
        self._join_address = address
        self.joined = False
        self._next_join = now + self.settings.join_retry_s
        self._reply(address, Sync(False, self._full_state()))

    def leave(self, now: float) -> None:
        """Announce a graceful departure; the caller keeps running the machine until
        :meth:`left_spread` or ``leave_propagate_s`` passes, then stops it."""
        self._now = now
        self.leaving = True
        unsigned = Left(self.node, self.incarnation)
        update = dataclasses.replace(unsigned, signature=self.identities.sign(unsigned))
        self.queue.put(update)
        for peer in self.live():
            self._send(peer, Gossip((update,)))

    def left_spread(self) -> bool:
        return self.leaving and not self.queue.pending("member:" + self.node)

    def force_leave(self, node: str, now: float) -> str | None:
        """Take a member that failed (declared dead) as departed now, on this node's
        word (``ciuic-node force-leave``, serf's): it is no longer reconnected to,
        gossiped to or shown as failed, and is forgotten with the departed after
        ``dead_reap_s``. Nothing is gossiped: a departure counts only with its own
        signature (module docstring), so each node forces its own. A member forced out
        that comes back with a newer incarnation is taken back as one that left.
        Why it was refused (None: done, or it had left already): one that may still be
        alive (alive or suspected) is never forced out, nor an unknown one."""
        self._now = now
        if node == self.node:
            return "that is this node itself: `leave` makes it leave"
        m = self.members.get(node)
        if m is None:
            return f"{node} is not a member this node knows"
        if m.state <= State.SUSPECT:
            return f"{node} is {m.state.name.lower()}: only a failed (dead) member is forced out"
        if m.state == State.DEAD:
            self.table.set_state(m, State.LEFT, m.incarnation, now)
        return None

    def _reconnect(self, now: float) -> None:
        dead = [
            n for n, t in self.table.recent_dead.items() if now - t <= self.settings.dead_reap_s
        ]
        if dead:
            m = self.members[self.rng.choice(sorted(dead))]
            self._reply(m.address, Sync(False, self._full_state()))

    # -- output ---------------------------------------------------------------------------------

    def _next_seq(self) -> int:
        self._seq = (self._seq + 1) & 0xFFFFFFFF
        return self._seq

    def _send(self, node: str, body: Ping | Gossip | PingReq | Sync) -> None:
        m = self.members.get(node)
        if m is not None:
            self._reply(m.address, body)

    def _reply(self, address: str, body: Ping | Ack | PingReq | Nack | Gossip | Sync) -> None:
        self._out.append((address, Message(self.node, body)))

    def messages_to_send(self) -> list[Outgoing]:
        out, self._out = self._out, []
        return out
