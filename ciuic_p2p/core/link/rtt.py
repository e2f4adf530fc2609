"""Round-trip time estimation from ping samples (RFC 6298 smoothing), and the
reconnect backoff with full jitter."""

from __future__ import annotations

import random


class RttEstimator:
    """min / smoothed / variance of RTT samples, in seconds."""

    def __init__(self) -> None:
        self.min_s: float | None = None
        self.smoothed_s: float | None = None
        self.var_s: float | None = None
        self.samples = 0

    def add(self, rtt_s: float) -> None:
        if rtt_s < 0:
            return
        self.samples += 1
        self.min_s = rtt_s if self.min_s is None else min(self.min_s, rtt_s)
        if self.smoothed_s is None or self.var_s is None:
            self.smoothed_s, self.var_s = rtt_s, rtt_s / 2
        else:
            self.var_s = 0.75 * self.var_s + 0.25 * abs(self.smoothed_s - rtt_s)
            self.smoothed_s = 0.875 * self.smoothed_s + 0.125 * rtt_s


def backoff_delay_s(attempt: int, base_s: float, cap_s: float, rng: random.Random) -> float:
    """Delay before reconnect attempt ``attempt`` (0-based): uniform in
    [0, min(cap, base * 2^attempt)] ("full jitter"), so that many nodes that lost the
    same peer do not come back in lockstep."""
    return rng.uniform(0.0, min(cap_s, base_s * (2.0 ** min(attempt, 30))))
