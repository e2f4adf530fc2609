"""The member table: what one node believes about every other member, and the
bookkeeping that protocol steps need fast (core.mesh.membership owns the protocol).

Besides the members themselves the table keeps the sets the timers need without a
scan of every member (a thousand in the scale benchmark): who is suspected, who died
recently, the sorted list of live members, and the shuffled round-robin probe order
(SWIM's: every member probed once per round; a member that comes alive is inserted
at a random place).
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass, field

from ciuic_p2p.core.link.rtt import RttEstimator
from ciuic_p2p.core.mesh.messages import Alive, Dead, Left, Suspect, Update
from ciuic_p2p.core.mesh.suspicion import Suspicion


class State(enum.IntEnum):
    """Ordered: at equal incarnation a later state overrides an earlier one."""

    ALIVE = 0
    SUSPECT = 1
    DEAD = 2
    LEFT = 3


@dataclass(slots=True)
class Member:
    node: str
    address: str
    region: str
    incarnation: int
    state: State
    since: float
    """When the member entered its current state (this node's clock)."""
    rtt: RttEstimator = field(default_factory=RttEstimator)
    probes: int = 0
    acks: int = 0
    suspicion: Suspicion | None = None
    alive: Alive | None = None
    """The member's newest signed announcement (forwarded as it is: nobody else can
    sign it)."""
    left: Left | None = None
    """Its signed departure, once it left."""
    address_since: float = float("-inf")
    """When this node last took a new address for it (its first is not a change)."""
    name: str = ""
    """The name it signed in its newest ALIVE ("" when it gave none)."""


@dataclass(frozen=True, slots=True)
class MemberEvent:
    at: float
    node: str
    state: State
    incarnation: int


class MemberTable:
    def __init__(self, rng: random.Random, max_members: int = 1 << 30) -> None:
        self.rng = rng
        self.max_members = max_members
        """Members held at most (core.mesh.membership refuses new ones past it, once no
        dead or departed one is left to forget)."""
        self.members: dict[str, Member] = {}
        self.events: list[MemberEvent] = []
        self.suspected: set[str] = set()
        self.recent_dead: dict[str, float] = {}
        self._live: list[str] | None = None
        self._probe_order: list[str] = []
        self._probe_index = 0

    def live(self) -> list[str]:
        """Members believed alive or suspected, sorted."""
        if self._live is None:
            self._live = sorted(n for n, m in self.members.items() if m.state <= State.SUSPECT)
        return self._live

    def add(self, update: Alive, now: float) -> Member | None:
        """A member first heard of, alive; None when the table is full (the oldest
        dead or departed member is forgotten first to make room)."""
        if len(self.members) >= self.max_members and not self._make_room():
            return None
        m = Member(update.node, update.address, update.region, update.incarnation, State.DEAD, now)
        m.alive, m.name = update, update.name
        self.members[update.node] = m
        self.set_state(m, State.ALIVE, update.incarnation, now)
        return m

    def _make_room(self) -> bool:
        gone = [m for m in self.members.values() if m.state >= State.DEAD]
        if not gone:
            return False
        oldest = min(gone, key=lambda m: m.since)
        del self.members[oldest.node]
        self.recent_dead.pop(oldest.node, None)
        self._live = None
        return True

    def set_state(self, m: Member, state: State, incarnation: int, now: float) -> None:
        changed = m.state != state
        m.state, m.incarnation = state, incarnation
        if state == State.SUSPECT:
            self.suspected.add(m.node)
        else:
            m.suspicion = None
            self.suspected.discard(m.node)
        if state == State.DEAD:
            self.recent_dead[m.node] = now
        else:
            self.recent_dead.pop(m.node, None)
        if changed:
            m.since = now
            self._live = None
            self.events.append(MemberEvent(now, m.node, state, incarnation))
            if state <= State.SUSPECT and m.node not in self._probe_order:
                self._probe_order.insert(self.rng.randint(0, len(self._probe_order)), m.node)

    def bootstrap(self, alive: list[Alive], now: float) -> None:
        for a in alive:
            self.members[a.node] = Member(
                a.node, a.address, a.region, a.incarnation, State.ALIVE, now, alive=a, name=a.name
            )
            self._probe_order.append(a.node)
        self.rng.shuffle(self._probe_order)
        self._live = None

    def next_probe_target(self) -> str | None:
        """The next live member in the round-robin order (reshuffled each round)."""
        for _ in range(len(self._probe_order) + 1):
            if self._probe_index >= len(self._probe_order):
                self._probe_order = [n for n in self._probe_order if self._probeable(n)]
                self.rng.shuffle(self._probe_order)
                self._probe_index = 0
                if not self._probe_order:
                    return None
            node = self._probe_order[self._probe_index]
            self._probe_index += 1
            if self._probeable(node):
                return node
        return None

    def _probeable(self, node: str) -> bool:
        m = self.members.get(node)
        return m is not None and m.state <= State.SUSPECT

    def reap(self, now: float, horizon_s: float) -> None:
        """Forget members dead or gone for longer than ``horizon_s``."""
        gone = [
            n
            for n, m in self.members.items()
            if m.state >= State.DEAD and now - m.since > horizon_s
        ]
        for n in gone:
            del self.members[n]
            self.recent_dead.pop(n, None)
            self._live = None

    def records(self, by: str) -> list[tuple[str, list[Update]]]:
        """Every member as the updates that state what we believe (for a sync), by
        member: its signed Alive, then our accusation or its signed departure. The
        Alive goes with an accusation too: a member that lost its disk and restarted
        below the incarnation we know learns from it what it was (core.mesh.membership)."""
        out: list[tuple[str, list[Update]]] = []
        for m in self.members.values():
            group: list[Update] = [] if m.alive is None else [m.alive]
            if m.state == State.SUSPECT:
                group.append(Suspect(m.node, m.incarnation, by))
            elif m.state == State.DEAD:
                group.append(Dead(m.node, m.incarnation, by))
            elif m.state == State.LEFT and m.left is not None:
                group.append(m.left)
            if group:
                out.append((m.node, group))
        return out
