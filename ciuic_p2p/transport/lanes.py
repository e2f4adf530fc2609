"""Lane processes: one node's bulk frames carried by several processes, one core each.

A QUIC link costs its CPU in the process that runs it: about 7 ms per MB sent plus
received on qh3 here, so one core carries about 1 Gbit/s at best, and the daemon's
own work shares that core. A :class:`LanePool` starts K lane processes; each runs its
own QuicTransport (own UDP socket, the node's own credentials and trust) and carries
the bulk frames the node hands it (transport.laned decides which, and to which lane).

Between the node and a lane there is one pipe and four bounds, so that neither side's
memory grows with what the other does:

- frames to send: the node counts the bytes it handed a lane for a peer and not yet
  seen ``sent`` (the lane's QUIC took them under the peer's credit), and waits past
  its bound (transport.laned);
- frames received: a lane hands up at most ``LANE_HANDUP_BYTES`` the node has not
  consumed; past it, the lane stops reading its links, so its peers' credit stops;
- each side writes its pipe from one thread, in order: a large message never blocks
  an event loop, and messages never interleave;
- a lane whose pipe closes (the node died) ends itself.

Every lane is a process of ours (``python -m ciuic_p2p.transport.lanes``, its set-up
sent over a socket pair, never on its command line), ended by its PID.
"""

from __future__ import annotations

import asyncio
import functools
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from typing import Any, Protocol

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from ciuic_p2p.admission import Trust
from ciuic_p2p.config import LogSection, TransportSection
from ciuic_p2p.core.link.frames import FrameType
from ciuic_p2p.identity import NodeKey
from ciuic_p2p.logsetup import configure_logging, get_logger
from ciuic_p2p.transport.base import Address, FrameReceived, PeerConnected, PeerDisconnected
from ciuic_p2p.transport.errors import TransportError
from ciuic_p2p.transport.lanering import LaneRing
from ciuic_p2p.transport.quic import QuicTransport

LANE_FRAME_TYPES = frozenset({FrameType.MESH_CHUNK})
"""What lanes carry: the chunks, which are most of a node's bytes and need no order
among themselves (each is signed and placed by its own header). Membership, probes,
direct and store traffic stay on the node's own link."""
LANE_HANDUP_BYTES = 16 * 1024 * 1024
"""Received bytes a lane hands the node and the node has not consumed, at most."""
HANDUP_FRAME_COST = 256
"""Bytes a handed-up frame counts for beyond its payload: empty frames are not free."""
CONSUMED_ACK_BYTES = 256 * 1024
"""The node tells a lane what it consumed once this much has gathered."""
OUT_OF_BAND_BYTES = 64 * 1024
"""A payload this large crosses the pipe as raw bytes after its message, not pickled."""
OUT_OF_BAND = "+"
IN_RING = "@"
RING_BYTES = 16 * 1024 * 1024
"""Each way between the node and a lane (transport.lanering)."""
PIPE_BUFFER_BYTES = 1 << 20
"""Socket buffers of a lane's pipe: a 1 MiB frame in few system calls."""
STATS_INTERVAL_S = 1.0
STOP_DRAIN_S = 2.0
"""How long a stopping lane goes on sending what it was handed, at most."""
START_TIMEOUT_S = 60.0
log = get_logger("ciuic.lanes")


class PipeWriter:
    """Messages written to a pipe by one thread, in the order given; a large payload
    (a message's last element) through ``ring`` when it has room."""

    def __init__(
        self,
        conn: Connection,
        on_broken: Callable[[], None] | None = None,
        ring: LaneRing | None = None,
    ) -> None:
        self._conn = conn
        self._ring = ring
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._on_broken = on_broken
        self.broken = False
        """The other side is gone: what is put is dropped."""
        threading.Thread(target=self._run, name="ciuic-lane-writer", daemon=True).start()

    def put(self, message: Any) -> None:
        if not self.broken:
            self._queue.put(message)

    def stop(self) -> None:
        self.broken = True
        self._queue.put(None)

    def _run(self) -> None:
        while (message := self._queue.get()) is not None:
            try:
                payload = message[-1]
                if isinstance(payload, bytes) and len(payload) >= OUT_OF_BAND_BYTES:
                    place = None if self._ring is None else self._ring.put(payload)
                    if place is not None:
                        self._conn.send((IN_RING, *message[:-1], *place))
                    else:  # pickled, a payload would be copied once more each way
                        self._conn.send((OUT_OF_BAND, *message[:-1]))
                        self._conn.send_bytes(payload)
                else:
                    self._conn.send(message)
            except (OSError, ValueError):  # the other side is gone
                self.broken = True
                while not self._queue.empty():  # what waited goes with it
                    self._queue.get_nowait()
                if self._on_broken is not None:
                    self._on_broken()
                return


