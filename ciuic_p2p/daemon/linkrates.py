"""The daemon's side of link rates: each second it hands the links' measured receive
rates to the mesh (which publishes them), paces each link at what its peer published
for it (core.link.pacer), and sends a rate probe where core.link.rateprobe says one is
due. Thin: the decisions are the core's; this only reads the transport and the
daemon's queues and writes frames.

Every choice about a peer goes by the link's proven key, never by an address a member
signed: a member that signed another's address must not set that one's pace, nor
draw probes (or a lifted pace) onto that one's link.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Mapping

from ciuic_p2p.config.sections import MeshSection
from ciuic_p2p.core.link.frames import MAX_RATE_PROBE_BYTES, FrameType
from ciuic_p2p.core.link.rateprobe import RateProbes
from ciuic_p2p.core.mesh.node import MeshNode
from ciuic_p2p.guard import Guard
from ciuic_p2p.identity import peer_id_of
from ciuic_p2p.transport.base import Transport

FEED_INTERVAL_S = 1.0
"""How often the links' measured rates are handed to the mesh (they change per large
frame; the mesh republishes only a move of ``link_rate_change_ratio``)."""
IDLE_UNACKED_BYTES = 64 * 1024
"""Unacknowledged stream bytes under which a node counts as sending nothing else (its
control traffic: probes, acks, gossip) when it picks a moment for a rate probe."""


class LinkRates:
    """Feeds, paces and probes one daemon's links (see the module docstring)."""

    def __init__(
        self,
        settings: MeshSection,
        own_id: str,
        transport: Transport,
        guard: Guard,
        counters: collections.Counter[str],
        *,
        peer_at: Mapping[str, bytes],
        bulk_queued: Callable[[str], int],
        backlog_bytes: Callable[[], int],
        enqueue: Callable[[str, FrameType, bytes], None],
        receive_rates: Callable[[], Mapping[str, float]],
    ) -> None:
        """``peer_at``: the proven key of the link at each address; ``bulk_queued``:
        bulk bytes waiting for an address; ``backlog_bytes``: for all of them;
        ``enqueue``: queue a frame for an address; ``receive_rates``: each linked
        peer's measured pace here (daemon.nodestatus)."""
        self.settings = settings
        self.own_id = own_id
        self.transport = transport
        self.guard = guard
        self.counters = counters
        self._peer_at = peer_at
        self._bulk_queued = bulk_queued
        self._backlog_bytes = backlog_bytes
        self._enqueue = enqueue
        self._receive_rates = receive_rates
        uplink = settings.node_uplink_bps
        self.probes = RateProbes(
            settings.rate_probe_bytes,
            settings.rate_probe_interval_s,
            settings.rate_probe_below,
            min(settings.default_rate_bps, uplink if 0 < uplink < math.inf else math.inf),
        )
        """Which link gets filler to measure it, and when (core.link.rateprobe)."""
        self._next_feed = 0.0

    def tick(self, node: MeshNode, now: float) -> None:
        """At most once per ``FEED_INTERVAL_S``: feed, pace, probe."""
        if now < self._next_feed:
            return
        self._next_feed = now + FEED_INTERVAL_S
        for peer, rate_bps in self._receive_rates().items():
            node.observe_rate(peer, rate_bps)
        self._pace(node, now)
        self._probe(node, now)

    def _pace(self, node: MeshNode, now: float) -> None:
        """Each link's bulk bytes at ``mesh.pace_gain`` times the rate its peer
        measured receiving from this node; unpaced while none, or while a probe
        crosses it (a probe must read above the pace)."""
        gain = self.settings.pace_gain
        if gain <= 0:
            return
        for key in self.transport.peers():
            peer = peer_id_of(key)
            rate_bps = node.rate_bps(self.own_id, peer)
            if self.probes.unpaced(peer, now):
                rate_bps = None
            pace_bps = None if rate_bps is None else gain * rate_bps
            self.guard.call("pace", self.transport.pace, key, pace_bps)

    def _probe(self, node: MeshNode, now: float) -> None:
        """Filler down the one link due for a probe, if any; the peer times it as any
        bulk frame and drops it."""
        if self.probes.probe_bytes <= 0:
            return
        members = node.members()
        published: dict[str, float | None] = {}
        ready: list[str] = []
        live = set(self.transport.peers())
        for peer in node.view():
            member = members.get(peer)
            if peer == self.own_id or member is None:
                continue
            published[peer] = node.rate_bps(self.own_id, peer)
            key = self._peer_at.get(member.address)
            if (
                key is not None
                and key in live
                and peer_id_of(key) == peer
                and not self._bulk_queued(member.address)
            ):
                ready.append(peer)
        idle = self._backlog_bytes() == 0 and self.transport.unacked_bytes() < IDLE_UNACKED_BYTES
        probe = self.probes.choose(now, published, ready, idle)
        if probe is None:
            return
        address = members[probe.peer].address
        self.guard.call("pace", self.transport.pace, self._peer_at[address], None)
        left = probe.nbytes
        while left > 0:
            piece = min(left, MAX_RATE_PROBE_BYTES)
            self._enqueue(address, FrameType.RATE_PROBE, bytes(piece))
            left -= piece
        self.counters["rate_probes_sent"] += 1
        self.counters[f"rate_probes_{probe.reason}"] += 1
