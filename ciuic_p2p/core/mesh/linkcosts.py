"""What a round's plans are made from and what they are: the published state of the
links (:class:`LinkCosts`: one-way delays, link rates, what a node's uplink shares) and
one strategy's trees (:class:`Plan`). Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

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
