"""A node's transport with its chunks spread over lane processes (``transport.lanes``).

The node keeps its own QuicTransport for everything a link means: admission, the
member's identity, membership and control traffic, pings, rates probes, direct and
store frames. With ``transport.lanes`` = K, chunks (``lanes.LANE_FRAME_TYPES``) to a
peer whose lanes are up take K paths: the node's own link and K - 1 lane processes
(transport.lanes), each on its own core: the least loaded lane once the link holds
``LANE_BIAS_BYTES`` more for that peer, else the link. The link stays the first path
because a chunk through a lane costs two hand-overs more and another process's loop
(bench/lanes.py): on a machine with no core to spare the link alone is cheapest.
With no lane up to a peer (a peer with another lane count, lanes still dialling, a
lane gone) its chunks take the link, so lanes only ever add capacity.

How lanes pair (core.link.lanes): when a link comes up each side sends its lane
ports in one ``LANES`` frame; with equal counts the side with the smaller key dials
lane i of the other at the link's host. A lane frame counts only while its peer has
a link to this node: lanes carry bytes, the node's link says who is a member.

Flow: the node hands a lane at most ``LANE_SEND_BYTES`` for one peer before that
lane says the bytes left (the lane's QUIC took them under the peer's credit); past
that the link takes the chunk and its credit paces the sender as without lanes. A
lane's own link to a peer that stops reading stalls and drops after
``stall_timeout_s``. A lane hands up at most ``lanes.LANE_HANDUP_BYTES`` not yet
consumed here.
"""

from __future__ import annotations

import asyncio
import collections
import datetime as dt
from collections.abc import Callable, Coroutine
from typing import Any

from cryptography import x509

from ciuic_p2p.config import LogSection
from ciuic_p2p.core.link.frames import FrameType, frame_header
from ciuic_p2p.core.link.keys import peer_id_of
from ciuic_p2p.core.link.lanes import (
    LanesError,
    decode_lane_ports,
    dials_lanes,
    encode_lane_ports,
    pick_lane,
)
from ciuic_p2p.core.link.trust import Trust
from ciuic_p2p.guard import Guard
from ciuic_p2p.identity import NodeKey
from ciuic_p2p.logsetup import get_logger
from ciuic_p2p.transport.base import (
    Address,
    FrameReceived,
    LinkStats,
    PeerConnected,
    PeerDisconnected,
    RttStats,
    StrangerStats,
    Transport,
    TransportEvent,
)
from ciuic_p2p.transport.errors import TransportError
from ciuic_p2p.transport.lanes import LANE_FRAME_TYPES, LanePool
from ciuic_p2p.transport.quic import QuicTransport

LANE_SEND_BYTES = 8 * 1024 * 1024
"""Bytes handed to one lane for one peer and not yet sent, at most."""
LANE_BIAS_BYTES = 2 * 1024 * 1024
"""A lane takes a chunk only when the link holds this much more for the peer than the
lane does (two of the largest chunks): a hand-over costs CPU (two copies more each
way, another process's loop), worth it once the link is backed up. On this 2-core
machine (bench/lanes.py) no bias put 60% of the chunks on the lane at 0.88-1.00x of
one path, 1 MiB 56% at 0.93-1.00x, 2 MiB 41% at 0.92-0.97x. Not more: a short path's
window is 4 MiB, and at 4 MiB of bias no chunk took a lane there."""
LANES_INTERVAL_S = 10.0
"""A peer's LANES frame is acted on at most once per this time (per link, too)."""
MAX_HEARD = 1024
"""Peers whose last LANES time is kept (past 4 x this, the oldest go)."""
MAX_LANE_REDIALS = 5
"""Dials of one lane to one peer after its lane link dropped, while the node's link
lives (``reconnect_base_s`` doubling between them)."""
log = get_logger("ciuic.lanes")


