"""Which link to send a rate probe down, and when: the active half of link-rate
measurement (core.link.throughput is the passive half). Pure: the daemon asks with
``now`` and the published rates; it sends the filler and lifts the link's pace.

A link's rate is measured only from what it carries, and a reading is what the link
carried then, not what it can carry:

- a link no transfer crossed has no reading at all (``default_rate_bps`` stands in);
- a link the strategy in force leaves idle keeps the reading of whatever last crossed
  it, often a first frame in QUIC's slow start;
- a link measured only while its sender's uplink fed several links at once reads that
  uplink's share, and a paced link reads no faster than its pace, so it climbs by at
  most ``pace_gain`` a reading.

On the multi-cloud matrix (every pair 10 Mbit/s, as every uplink, in
bench/strategy.py) the published rates after two tree rounds ranged 1.1-10 Mbit/s, and
the ring's links, which the tree uses little, stayed at 1.1-3 Mbit/s: the cost model
put the ring level with the tree, though the ring's own runs were 1.3-1.6x faster.

So a link is probed when no one has measured it, or when it reads below ``below``
times the second fastest link this node's peers have published from it (capped at
what the node may assume of any link): then ``probe_bytes`` of filler go down it alone, unpaced,
while this node sends nothing else, and the receiver times them as any bulk frame.
Bounded: one link at a time, each at most once per ``interval_s``; a link that still
reads low (or unmeasured) after its probe is waited on twice as long each time (up to
``MAX_BACKOFF`` times the interval), and a peer that leaves and rejoins keeps its
wait: it is slow, not unmeasured.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

MAX_BACKOFF = 8
"""A link that reads low (or stays unmeasured) after probe upon probe is probed at
most every this many intervals."""
MIN_WINDOW_RATE_BPS = 1e6
"""The slowest a probe is taken to cross when its link's pace is lifted for it."""
MAX_UNPACED_S = 10.0
"""The longest a link goes unpaced for one probe."""


@dataclass(frozen=True, slots=True)
class Probe:
    """Send ``nbytes`` of filler to ``peer`` now, unpaced until ``unpaced_until``."""

    peer: str
    nbytes: int
    unpaced_until: float
    reason: str
    """``unmeasured`` (no published rate) or ``low`` (below the node's best link)."""


class RateProbes:
    """The probe schedule of one node's links (see the module docstring)."""

    def __init__(
        self, probe_bytes: int, interval_s: float, below: float, ceiling_bps: float
    ) -> None:
        self.probe_bytes = max(0, probe_bytes)
        self.interval_s = interval_s
        self.below = below
        self.ceiling_bps = ceiling_bps
        """The most any link is taken to carry (the node's uplink, or the rate assumed
        of an unmeasured link): the yardstick never reads above it."""
        self._probed_at: dict[str, float] = {}
        self._backoff: dict[str, int] = {}
        self._unpaced_until: dict[str, float] = {}
        self.sent = {"unmeasured": 0, "low": 0}

    def choose(
        self,
        now: float,
        published: Mapping[str, float | None],
        ready: Collection[str],
        idle: bool,
    ) -> Probe | None:
        """The probe to send now, if any. ``published``: the rate each live peer
        published for the link from this node (None: not measured); ``ready``: the
        peers with a link up and no bulk data waiting for them; ``idle``: this node
        sends nothing else (no bulk queued or unacknowledged on any link)."""
        if self.probe_bytes <= 0:
            return None
        self._forget_departed(published, now)
        yardstick = self._yardstick(published)
        for peer in sorted(published):  # one order on every call: no link starves
            rate = published[peer]
            low = rate is not None and yardstick is not None and rate < self.below * yardstick
            if rate is not None and not low:
                self._backoff.pop(peer, None)  # reads as well as the rest now
                continue
            if peer not in ready or (low and not idle):
                continue
            reason = "low" if low else "unmeasured"
            last = self._probed_at.get(peer)
            if last is not None and now - last < self.interval_s * self._backoff.get(peer, 1):
                continue
            if last is not None:  # probed before, and still unmeasured or low
                self._backoff[peer] = min(MAX_BACKOFF, 2 * self._backoff.get(peer, 1))
            self._probed_at[peer] = now
            # While the probe crosses at the link's reading (a low one, or the ceiling
            # where none), twice over, plus a second: the pace comes back after it.
            pace_bps = max(rate or self.ceiling_bps, MIN_WINDOW_RATE_BPS)
            span_s = min(MAX_UNPACED_S, 2 * self.probe_bytes * 8 / pace_bps + 1.0)
            self._unpaced_until[peer] = now + span_s
            self.sent[reason] += 1
            return Probe(peer, self.probe_bytes, now + span_s, reason)
        return None

    def _forget_departed(self, published: Mapping[str, float | None], now: float) -> None:
        """A peer that left stays remembered until its longest wait is over: one that
        leaves and rejoins must not draw a probe each time."""
        for peer in [p for p in self._unpaced_until if p not in published]:
            del self._unpaced_until[peer]
        horizon_s = self.interval_s * MAX_BACKOFF
        for peer in [p for p in self._probed_at if p not in published]:
            if now - self._probed_at[peer] >= horizon_s:
                self._probed_at.pop(peer)
                self._backoff.pop(peer, None)

    def unpaced(self, peer: str, now: float) -> bool:
        """Whether the link to ``peer`` carries a probe now (its pace is lifted, so
        the probe can read above the rate that set it)."""
        until = self._unpaced_until.get(peer)
        if until is None:
            return False
        if now >= until:
            del self._unpaced_until[peer]
            return False
        return True

    def _yardstick(self, published: Mapping[str, float | None]) -> float | None:
        """The second fastest link (the fastest when there is one), at most the
        ceiling: one member that claims a fast link from this node cannot make every
        other link look slow and draw probes down all of them."""
        rates = sorted(r for r in published.values() if r is not None and r > 0)
        if not rates:
            return None
        return min(rates[-2] if len(rates) > 1 else rates[-1], self.ceiling_bps)