def read_pipe(
    conn: Connection,
    loop: asyncio.AbstractEventLoop,
    deliver: Callable[[Any], None],
    ring: LaneRing | None = None,
) -> None:
    """Blocking reads of a pipe in a thread, each message handed to the loop (pipe
    ends stay blocking: an event loop's reader would make them non-blocking, and a
    large message then fails half-written). ``deliver(None)`` once the pipe ends."""

    def run() -> None:
        while True:
            try:
                message = conn.recv()
                if message[0] == OUT_OF_BAND:
                    message = (*message[1:], conn.recv_bytes())
                elif message[0] == IN_RING and ring is not None:
                    message = (*message[1:-3], ring.take(*message[-3:]))
            except (EOFError, OSError, ValueError):
                message = None
            try:
                loop.call_soon_threadsafe(deliver, message)
            except RuntimeError:  # the loop is closed
                return
            if message is None:
                return

    threading.Thread(target=run, name="ciuic-lane-reader", daemon=True).start()


# -- the lane process --------------------------------------------------------------------


class _Lane:
    """What runs in one lane process: its transport, the node's commands, and the
    frames and events it hands up."""

    def __init__(self, node: QuicTransport, out: PipeWriter) -> None:
        self.node = node
        self.out = out
        self.handed_up = 0
        self.room = asyncio.Event()
        self.room.set()
        self.sends: dict[bytes, tuple[asyncio.Queue[tuple[FrameType, bytes]], asyncio.Task[None]]]
        self.sends = {}
        self.tasks: set[asyncio.Task[None]] = set()

    def spawn(self, coro: Any) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def hand_up(self) -> None:
        while True:
            await self.room.wait()
            event = await self.node.next_event()
            if isinstance(event, FrameReceived):
                if event.type not in LANE_FRAME_TYPES:
                    # A lane carries chunks and nothing else: a peer that sends
                    # anything else on it loses its lane link (its node link stays).
                    self.spawn(self.node.disconnect(event.peer, "not a chunk on a lane"))
                    continue
                self.handed_up += len(event.payload) + HANDUP_FRAME_COST
                if self.handed_up >= LANE_HANDUP_BYTES:
                    self.room.clear()
                self.out.put(("frame", event.peer, int(event.type), event.payload))
            elif isinstance(event, PeerConnected):
                self.out.put(("up", event.peer))
            elif isinstance(event, PeerDisconnected):
                self.drop_sends(event.peer, f"lane link gone: {event.reason}")
                self.out.put(("down", event.peer, event.reason))

    def consumed(self, nbytes: int) -> None:
        self.handed_up = max(0, self.handed_up - nbytes)
        if self.handed_up < LANE_HANDUP_BYTES:
            self.room.set()

    def send(self, peer: bytes, frame_type: FrameType, payload: bytes) -> None:
        entry = self.sends.get(peer)
        if entry is None:
            box: asyncio.Queue[tuple[FrameType, bytes]] = asyncio.Queue()
            entry = self.sends[peer] = (box, self.spawn(self._sender(peer, box)))
        entry[0].put_nowait((frame_type, payload))

    def drop_sends(self, peer: bytes, reason: str) -> None:
        """The peer's link is gone: its queue and task go, each frame said failed."""
        entry = self.sends.pop(peer, None)
        if entry is None:
            return
        box, task = entry
        task.cancel()
        while not box.empty():
            _, payload = box.get_nowait()
            self.out.put(("sent", peer, len(payload), reason))

    def pending(self) -> bool:
        """Frames handed here and not yet taken by QUIC, or sent and not acknowledged."""
        return any(not box.empty() for box, _ in self.sends.values()) or bool(
            self.node.unacked_bytes()
        )

    async def _sender(self, peer: bytes, box: asyncio.Queue[tuple[FrameType, bytes]]) -> None:
        # One task per peer: a peer that grants no credit holds up only its own frames.
        while True:
            frame_type, payload = await box.get()
            error = ""
            try:
                await self.node.send(peer, frame_type, payload)
            except Exception as exc:  # said to the node, whatever it was
                error = str(exc) or type(exc).__name__
            self.out.put(("sent", peer, len(payload), error))

    async def connect(self, request: int, address: Address, expected: bytes) -> None:
        try:
            self.out.put(("connected", request, await self.node.connect(address, expected)))
        except TransportError as exc:
            self.out.put(("failed", request, str(exc)))

    async def report(self) -> None:
        while True:
            await asyncio.sleep(STATS_INTERVAL_S)
            unacked = self.node.unacked_bytes()
            self.out.put(("stats", self.stats(), self.node.udp_bytes_sent, unacked))

    def stats(self) -> dict[bytes, tuple[int, int, float | None, int]]:
        out = {}
        for peer in self.node.peers():
            s = self.node.link_stats(peer)
            if s is not None:
                out[peer] = (s.bytes_sent, s.bytes_received, s.receive_rate_bps, s.rate_samples)
        return out


