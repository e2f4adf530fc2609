"""Vivaldi network coordinates (Dabek et al., SIGCOMM 2004), as serf implements them.

Each node keeps a point in an 8-dimensional Euclidean space plus a *height* (the
access-link delay that every path from the node shares) and an error estimate. Every
measured RTT to a peer whose coordinate we know pulls or pushes our point along the
line between the two, weighted by how sure each side is. The distance between two
coordinates then estimates their RTT, also for pairs that never measured each other:
the RTT map falls back to it where no measurement exists (core.mesh.rttmap).

Constants are serf's (lib/coordinate/config.go): error max 1.5, ce = cc = 0.25, height
min 10 us, gravity rho 150, a median filter over the last 3 samples per peer.
"""

from __future__ import annotations

import math
import random
import statistics
from collections import deque

from ciuic_p2p.core.mesh.messages import COORD_DIMENSIONS, Coordinate

ERROR_MAX = 1.5
CE = 0.25
CC = 0.25
HEIGHT_MIN_S = 10e-6
GRAVITY_RHO = 150.0
LATENCY_FILTER = 3
_ZERO = 1e-6
MAX_RTT_S = 10.0


def distance_s(a: Coordinate, b: Coordinate) -> float:
    """The RTT that two coordinates predict, in seconds."""
    return math.dist(a.vec, b.vec) + a.height_s + b.height_s


class VivaldiClient:
    """This node's coordinate, updated from RTT samples to peers."""

    def __init__(self, seed: int = 0) -> None:
        self.coordinate = Coordinate()
        self._rng = random.Random(seed)
        self._samples: dict[str, deque[float]] = {}

    def _unit_from(self, a: tuple[float, ...], b: tuple[float, ...]) -> tuple[list[float], float]:
        diff = [x - y for x, y in zip(a, b, strict=True)]
        mag = math.hypot(*diff)
        if mag > _ZERO:
            return [d / mag for d in diff], mag
        rand = [self._rng.random() - 0.5 for _ in a]
        rmag = math.hypot(*rand) or 1.0
        return [r / rmag for r in rand], 0.0

    def _apply_force(self, c: Coordinate, force: float, other: Coordinate) -> Coordinate:
        unit, mag = self._unit_from(c.vec, other.vec)
        vec = tuple(v + u * force for v, u in zip(c.vec, unit, strict=True))
        height = c.height_s
        if mag > _ZERO:
            height = (c.height_s + other.height_s) * force / mag + c.height_s
        return Coordinate(vec, max(height, HEIGHT_MIN_S), c.error)

    def update(self, peer: str, other: Coordinate, rtt_s: float) -> None:
        """One RTT sample to ``peer``, whose coordinate is ``other``."""
        if not (0.0 < rtt_s < MAX_RTT_S):
            return
        window = self._samples.setdefault(peer, deque(maxlen=LATENCY_FILTER))
        window.append(rtt_s)
        rtt = statistics.median(window)
        c = self.coordinate
        dist = distance_s(c, other)
        total_error = max(c.error + other.error, _ZERO)
        weight = c.error / total_error
        relative_error = abs(dist - rtt) / rtt
        error = min(ERROR_MAX, relative_error * CE * weight + c.error * (1 - CE * weight))
        c = Coordinate(c.vec, c.height_s, error)
        c = self._apply_force(c, CC * weight * (rtt - dist), other)
        # Gravity towards the origin keeps the whole system from drifting away.
        norm = math.hypot(*c.vec)
        c = self._apply_force(c, -((norm / GRAVITY_RHO) ** 2), Coordinate(height_s=0.0))
        if all(math.isfinite(v) for v in c.vec) and math.isfinite(c.height_s):
            self.coordinate = c
        else:  # a poisoned update must not wreck our coordinate: start over
            self.coordinate = Coordinate()

    def forget(self, peer: str) -> None:
        self._samples.pop(peer, None)


__all__ = ["COORD_DIMENSIONS", "VivaldiClient", "distance_s"]
