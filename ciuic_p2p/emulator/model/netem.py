"""A netem-style model of one directed link, as a pure function of time and a seed.

Given when a datagram of ``size`` bytes enters the link, :meth:`LinkModel.transmit`
returns when its copies arrive: none (lost, queue full or link down), one, or two
(duplicated). The vocabulary is Linux netem's and tbf's:

- ``delay_s`` one-way, plus ``jitter_s`` drawn from a ``uniform`` (±jitter, netem's
  default) or ``normal`` (standard deviation = jitter, clipped at ±3σ) distribution;
  as in netem, jitter reorders datagrams unless ``reorder = False``, in which case no
  datagram arrives before one sent earlier;
- ``loss`` (independent), and burst loss by a Gilbert-Elliott chain: from the good
  state to the bad one with probability ``ge_p`` per datagram, back with ``ge_r``;
  a datagram is lost with ``ge_loss_bad`` in the bad state and ``ge_loss_good`` in the
  good one (mean burst length 1/r);
- ``duplicate`` probability (the copy gets its own jitter draw);
- ``rate_bps``: a token bucket of one MTU with a FIFO queue of ``queue_bytes`` in
  front, like a router's: datagrams wait for their serialization slot, and one that
  would overflow the queue is dropped (tail drop). ``None`` means unlimited;
- ``up``: a link that is down drops everything.

Randomness comes from one ``random.Random(seed)`` per link, drawn in a fixed order,
so the same seed gives the same drops and delays. Nothing here reads a clock.
"""

from __future__ import annotations

import collections
import dataclasses
import random
import statistics
from dataclasses import dataclass
from typing import Literal

Jitter = Literal["uniform", "normal"]
_STANDARD_NORMAL = statistics.NormalDist()


@dataclass(frozen=True, slots=True)
class LinkParams:
    """How one directed link behaves. Times in seconds, rates in bits per second."""

    delay_s: float = 0.0
    jitter_s: float = 0.0
    jitter_dist: Jitter = "uniform"
    reorder: bool = True
    loss: float = 0.0
    ge_p: float = 0.0
    ge_r: float = 1.0
    ge_loss_bad: float = 1.0
    ge_loss_good: float = 0.0
    duplicate: float = 0.0
    rate_bps: float | None = None
    queue_bytes: int | None = None
    """Queue limit; default: 50 ms at the link rate, at least eight 1500-byte datagrams."""
    up: bool = True

    def __post_init__(self) -> None:
        for name in ("loss", "ge_p", "ge_r", "ge_loss_bad", "ge_loss_good", "duplicate"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be a probability, got {value}")
        if self.delay_s < 0 or self.jitter_s < 0:
            raise ValueError("delay and jitter must be >= 0")
        if self.rate_bps is not None and self.rate_bps <= 0:
            raise ValueError("rate_bps must be > 0 (or None for unlimited)")
        if self.jitter_dist not in ("uniform", "normal"):
            raise ValueError(f"unknown jitter distribution {self.jitter_dist!r}")

    def with_changes(self, **changes: object) -> LinkParams:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    @property
    def queue_limit_bytes(self) -> int:
        if self.queue_bytes is not None:
            return self.queue_bytes
        if self.rate_bps is None:
            return 1 << 62
        return max(8 * 1500, int(self.rate_bps * 0.05 / 8))


@dataclass(slots=True)
class LinkCounters:
    sent: int = 0
    delivered: int = 0
    lost: int = 0
    queue_drops: int = 0
    down_drops: int = 0
    duplicated: int = 0


class LinkModel:
    """The state of one directed link: its parameters, random stream, Gilbert-Elliott
    state, serialization clock and queue."""

    def __init__(self, params: LinkParams, seed: int) -> None:
        self.params = params
        self._rng = random.Random(seed)
        self._bad = False
        self._busy_until = 0.0
        self._queue: collections.deque[tuple[float, int]] = collections.deque()
        self._queued_bytes = 0
        self._last_arrival = 0.0
        self.counters = LinkCounters()

    def set_params(self, params: LinkParams) -> None:
        """Change parameters at run time; datagrams already in flight keep theirs."""
        self.params = params

    def transmit(self, now: float, size: int) -> list[float]:
        """Arrival times of a datagram of ``size`` bytes sent at ``now``."""
        p = self.params
        c = self.counters
        c.sent += 1
        rng = self._rng
        # Draw every random number in a fixed order, whatever the outcome, so that one
        # change (say, a loss) does not shift the sequence of everything after it.
        u_loss, u_ge, u_ge_loss, u_dup = rng.random(), rng.random(), rng.random(), rng.random()
        u_jitter, u_jitter_dup = rng.random(), rng.random()
        if not p.up:
            c.down_drops += 1
            return []
        self._bad = (u_ge >= p.ge_r) if self._bad else (u_ge < p.ge_p)
        if u_ge_loss < (p.ge_loss_bad if self._bad else p.ge_loss_good) or u_loss < p.loss:
            c.lost += 1
            return []
        departure = now
        if p.rate_bps is not None:
            while self._queue and self._queue[0][0] <= now:
                self._queued_bytes -= self._queue.popleft()[1]
            if self._queued_bytes + size > p.queue_limit_bytes:
                c.queue_drops += 1
                return []
            departure = max(now, self._busy_until) + size * 8 / p.rate_bps
            self._busy_until = departure
            self._queue.append((departure, size))
            self._queued_bytes += size
        arrivals = [self._arrival(departure, u_jitter)]
        if u_dup < p.duplicate:
            c.duplicated += 1
            arrivals.append(self._arrival(departure, u_jitter_dup))
        c.delivered += 1
        return arrivals

    def _arrival(self, departure: float, u: float) -> float:
        p = self.params
        jitter = 0.0
        if p.jitter_s > 0:
            if p.jitter_dist == "normal":
                z = _STANDARD_NORMAL.inv_cdf(min(max(u, 1e-12), 1 - 1e-12))
                jitter = max(-3.0, min(3.0, z)) * p.jitter_s
            else:
                jitter = (2.0 * u - 1.0) * p.jitter_s
        arrival = departure + max(0.0, p.delay_s + jitter)
        if not p.reorder:
            arrival = max(arrival, self._last_arrival)
        self._last_arrival = max(self._last_arrival, arrival)
        return arrival
