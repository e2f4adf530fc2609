"""How late a chunk's tree copy comes after the chunk is known to exist.

A node learns of a chunk (a holder's ``HEADS``) while the chunk itself is still on
its way down the tree: a 1 MiB piece takes 0.84 s to cross a 10 Mbit/s link, more
behind the pieces queued ahead of it. A repair asked for sooner than the tree copy
comes sends a second full copy over another link, which slows every other piece on
that link, which makes more pieces late: measured on the multi-cloud matrix at rate
scale 0.01, 130 repairs and 718 duplicate copies for a round that needs 90 deliveries.
So the repair wait follows what the tree is measured to take, as TCP's retransmission
timer follows the round trip (RFC 6298): a smoothed lag plus four mean deviations.

Samples are the time from "known missing" to the tree copy's arrival. A chunk the
node repaired has no such sample (the repair came first), but its tree copy, arriving
later as a duplicate, is one: without it a wait set too short would never learn
(Karn's problem, the other way round). Every sample is capped by the caller, so a
member that sends late copies on purpose can at most hold repairs to the cap.
"""

from __future__ import annotations

GAIN = 0.125
"""RFC 6298's alpha: each sample moves the mean by an eighth of its error."""
DEVIATION_GAIN = 0.25
"""RFC 6298's beta."""
DEVIATIONS = 4.0
"""The wait is the mean plus this many mean deviations (RFC 6298's K)."""


class LagEstimator:
    """A smoothed lag and its mean deviation, in seconds."""

    __slots__ = ("dev_s", "mean_s", "samples")

    def __init__(self) -> None:
        self.mean_s = 0.0
        self.dev_s = 0.0
        self.samples = 0

    def add(self, lag_s: float) -> None:
        lag_s = max(0.0, lag_s)
        if self.samples == 0:
            self.mean_s, self.dev_s = lag_s, lag_s / 2
        else:
            self.dev_s += DEVIATION_GAIN * (abs(self.mean_s - lag_s) - self.dev_s)
            self.mean_s += GAIN * (lag_s - self.mean_s)
        self.samples += 1

    def bound_s(self) -> float:
        """How long a copy still on its way is worth waiting for (0 without samples)."""
        return self.mean_s + DEVIATIONS * self.dev_s if self.samples else 0.0