class LanedTransport(Transport):
    """The node's QuicTransport plus ``lanes`` lane processes for its chunks."""

    def __init__(
        self,
        main: QuicTransport,
        key: NodeKey,
        certificate: x509.Certificate,
        lanes: int,
        *,
        base_port: int = 0,
        log: LogSection | None = None,
    ) -> None:
        """``main``: the node's own transport, not started; ``lanes``: paths for
        chunks, the link included (2 or more); ``base_port``: lane process i listens
        on ``base_port + i`` (0: any free port)."""
        if lanes < 2:
            raise ValueError("lanes: the node's link and at least one lane process")
        self.main = main
        self.local_key = main.local_key
        self.certificate_der = main.certificate_der
        self.pool = LanePool(
            key,
            certificate,
            main.trust,
            lanes - 1,
            self,
            settings=main.settings,
            host=main.host,
            base_port=base_port,
            log=log,
        )
        self.lane_ports: tuple[int, ...] = ()
        self._up: dict[bytes, set[int]] = collections.defaultdict(set)
        """Peer -> the lanes with a link to it now."""
        self._queued = [collections.Counter[bytes]() for _ in range(lanes - 1)]
        """Per lane: bytes handed to it for each peer and not yet sent."""
        self._announced: set[bytes] = set()
        """Peers whose LANES frame this link already heard: one per link."""
        self._host_of: dict[bytes, str] = {}
        self._ports_of: dict[bytes, tuple[int, ...]] = {}
        """Peers whose lanes this node dials, and their ports."""
        self._redials: collections.Counter[tuple[int, bytes]] = collections.Counter()
        self._dials: dict[bytes, set[asyncio.Task[Any]]] = {}
        """Each peer's lane dials in flight: they go with its link."""
        self._heard_at: dict[bytes, float] = {}
        """When each peer's last LANES frame was acted on (the node's clock)."""
        self._lane_first = False
        """Which source ``next_event`` looks at first when both have something."""
        self._frames: asyncio.Queue[tuple[int, FrameReceived]] = asyncio.Queue()
        self._next_main: asyncio.Future[TransportEvent] | None = None
        self._next_lane: asyncio.Future[tuple[int, FrameReceived]] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self.frames_by_lane = [0] * (lanes - 1)
        """Frames each lane process received (the link's are ``link_frames_received``)."""
        self.counters: collections.Counter[str] = collections.Counter()
        """``lane_frames_sent``, ``lane_bytes_sent``, ``frames_unlinked`` (from a peer with no
        link here: dropped), ``lanes_refused`` (a bad LANES frame), ..."""

    # -- the interface's attributes: the node's own link's --------------------------------

    @property
    def trust(self) -> Trust:  # type: ignore[override]
        return self.main.trust

    @property
    def wallclock(self) -> Callable[[], dt.datetime]:  # type: ignore[override]
        return self.main.wallclock

    @property
    def guard(self) -> Guard:  # type: ignore[override]
        return self.main.guard

    @property
    def udp_bytes_sent(self) -> int:  # type: ignore[override]
        return self.main.udp_bytes_sent + sum(s.udp_bytes_sent for s in self.pool.stats)

    @property
    def lanes(self) -> int:
        """Paths for chunks: the node's own link and its lane processes."""
        return self.pool.lanes + 1

    # -- life cycle -----------------------------------------------------------------------

    async def start(self) -> Address:
        address = await self.main.start()
        try:
            lane_addresses = await self.pool.start()
        except TransportError:
            await self.main.close()
            raise
        self.lane_ports = tuple(port for _, port in lane_addresses)
        log.info("lanes_started", lanes=self.lanes, ports=list(self.lane_ports))
        return address

    async def close(self) -> None:
        for future in (self._next_main, self._next_lane, *self._tasks):
            if future is not None:
                future.cancel()
        await self.pool.close()
        await self.main.close()

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.counters["task_failed"] += 1

    # -- sending --------------------------------------------------------------------------

    async def send(self, peer: bytes, frame_type: FrameType, payload: bytes) -> None:
        lane = self._lane_for(peer) if frame_type in LANE_FRAME_TYPES else None
        if lane is None:
            await self.main.send(peer, frame_type, payload)
            return
        frame_header(frame_type, len(payload))  # over its limit: FramingError, as on the link
        self._queued[lane][peer] += len(payload)
        self.counters["lane_frames_sent"] += 1
        self.pool.send(lane, peer, frame_type, payload)

    def _lane_for(self, peer: bytes) -> int | None:
        """The lane process a chunk for ``peer`` goes to, or None for the node's own
        link: the least loaded of them, the link's load being what it holds for the
        peer not yet credited back. A full lane never waits: the link takes the chunk,
        and its credit paces the sender as it would without lanes."""
        up = self._lanes_to(peer)
        if not up:
            return None
        lane = pick_lane([q[peer] for q in self._queued], up)
        queued = self._queued[lane][peer]
        stats = self.main.link_stats(peer)
        link_load = 0 if stats is None else stats.bulk_buffered_bytes
        if queued >= LANE_SEND_BYTES or queued + LANE_BIAS_BYTES >= link_load:
            return None
        return lane

    def _lanes_to(self, peer: bytes) -> list[int]:
        """The lanes that carry chunks to ``peer`` now: none unless the node's own
        link to it is up."""
        up = self._up.get(peer)
        if not up or peer not in self.main.peers():
            return []
        return sorted(up - self.pool.ended)

    # -- receiving ------------------------------------------------------------------------

    async def next_event(self) -> TransportEvent:
        while True:
            if self._next_main is None:
                self._next_main = asyncio.ensure_future(self.main.next_event())
            if self._next_lane is None:
                self._next_lane = asyncio.ensure_future(self._frames.get())
            await asyncio.wait(
                (self._next_main, self._next_lane), return_when=asyncio.FIRST_COMPLETED
            )
            # Both ready: take them in turn, so that a busy lane never holds back the
            # link's membership and control traffic (nor the other way round).
            self._lane_first = not self._lane_first
            if self._next_lane.done() and (self._lane_first or not self._next_main.done()):
                lane, frame = self._next_lane.result()
                self._next_lane = None
                self.pool.consumed(lane, len(frame.payload))
                if frame.peer in self.main.peers():
                    return frame
                self.counters["frames_unlinked"] += 1  # its link went while it waited
                continue
            event = self._next_main.result()
            self._next_main = None
            if self._own_event(event):
                return event

    def _own_event(self, event: TransportEvent) -> bool:
        """Handle what lanes need from the node's link; whether to hand ``event`` up."""
        if isinstance(event, PeerConnected):
            self._host_of[event.peer] = event.address[0]
            self._announced.discard(event.peer)
            if not self.pool.ended:  # a node with a lane gone pairs no new lanes
                self._spawn(self.main.send(event.peer, FrameType.LANES, self._announcement()))
        elif isinstance(event, PeerDisconnected):
            self._host_of.pop(event.peer, None)
            self._ports_of.pop(event.peer, None)
            for key in [k for k in self._redials if k[1] == event.peer]:
                del self._redials[key]
            for task in self._dials.pop(event.peer, set()):
                task.cancel()
            self._announced.discard(event.peer)
            self._up.pop(event.peer, None)
            self.pool.disconnect(event.peer, f"link closed: {event.reason}")
        elif isinstance(event, FrameReceived) and event.type is FrameType.LANES:
            self._heard_lanes(event.peer, event.payload)
            return False
        elif isinstance(event, FrameReceived) and event.type in LANE_FRAME_TYPES:
            self.counters["link_frames_received"] += 1
        return True

    def _announcement(self) -> bytes:
        return encode_lane_ports(self.lane_ports)

    def _heard_lanes(self, peer: bytes, payload: bytes) -> None:
        now = self.main.clock()
        if peer in self._announced or now - self._heard_at.get(peer, -1e18) < LANES_INTERVAL_S:
            # Once per link, and once per LANES_INTERVAL_S however often a member
            # re-links: no member makes this node dial its ports again and again.
            self.counters["lanes_repeated"] += 1
            return
        self._announced.add(peer)
        self._heard_at[peer] = now
        if len(self._heard_at) > 4 * MAX_HEARD:
            for old in sorted(self._heard_at, key=self._heard_at.__getitem__)[:MAX_HEARD]:
                del self._heard_at[old]
        try:
            ports = decode_lane_ports(payload)
        except LanesError as exc:
            self.counters["lanes_refused"] += 1
            log.warning("lanes_refused", peer=peer_id_of(peer), reason=str(exc))
            return
        host = self._host_of.get(peer)
        if len(ports) != self.pool.lanes or host is None or self.pool.ended:
            log.info("lanes_unpaired", peer=peer_id_of(peer), theirs=len(ports), ours=self.lanes)
            return
        if dials_lanes(self.local_key, peer):
            self._ports_of[peer] = ports
            for lane, port in enumerate(ports):
                self._dial_later(lane, (host, port), peer)

    async def _dial(self, lane: int, address: Address, peer: bytes, delay_s: float = 0.0) -> None:
        await asyncio.sleep(delay_s)
        if self._ports_of.get(peer) is None:
            return  # the link went meanwhile
        try:
            await self.pool.connect(lane, address, peer)
        except TransportError as exc:  # the node's own link carries its chunks
            self.counters["lane_dials_failed"] += 1
            log.info("lane_dial_failed", peer=peer_id_of(peer), lane=lane, reason=str(exc))

    # -- what the lanes tell (lanes.LaneListener) -----------------------------------------

    def lane_frame(self, lane: int, peer: bytes, frame_type: FrameType, payload: bytes) -> None:
        if peer not in self.main.peers():  # never queued: no link, no say here
            self.counters["frames_unlinked"] += 1
            self.pool.consumed(lane, len(payload))
            return
        self.frames_by_lane[lane] += 1
        self._frames.put_nowait((lane, FrameReceived(peer, frame_type, payload)))

    def lane_up(self, lane: int, peer: bytes) -> None:
        self._up[peer].add(lane)

    def lane_down(self, lane: int, peer: bytes, reason: str) -> None:
        lanes = self._up.get(peer)
        if lanes is not None:
            lanes.discard(lane)
            if not lanes:
                del self._up[peer]
        log.info("lane_down", peer=peer_id_of(peer), lane=lane, reason=reason)
        ports = self._ports_of.get(peer)
        host = self._host_of.get(peer)
        attempt = self._redials[(lane, peer)]
        if ports is None or host is None or attempt >= MAX_LANE_REDIALS:
            return  # the link is gone (a new one pairs again), or the lane gave up
        self._redials[(lane, peer)] += 1
        delay_s = self.main.settings.reconnect_base_s * 2**attempt
        self._dial_later(lane, (host, ports[lane]), peer, delay_s)

    def _dial_later(self, lane: int, address: Address, peer: bytes, delay_s: float = 0.0) -> None:
        task = asyncio.get_running_loop().create_task(self._dial(lane, address, peer, delay_s))
        dials = self._dials.setdefault(peer, set())
        dials.add(task)
        task.add_done_callback(dials.discard)

    def lane_sent(self, lane: int, peer: bytes, nbytes: int, error: str) -> None:
        queued = self._queued[lane]
        queued[peer] -= nbytes
        if queued[peer] <= 0:
            del queued[peer]
        if error:
            self.counters["lane_send_failed"] += 1
        else:
            self.counters["lane_bytes_sent"] += nbytes

    def lane_ended(self, lane: int) -> None:
        self._queued[lane].clear()
        for lanes in self._up.values():
            lanes.discard(lane)
        log.warning("lane_ended", lane=lane)

    # -- the rest of the interface: the node's link, with what lanes add --------------------

    async def resolve(self, host: str, port: int) -> Address:
        return await self.main.resolve(host, port)

    async def connect(self, address: Address, expected_peer: bytes | None = None) -> bytes:
        return await self.main.connect(address, expected_peer)

    def peers(self) -> list[bytes]:
        return self.main.peers()

    def rtt(self, peer: bytes) -> RttStats | None:
        return self.main.rtt(peer)

    def pace(self, peer: bytes, rate_bps: float | None) -> None:
        """The node's own link only: the lanes exist for links whose limit is a core,
        not the path, and their share of a path's rate is not known apart."""
        self.main.pace(peer, rate_bps)

    def link_stats(self, peer: bytes) -> LinkStats | None:
        """The node's link's counters plus its lanes': bytes both ways, what waits
        for the peer, and the receive rate summed over the lanes that measured one
        (they share the path and run at once when loaded)."""
        stats = self.main.link_stats(peer)
        if stats is None:
            return None
        sent, received, rate, samples = stats.bytes_sent, stats.bytes_received, 0.0, 0
        for lane in self.pool.stats:
            link = lane.links.get(peer)
            if link is None:
                continue
            sent, received = sent + link[0], received + link[1]
            if link[2] is not None:
                rate, samples = rate + link[2], samples + link[3]
        return LinkStats(
            bytes_sent=sent,
            bytes_received=received,
            bulk_buffered_bytes=stats.bulk_buffered_bytes + sum(q[peer] for q in self._queued),
            credit_available=stats.credit_available,
            receive_rate_bps=max(rate, stats.receive_rate_bps or 0.0)
            if samples
            else (stats.receive_rate_bps),
            rate_samples=samples + stats.rate_samples,
            pace_bps=stats.pace_bps,
        )

    def set_trust(self, trust: Trust) -> list[bytes]:
        self.pool.set_trust(trust)
        return self.main.set_trust(trust)

    def unacked_bytes(self) -> int:
        """The link's, plus what the lanes were handed and have not sent, or sent and
        not had acknowledged (as of their last report): a leave waits for it all."""
        handed = sum(sum(q.values()) for q in self._queued)
        return self.main.unacked_bytes() + handed + sum(s.unacked_bytes for s in self.pool.stats)

    def strangers(self) -> StrangerStats:
        return self.main.strangers()

    def lanes_status(self) -> dict[str, Any] | None:
        return {
            "lanes": self.lanes,
            "processes": self.pool.lanes,
            "ports": list(self.lane_ports),
            "pids": self.pool.pids,
            "ended": sorted(self.pool.ended),
            "paired": {peer_id_of(p): sorted(up) for p, up in self._up.items() if up},
            "frames_by_lane": list(self.frames_by_lane),
            "counters": dict(self.counters),
        }

    async def disconnect(self, peer: bytes, reason: str) -> None:
        self.pool.disconnect(peer, reason)
        await self.main.disconnect(peer, reason)
