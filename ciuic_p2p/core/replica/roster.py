"""Who the replicas of a run are, and where each stands: the mesh members alive whose
trainer said it trains this run (a JOIN, or any message of the run). A member without
a trainer, or with one of another run, is not waited for and not counted in N."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

MAX_ACCOUNTS_AWAY = 4096
"""Accounts kept for origins that are not replicas here now (members departed, or not
yet known alive): past it, what such an origin sends is applied but not accounted to
it. Origins are admitted members, so this bounds memory against a churning mesh."""


@dataclass(slots=True)
class PeerState:
    step: int = 0
    """How far this origin is known to be: its newest chunk applied or kept here, or
    the step its JOIN claimed (all replicas start at step 0). Staleness and settlement
    read it; it is no record of what the parameters hold (:attr:`applied_step`)."""
    applied_step: int = 0
    """Newest update step of this origin applied here: what a state snapshot says it
    holds. A JOIN's claim runs ahead of the chunks still on their way, and a state
    that claimed them would have its joiner drop them for good."""
    done_at: int | None = None
    chunks_sent: int = 0
    """Update chunks the origin says it sent (from its DONE)."""
    applied: int = 0
    """Update chunks of this origin applied here."""
    refused: int = 0
    """Chunks of this origin refused here (duplicates not counted)."""
    held_by_state: int = 0
    """Chunks of this origin dropped because the state restored here already held them:
    accounted for like applied ones (a late joiner waited for them forever at finish)."""
    at_step: int = 0
    at_step_count: int = 0
    """How many of this origin's chunks of step :attr:`at_step` (its newest applied or
    held) reached the parameters: a state snapshot says it, so that a replica restored
    from it counts the rest of that step's chunks when they arrive."""
    reported: bool = False
    """It told its step (a JOIN) since it was registered here."""
    excusals: int = 0
    """Times it was excused; past two it is not waited for again (it is still applied)."""
    lagging: bool = False
    """Excused: past the staleness bound for longer than the grace; not waited for,
    and not waited for by settlement, until its chunks are back within the bound."""

    def reached(self, step: int) -> None:
        """One chunk of ``step`` reached the parameters (applied, or held by a state)."""
        if step > self.at_step:
            self.at_step, self.at_step_count = step, 0
        if step == self.at_step:
            self.at_step_count += 1


MAX_STATELESS = 4096
"""Origins remembered as handing no state (one entry a member)."""


