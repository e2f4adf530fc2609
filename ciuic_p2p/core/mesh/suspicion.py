"""Lifeguard's two local-health mechanisms (Dadgar et al., "Lifeguard: Local Health
Awareness for More Accurate Failure Detection", 2018), as memberlist implements them.

- :class:`Suspicion`: a suspicion's timeout starts at ``max_s`` and shrinks towards
  ``min_s`` as independent members confirm it:
  ``timeout(C) = max(min_s, max_s - (max_s - min_s) * log(C + 1) / log(K + 1))``
  for C confirmations of K expected. A lone, possibly sick prober thus waits long; a
  failure that several members see is declared fast.
- :class:`Awareness`: the local health multiplier. A node that misses acks and nacks
  or must refute suspicions of itself is probably the slow one (CPU starved, lossy
  uplink); it scales its probe timeouts and interval by ``score + 1`` so that it does
  not accuse healthy peers.
"""

from __future__ import annotations

import math


class Suspicion:
    def __init__(
        self, started_at: float, expected: int, min_s: float, max_s: float, by: str
    ) -> None:
        self.started_at = started_at
        self.expected = max(0, expected)
        self.min_s = min_s
        self.max_s = max(max_s, min_s)
        self.confirmed_by = {by}
        self.confirmations = 0
        self.withheld = 0
        """Times this node extended it because the suspect's traffic still came."""

    def confirm(self, by: str) -> bool:
        """A new independent suspicion; True if it counted (first from ``by``)."""
        if by in self.confirmed_by or self.confirmations >= self.expected:
            return False
        self.confirmed_by.add(by)
        self.confirmations += 1
        return True

    def timeout_s(self) -> float:
        if self.expected <= 0:
            return self.min_s
        frac = math.log(self.confirmations + 1) / math.log(self.expected + 1)
        return max(self.min_s, self.max_s - (self.max_s - self.min_s) * frac)

    def deadline(self) -> float:
        return self.started_at + self.timeout_s()


PROBE_UNANSWERED = "probe_unanswered"
"""A probe went unanswered and no helper could be asked (the score rose by 1)."""
NACKS_MISSING = "nacks_missing"
"""A probe went unanswered and helpers asked to try did not even nack: our links."""
SUSPECTED = "suspected"
"""Members suspected this node, which had to refute it."""


class Awareness:
    """The local health multiplier: a score in [0, max_score), and what raised it."""

    def __init__(self, max_score: int) -> None:
        self.max_score = max(1, max_score)
        self.score = 0
        self.reasons: dict[str, int] = {}
        """Since the score was last 0: how much each cause (``PROBE_UNANSWERED``,
        ``NACKS_MISSING``, ``SUSPECTED``) added to it. An operator asking why the
        node is degraded reads this; it empties when the score is back to 0."""

    def apply(self, delta: int, reason: str = "") -> None:
        self.score = min(self.max_score - 1, max(0, self.score + delta))
        if self.score == 0:
            self.reasons.clear()
        elif delta > 0 and reason:
            self.reasons[reason] = self.reasons.get(reason, 0) + delta

    def scale(self, value_s: float) -> float:
        return value_s * (self.score + 1)
