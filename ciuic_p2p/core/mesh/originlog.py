"""What one node holds of one origin's numbered chunks (core.mesh.broadcast): the
contiguous prefix, the chunks held above a gap, the numbers known or claimed missing
and when, whom each was asked of, and the members that announced the origin last.
Pure bookkeeping, bounded per origin: the dissemination state machine decides what to
send from it.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from ciuic_p2p.core.mesh.lag import LagEstimator

REORDER_WINDOW = 64
"""On first hearing of an origin at sequence s, chunks from s - 64 on are expected."""
CLAIM_AHEAD = REORDER_WINDOW
"""Numbers past the highest chunk held here that are tracked as missing on an
announcer's word: a claim far ahead (a member's HEADS of 2^40 - 1, true or not) costs
this many entries, and the window moves up as signed chunks arrive."""
MAX_GAP = 4096
"""Missing sequence numbers tracked per origin at a time: an announcement (or a chunk)
far ahead is tracked this far past the contiguous prefix and further as the gap
fills, so that one message (a faulty member's HEADS of 2^40, say) costs bounded work
and memory, and a node far behind repairs in windows."""


class Holders:
    """The last few members that announced an origin's chunks, asked in turn: a member
    that re-announces every head right after the honest ones cannot draw every repair
    request to itself and answer none."""

    def __init__(self, size: int = 4) -> None:
        self._recent: collections.deque[str] = collections.deque(maxlen=size)
        self._turn = 0

    def note(self, node: str) -> None:
        if node not in self._recent:
            self._recent.append(node)

    def merge(self, other: Holders) -> None:
        for node in other._recent:
            self.note(node)

    def next(self) -> str | None:
        if not self._recent:
            return None
        self._turn += 1
        return self._recent[self._turn % len(self._recent)]


@dataclass(slots=True)
class OriginLog:
    contiguous: int
    """Every chunk up to and including this one was delivered (or given up)."""
    session: int = 0
    above: set[int] = field(default_factory=set)
    high: int = 0
    """Highest sequence number announced (a claim until a signed chunk shows it)."""
    held_high: int = 0
    """Highest sequence number held here (every number below it exists: the origin
    numbers its chunks one by one)."""
    tracked: int = 0
    """Highest sequence number entered in ``missing_since`` (or known held)."""
    high_by: str = ""
    """The announcer whose claim set ``high``."""
    missing_since: dict[int, float] = field(default_factory=dict)
    requested_at: dict[int, float] = field(default_factory=dict)
    asks: dict[int, int] = field(default_factory=dict)
    """WANTs sent for each missing number so far."""
    asked_of: dict[int, str] = field(default_factory=dict)
    """The holder each missing number was last asked of."""
    known_at: dict[int, float] = field(default_factory=dict)
    """When each missing number was known to exist on more than one member's word (a
    signed chunk of it or above, or a second announcer): where a lag sample starts.
    One member's claim alone would let it start every sample early (claim numbers
    ahead of the origin, and every honest copy of them seems late)."""
    claimed_by: dict[int, str] = field(default_factory=dict)
    """Missing numbers known on one announcer's word only: that announcer."""
    tree_sender: str = ""
    """The sender of this origin's last first-arriving tree copy: only its late
    copies of a repaired chunk are samples (anyone holding a chunk could replay it)."""
    holders: Holders = field(default_factory=Holders)
    tree_lag: LagEstimator = field(default_factory=LagEstimator)
    """How late this origin's tree copies come after they are known missing."""

    def has(self, seq: int) -> bool:
        return seq <= self.contiguous or seq in self.above

    def add(self, seq: int) -> None:
        self.above.add(seq)
        while self.contiguous + 1 in self.above:
            self.contiguous += 1
            self.above.discard(self.contiguous)
        self.forget_missing(seq)
        self.high = max(self.high, seq)
        self.held_high = max(self.held_high, seq)

    def forget_missing(self, seq: int) -> None:
        for table in (
            self.missing_since,
            self.requested_at,
            self.asks,
            self.asked_of,
            self.known_at,
            self.claimed_by,
        ):
            table.pop(seq, None)

    def confirm(self, upto: int, by: str | None, now: float) -> None:
        """Missing numbers up to ``upto`` are known to exist: on a signed chunk's word
        (``by`` None) or on announcer ``by``'s, which counts for the numbers another
        announcer claimed first."""
        for seq in [q for q, c in self.claimed_by.items() if q <= upto and c != by]:
            del self.claimed_by[seq]
            self.known_at.setdefault(seq, now)

    def give_up_oldest_gap(self) -> int:
        """Skip to the lowest chunk held above the gap; how many were given up."""
        first = min(self.above)
        skipped = first - 1 - self.contiguous
        self.contiguous = first - 1
        for q in [q for q in self.missing_since if q <= first]:
            self.forget_missing(q)
        self.add(first)
        return skipped

    def track(self, now: float) -> bool:
        """Enter the unknown sequence numbers up to ``high`` as missing, at most
        ``CLAIM_AHEAD`` past the highest held and ``MAX_GAP`` past the contiguous
        prefix; True if any is missing."""
        held = max(self.held_high, self.contiguous)
        end = min(self.high, held + CLAIM_AHEAD, self.contiguous + MAX_GAP)
        for seq in range(max(self.contiguous, self.tracked) + 1, end + 1):
            if seq not in self.above and seq not in self.missing_since:
                self.missing_since[seq] = now
                if seq < self.held_high:  # a signed chunk above it is held
                    self.known_at[seq] = now
                else:
                    self.claimed_by[seq] = self.high_by
        self.tracked = max(self.tracked, end)
        return bool(self.missing_since)