class Roster:
    """The other replicas of this one's run."""

    def __init__(self, me: str, staleness_bound_steps: int) -> None:
        self.me = me
        self.staleness_bound_steps = staleness_bound_steps
        self.peers: dict[str, PeerState] = {}
        self.mesh_alive: set[str] = set()
        self.stateless: set[str] = set()
        """Origins whose JOIN said they hand no state (sharded replicas)."""
        self.joined: list[str] = []
        """Replicas registered since the caller last cleared this (it answers JOIN)."""
        self.early_joins: dict[str, tuple[int, bool]] = {}
        """JOINs (step, ask) of members not yet known alive here (at most one per
        member), taken when they are."""
        self._gone: set[str] = set()
        self.departed: dict[str, PeerState] = {}
        """Replicas whose member left the mesh with their trainer still on (a daemon
        restarting, a partition): their accounts, taken up again when they are back, so
        that what they sent before and after adds up to what their DONE says; also
        origins heard before they are known alive (:meth:`account`). Bounded by the
        members ever seen alive and :data:`MAX_ACCOUNTS_AWAY`; dropped on GONE."""
        self.cut_off: set[str] = set()
        """Replicas this one lost touch with when its own daemon went away (a
        restart), through no fault of theirs: they count in N until each is heard
        again (see :meth:`counted_names`)."""
        self.back_step: int | None = None
        """This replica's step when its daemon came back (None: away, or never)."""
        self._heard_since_back: set[str] = set()

    @property
    def replicas(self) -> int:
        """N: this replica and the others."""
        return 1 + len(self.peers)

    def set_alive(self, members: Iterable[str], step: int) -> None:
        """The mesh members alive now (``step``: this replica's)."""
        self.mesh_alive = set(members) - {self.me}
        for name in list(self.peers):
            if name not in self.mesh_alive:
                self.departed[name] = self.peers.pop(name)
        for name in [n for n in self.early_joins if n in self.mesh_alive]:
            joined = self.replica(name)
            if joined is not None:
                self._take_join(name, joined, *self.early_joins[name], step)
            del self.early_joins[name]

    def lose_touch(self) -> None:
        """This replica's own daemon went away: every replica it had is cut off from
        it, through no fault of theirs, until the gap is repaired."""
        self.cut_off |= set(self.peers)
        self.back_step = None

    def touch_back(self, step: int) -> None:
        """Its daemon is back at ``step``."""
        self.back_step = step
        self._heard_since_back.clear()

    def counted_names(self) -> set[str]:
        """The other replicas N counts: those registered here, and those cut off
        while this replica's daemon was away and not heard since. Its new daemon's
        first member list holds itself alone: N fell to 1 there, and the chunks that
        claimed it were kept at 1 here where the others took them at 1/2."""
        return self.cut_off | self.peers.keys()

    def release_cut_off(self, step: int) -> None:
        """Forget the cut-off replicas heard again since the daemon came back, and
        all of them twice the staleness bound after it (one that died meanwhile
        sends nothing more: its GONE went with the old daemon)."""
        back = self.back_step
        if not self.cut_off or back is None:
            return
        if step >= back + 2 * self.staleness_bound_steps:
            self.cut_off.clear()
        else:
            self.cut_off -= self._heard_since_back | self._gone
        if not self.cut_off:
            self._heard_since_back.clear()

    def replica(self, origin: str) -> PeerState | None:
        """The state of a replica of this run, registering it on first word; None for
        a member that is not alive or whose trainer went away (a late chunk of a
        removed replica does not bring it back)."""
        state = self.peers.get(origin)
        if state is None and origin in self.mesh_alive and origin not in self._gone:
            back = self.departed.pop(origin, None)
            state = self.peers[origin] = back if back is not None else PeerState()
            self.joined.append(origin)
        if state is not None and self.back_step is not None and origin in self.cut_off:
            self._heard_since_back.add(origin)
        return state

    def account(self, origin: str) -> PeerState | None:
        """The account of ``origin``'s trainer life here, whether it is a replica now or
        not: a restarting daemon's first member list, or gossip that lags the chunks it
        delivers, leaves an origin out for a while, and what it sent meanwhile must
        still add up to its DONE. Registers it as a replica when it is one (see
        :meth:`replica`); None once its trainer said GONE (a late chunk of that life
        belongs to no account) or past :data:`MAX_ACCOUNTS_AWAY`."""
        state = self.replica(origin)
        if state is not None or origin in self._gone:
            return state
        away = self.departed.get(origin)
        if away is None and len(self.departed) < MAX_ACCOUNTS_AWAY:
            away = self.departed[origin] = PeerState()
        return away

    def existing_account(self, origin: str) -> PeerState | None:
        """``origin``'s account if it has one, registering nothing (a refused chunk
        makes no one a replica)."""
        return self.peers.get(origin) or self.departed.get(origin)

    def join(self, origin: str, origin_step: int, ask: bool, step: int) -> None:
        """A JOIN of this run: where the replica stands (one still syncing is not
        waited for); ``ask``: it wants this replica's JOIN in answer."""
        self._gone.discard(origin)  # a restarted trainer joins again
        joined = self.replica(origin)
        if joined is not None:
            self._take_join(origin, joined, origin_step, ask, step)
        elif origin not in self.mesh_alive:
            # The daemon's word that it is alive can come after its JOIN (a replica
            # that has attached may not say JOIN again for a long while).
            self.early_joins[origin] = (origin_step, ask)

    def note_stateless(self, origin: str, stateless: bool) -> None:
        """Whether ``origin`` said (its JOIN) that it hands no state to joiners."""
        if stateless:
            if len(self.stateless) < MAX_STATELESS:
                self.stateless.add(origin)
        else:
            self.stateless.discard(origin)

    def gone(self, origin: str) -> None:
        """Its trainer went away (GONE): no longer a replica, until it joins again."""
        self._gone.add(origin)
        self.peers.pop(origin, None)
        self.departed.pop(origin, None)

    def _take_join(
        self, origin: str, joined: PeerState, origin_step: int, ask: bool, step: int
    ) -> None:
        joined.step = max(joined.step, origin_step)
        joined.lagging = joined.step <= step - self.staleness_bound_steps
        joined.reported = True
        if ask and origin not in self.joined:
            self.joined.append(origin)
