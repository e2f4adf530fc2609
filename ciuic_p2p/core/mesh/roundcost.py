"""The cost model of a round: :func:`predict_round_s` plays it out on the published
state. Every origin starts at once; each payload is cut into pieces of at most
``piece_bytes`` that travel store-and-forward; a link sends one piece after another
(FIFO, at its rate) behind a node's uplink, which passes one copy after another at its
own rate (at the link's where none is known), unless the links are known to be
independent. The round ends when the last node holds the last piece. Pure: no clock,
no I/O.
"""

from __future__ import annotations

import heapq
import itertools
import math

from ciuic_p2p.core.mesh.linkcosts import LinkCosts, Plan


def predict_round_s(plan_: Plan, costs: LinkCosts, payload_bytes: int, piece_bytes: int) -> float:
    """When the last node holds the last piece of every origin's payload, every origin
    starting at time 0 (see the module docstring; each link idle at the start, so its
    first piece pays QUIC's slow start). Infinite if a tree misses a node or uses a
    link with no known delay."""
    pieces = _pieces(payload_bytes, piece_bytes)
    link_free: dict[tuple[str, str], float] = {}
    up_free: dict[str, float] = {}
    done = 0.0
    events: list[tuple[float, int, str, str, int]] = []
    order = itertools.count()
    for origin in costs.nodes:
        for k in range(len(pieces)):
            heapq.heappush(events, (0.0, next(order), origin, origin, k))
    held: set[tuple[str, str, int]] = set()
    while events:
        t, _, node, origin, k = heapq.heappop(events)
        if (node, origin, k) in held:
            continue
        held.add((node, origin, k))
        done = max(done, t)
        size = pieces[k]
        ready = t + (costs.relay_s if node != origin else 0.0)
        for child in plan_.trees[origin].get(node, []):
            d = costs.delay(node, child)
            if d is None:
                return float("inf")
            link_s = size * 8 / costs.rate(node, child)
            uplink = costs.uplink_bps
            if (node, child) not in link_free:  # the link's first piece: slow start
                pace = min(costs.rate(node, child), uplink or math.inf)
                link_s += slow_start_s(size, pace, 2 * d, costs.initial_window_bytes)
            if uplink == math.inf:  # independent links: each its own FIFO
                leave = max(ready, link_free.get((node, child), 0.0)) + link_s
            else:
                # The uplink passes the copy's datagrams at its rate, one copy after
                # another (0: at the link's, as a node that sends one copy at a time);
                # the link takes them at its own, behind what it still carries: the
                # slower of the two paces the copy, as in the emulator.
                up_s = size * 8 / uplink if uplink > 0 else link_s
                up_start = max(ready, up_free.get(node, 0.0))
                up_free[node] = up_start + up_s
                link_start = max(up_start, link_free.get((node, child), 0.0))
                leave = max(up_start + up_s, link_start + link_s)
            link_free[(node, child)] = leave
            heapq.heappush(events, (leave + d, next(order), child, origin, k))
    if len(held) < len(costs.nodes) ** 2 * len(pieces):
        return float("inf")
    return done


def slow_start_s(size: int, rate_bps: float, rtt_s: float, window: int) -> float:
    """What QUIC's slow start adds to ``size`` bytes sent on an idle link of this rate
    and RTT, over sending them at the rate: the window doubles each RTT from
    ``window`` until it holds the path's bandwidth-delay product, so B = min(size,
    BDP) bytes take ``rtt * log2(B / window + 1)`` where the rate alone takes B / rate
    (and the rest goes at the rate)."""
    bdp = rate_bps * rtt_s / 8
    b = min(size, bdp)
    if b <= window or rtt_s <= 0:
        return 0.0
    return max(0.0, rtt_s * math.log2(b / window + 1) - b * 8 / rate_bps)


def _pieces(payload_bytes: int, piece_bytes: int) -> list[int]:
    piece = max(1, piece_bytes)
    full, rest = divmod(max(1, payload_bytes), piece)
    return [piece] * full + ([rest] if rest else [])