def lane_main(conn: Connection) -> None:
    """A lane process: its set-up is the first message on ``conn``."""
    from ciuic_p2p.transport.loop import new_event_loop  # noqa: PLC0415

    # The node stops its lanes (or its pipe's end does): a Ctrl+C or a hang-up meant
    # for the node must not end them first.
    for signum in (signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    try:
        _, key_pem, cert_pem, trust_der, settings, address, rings, log = conn.recv()
    except (EOFError, OSError, ValueError):
        return
    configure_logging(LogSection(**log))
    # The node's ring to this lane, and this lane's to the node (or none).
    inbound, outbound = (
        (None, None)
        if rings is None
        else (
            LaneRing(rings[0], rings[2]),
            LaneRing(rings[1], rings[2]),
        )
    )

    async def run() -> None:
        loop = asyncio.get_running_loop()
        stopped = asyncio.Event()

        def broken() -> None:
            loop.call_soon_threadsafe(stopped.set)

        out = PipeWriter(conn, on_broken=broken, ring=outbound)
        key = NodeKey(serialization.load_pem_private_key(key_pem, None))  # type: ignore[arg-type]
        node = QuicTransport(
            key,
            x509.load_pem_x509_certificate(cert_pem),
            _trust(*trust_der),
            host=address[0],
            port=address[1],
            settings=TransportSection(**settings),
        )
        try:
            bound = await node.start()
        except OSError as exc:
            out.put(("error", f"lane cannot listen on {address[0]}:{address[1]}: {exc}"))
            out.stop()
            return
        out.put(("ready", bound))
        lane = _Lane(node, out)
        lane.spawn(lane.hand_up())
        lane.spawn(lane.report())

        def command(message: Any) -> None:
            if message is None or message[0] == "stop":
                stopped.set()
            elif message[0] == "send":
                lane.send(message[1], FrameType(message[2]), message[3])
            elif message[0] == "consumed":
                lane.consumed(message[1])
            elif message[0] == "connect":
                lane.spawn(lane.connect(message[1], tuple(message[2]), message[3]))
            elif message[0] == "disconnect":
                lane.spawn(node.disconnect(message[1], message[2]))
            elif message[0] == "trust":
                node.set_trust(_trust(*message[1]))

        read_pipe(conn, loop, lambda message: node.guard.call("command", command, message), inbound)
        await stopped.wait()
        end = loop.time() + STOP_DRAIN_S
        while lane.pending() and loop.time() < end and not out.broken:
            await asyncio.sleep(0.01)  # what the node handed over still leaves
        for task in list(lane.tasks):
            task.cancel()
        await node.close()
        out.stop()

    loop = new_event_loop()
    try:
        loop.run_until_complete(run())
    finally:
        loop.close()


def _rings() -> tuple[tuple[LaneRing, int], tuple[LaneRing, int]] | None:
    """Two rings (node to lane, lane to node) and their descriptors; None where the
    platform has no memfd (the pipe carries everything then)."""
    try:
        first = LaneRing.create(RING_BYTES)
    except (OSError, AttributeError):
        return None
    try:
        return first, LaneRing.create(RING_BYTES)
    except OSError:
        os.close(first[1])
        return None


def _trust(ca_der: bytes, crl_der: bytes | None) -> Trust:
    return Trust(
        x509.load_der_x509_certificate(ca_der),
        None if crl_der is None else x509.load_der_x509_crl(crl_der),
    )


def _trust_der(trust: Trust) -> tuple[bytes, bytes | None]:
    crl = None if trust.crl is None else trust.crl.public_bytes(serialization.Encoding.DER)
    return trust.ca.public_bytes(serialization.Encoding.DER), crl


# -- the node's side -----------------------------------------------------------------------


class LaneListener(Protocol):
    """What a pool tells the transport that owns it (transport.laned), on its loop."""

    def lane_frame(self, lane: int, peer: bytes, frame_type: FrameType, payload: bytes) -> None:
        """A frame a lane received from an authenticated peer."""

    def lane_up(self, lane: int, peer: bytes) -> None: ...

    def lane_down(self, lane: int, peer: bytes, reason: str) -> None: ...

    def lane_sent(self, lane: int, peer: bytes, nbytes: int, error: str) -> None:
        """A frame handed to the lane left it (``error`` empty) or failed."""

    def lane_ended(self, lane: int) -> None:
        """The lane's process is gone: its links with it, and its unsent frames."""


@dataclass(frozen=True, slots=True)
class LaneStats:
    """What a lane reported last (every ``STATS_INTERVAL_S``)."""

    links: dict[bytes, tuple[int, int, float | None, int]]
    """Peer -> (bytes sent, bytes received, receive rate in bit/s or None, samples)."""
    udp_bytes_sent: int
    unacked_bytes: int = 0
    """Sent on the lane's links and not acknowledged yet."""


class LanePool:
    """K lane processes of one node. ``await pool.start()``; then :meth:`connect`,
    :meth:`send`, :meth:`consumed`; what lanes receive and report reaches the
    ``listener``; :meth:`close` ends the processes."""

    def __init__(
        self,
        key: NodeKey,
        certificate: x509.Certificate,
        trust: Trust,
        lanes: int,
        listener: LaneListener,
        *,
        settings: TransportSection | None = None,
        host: str = "127.0.0.1",
        base_port: int = 0,
        log: LogSection | None = None,
    ) -> None:
        """``base_port``: lane i listens on ``base_port + i`` (0: any free port);
        ``log``: how the lanes log (the node's section: JSON, rate-limited)."""
        if lanes < 1:
            raise ValueError("at least one lane")
        self.lanes = lanes
        self.listener = listener
        self._key_pem = key.to_pem()
        self._cert_pem = certificate.public_bytes(serialization.Encoding.PEM)
        self._trust = _trust_der(trust)
        self._settings = asdict(settings or TransportSection())
        self._host, self._base_port = host, base_port
        self._log = asdict(log or LogSection())
        self._procs: list[subprocess.Popen[bytes]] = []
        self._writers: list[PipeWriter] = []
        self._ready: list[asyncio.Future[Any]] = []
        self._requests: dict[int, tuple[int, asyncio.Future[Any]]] = {}
        self.ended: set[int] = set()
        """Lanes whose process ended (the node stops using them)."""
        self._next_request = 0
        self._unacked = [0] * lanes
        self.stats: list[LaneStats] = [LaneStats({}, 0) for _ in range(lanes)]
        self.addresses: list[Address] = []
        self._closed = False

    @property
    def pids(self) -> list[int]:
        """The lane processes' PIDs (ours, ended by :meth:`close`)."""
        return [p.pid for p in self._procs]

    async def start(self) -> list[Address]:
        """Start the lanes; the address each listens on. Raises TransportError when
        one cannot start (its port taken, say): the others are ended then."""
        loop = asyncio.get_running_loop()
        for lane in range(self.lanes):
            rings = _rings()
            ours, theirs = socket.socketpair()
            for end in (ours, theirs):
                end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, PIPE_BUFFER_BYTES)
                end.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, PIPE_BUFFER_BYTES)
            # A fresh interpreter, not multiprocessing's spawn: that would import the
            # trainer's own script again in each lane (train.embedded runs in it).
            fds = () if rings is None else (rings[0][1], rings[1][1])
            proc = subprocess.Popen(
                [sys.executable, "-m", "ciuic_p2p.transport.lanes", str(theirs.fileno())],
                pass_fds=(theirs.fileno(), *fds),
            )
            theirs.close()
            for fd in fds:
                os.close(fd)  # each end keeps its mapping
            conn = Connection(ours.detach())
            port = self._base_port + lane if self._base_port else 0
            to_lane, from_lane = (None, None) if rings is None else (rings[0][0], rings[1][0])
            writer = PipeWriter(conn, ring=to_lane)
            ring_fds = None if rings is None else (*fds, RING_BYTES)
            address = (self._host, port)
            init = (
                self._key_pem,
                self._cert_pem,
                self._trust,
                self._settings,
                address,
                ring_fds,
                self._log,
            )
            writer.put(("init", *init))
            self._ready.append(loop.create_future())
            read_pipe(conn, loop, functools.partial(self._on_message, lane), from_lane)
            self._procs.append(proc)
            self._writers.append(writer)
        try:
            for ready in self._ready:
                kind, value = await asyncio.wait_for(ready, START_TIMEOUT_S)
                if kind != "ready":
                    raise TransportError(str(value))
                self.addresses.append((str(value[0]), int(value[1])))
        except (TransportError, TimeoutError) as exc:
            await self.close()
            raise TransportError(f"lanes did not start: {exc or 'timeout'}") from None
        return self.addresses

    def _on_message(self, lane: int, message: Any) -> None:
        if message is None:  # the lane ended: nothing more comes from it
            self.ended.add(lane)
            self._writers[lane].stop()  # nothing more goes to it either
            self._procs[lane].poll()  # reaped
            self._answer(self._ready[lane], ("error", "lane process ended"))
            for of, future in list(self._requests.values()):
                if of == lane:
                    self._answer(future, ("failed", "lane process ended"))
            self.listener.lane_ended(lane)
            return
        kind = message[0]
        if kind == "frame":
            self.listener.lane_frame(lane, message[1], FrameType(message[2]), message[3])
        elif kind == "sent":
            self.listener.lane_sent(lane, message[1], message[2], message[3])
        elif kind == "up":
            self.listener.lane_up(lane, message[1])
        elif kind == "down":
            self.listener.lane_down(lane, message[1], message[2])
        elif kind == "stats":
            self.stats[lane] = LaneStats(message[1], message[2], message[3])
        elif kind in ("ready", "error"):
            self._answer(self._ready[lane], (kind, message[1]))
        elif kind in ("connected", "failed"):
            pending = self._requests.get(message[1])
            if pending is not None:
                self._answer(pending[1], (kind, message[2]))

    @staticmethod
    def _answer(future: asyncio.Future[Any], value: Any) -> None:
        if not future.done():
            future.set_result(value)

    async def connect(self, lane: int, address: Address, expected_peer: bytes) -> None:
        """Dial ``address`` from ``lane``; raises TransportError unless the node
        there proves to be ``expected_peer``."""
        if lane in self.ended or self._closed:
            raise TransportError(f"lane {lane} has ended")
        request = self._next_request
        self._next_request += 1
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._requests[request] = (lane, future)
        self._writers[lane].put(("connect", request, address, expected_peer))
        try:
            kind, value = await future
        finally:
            self._requests.pop(request, None)
        if kind != "connected":
            raise TransportError(str(value))

    def send(self, lane: int, peer: bytes, frame_type: FrameType, payload: bytes) -> None:
        """Hand a frame to a lane (returns at once; ``lane_sent`` says when it left)."""
        self._writers[lane].put(("send", peer, int(frame_type), payload))

    def consumed(self, lane: int, payload_len: int) -> None:
        """The node consumed a frame a lane handed up: told in batches."""
        self._unacked[lane] += payload_len + HANDUP_FRAME_COST
        if self._unacked[lane] >= CONSUMED_ACK_BYTES:
            self._writers[lane].put(("consumed", self._unacked[lane]))
            self._unacked[lane] = 0

    def disconnect(self, peer: bytes, reason: str) -> None:
        for writer in self._writers:
            writer.put(("disconnect", peer, reason))

    def set_trust(self, trust: Trust) -> None:
        """Every lane checks its links against ``trust`` and drops those it refuses."""
        self._trust = _trust_der(trust)
        for writer in self._writers:
            writer.put(("trust", self._trust))

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        loop = asyncio.get_running_loop()
        for writer in self._writers:
            writer.put(("stop",))
            writer.stop()
        for proc in self._procs:
            try:
                await loop.run_in_executor(None, proc.wait, 5)
            except subprocess.TimeoutExpired:
                proc.kill()  # ours, by its PID
                await loop.run_in_executor(None, proc.wait)
        for _, future in self._requests.values():
            self._answer(future, ("failed", "lanes closed"))


if __name__ == "__main__":
    lane_main(Connection(int(sys.argv[1])))
