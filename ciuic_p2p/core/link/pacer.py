"""The pace of one link's bulk bytes: a token bucket at a rate the mesh measured.
Pure: the transport asks it with ``now`` how much may go and when to ask again.

QUIC's congestion control (CUBIC, and qh3's, which offers no other) finds a path's
rate by filling its bottleneck queue until packets drop, then halves. On a path whose
queue is short against its bandwidth-delay product (the WAN emulator's are 50 ms of
the link's rate, as in many routers) every bulk transfer ends its slow start in a loss
burst, and every round pays the recovery: measured with real daemons on the emulated
multi-cloud matrix at 10 Mbit/s, 1 MB broadcasts took 2.1-2.3x the store-and-forward
optimum in every round; with 3.2 s queues (no overshoot loss) the second and later
rounds took 1.04x; paced at 1.1x the link's true rate, 1.12-1.23x
(bench/dissemination.py).

So a link whose receiver has published its rate from this node (core.link.throughput,
gossiped with the link state) gets its bulk bytes no faster than ``mesh.pace_gain``
times that rate (the daemon sets it). The gain is well above 1 because that
measurement reads low (a frame sent in slow start or after a loss) and climbs only by
what the pace lets through: at 1.1x the rounds above stayed at 1.8-1.9x the optimum;
at 1.5x they came to 1.4-1.7x in the second round and 1.1-1.3x from the third. A
burst of ``burst_s`` of the rate (at least ``MIN_BURST_BYTES``) goes at once, so that
a fast link is not paced one datagram at a time.
"""

from __future__ import annotations

import math

MIN_BURST_BYTES = 16 * 1024
MIN_RATE_BPS = 1e6
"""A published rate below this paces at this: a peer that claims a slower link
from this node holds back only its own traffic, and never to a trickle."""


class Pacer:
    """One link's token bucket (see the module docstring)."""

    def __init__(self, burst_s: float = 0.005) -> None:
        self.burst_s = burst_s
        self.rate_bps: float | None = None
        """None: not paced (no rate known, or pacing off)."""
        self._tokens = 0.0
        self._at: float | None = None

    def set_rate(self, rate_bps: float | None, now: float) -> None:
        """Pace at ``rate_bps`` from now on (None, or no finite positive rate: no
        pacing); a link that was not paced starts with a full burst."""
        if rate_bps is not None and not (rate_bps > 0 and math.isfinite(rate_bps)):
            rate_bps = None
        if rate_bps is not None:
            rate_bps = max(MIN_RATE_BPS, rate_bps)
        if self.rate_bps is None:
            self.rate_bps = rate_bps
            self._tokens, self._at = self.burst_bytes, now
            return
        self._refill(now)
        self.rate_bps = rate_bps
        if rate_bps is not None:
            self._tokens = min(self._tokens, self.burst_bytes)

    @property
    def burst_bytes(self) -> float:
        if self.rate_bps is None:
            return float("inf")
        return max(float(MIN_BURST_BYTES), self.rate_bps * self.burst_s / 8)

    def allowance(self, now: float) -> int:
        """Bytes that may go now (the burst, at most)."""
        if self.rate_bps is None:
            return 1 << 62
        self._refill(now)
        return max(0, int(self._tokens))

    def spend(self, nbytes: int) -> None:
        if self.rate_bps is not None:
            self._tokens -= nbytes

    def wait_s(self, nbytes: int, now: float) -> float:
        """Seconds until ``nbytes``, or half a burst if that is less, may go. Half:
        the bucket stops filling at a full burst, so a timer that fires late after
        waiting for a full one loses the rate of its lateness (a review simulated
        0.6-0.9 of the rate at 1-4 ms late)."""
        if self.rate_bps is None:
            return 0.0
        self._refill(now)
        want = min(float(nbytes), self.burst_bytes / 2)
        return max(0.0, (want - self._tokens) * 8 / self.rate_bps)

    def _refill(self, now: float) -> None:
        if self._at is None or self.rate_bps is None:
            self._at = now
            return
        if now <= self._at:  # a clock that steps back adds nothing, now or later
            return
        self._tokens = min(self.burst_bytes, self._tokens + (now - self._at) * self.rate_bps / 8)
        self._at = now
