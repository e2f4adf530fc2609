"""Lanes: one node's bulk traffic spread over several processes, one core each.

Pure-Python QUIC moves about 15 MB/s per core here, below an inter-region link. A
:class:`LanePool` starts K lane processes; each runs its own QuicTransport (own UDP
socket, the node's own credentials) and verifies the origin signature of every chunk
it receives before handing it up. Lane i of one node connects to lane i of a peer.
The node sends a chunk through the lane its (bucket, range start) hashes to, so the
chunks of one step spread over all lanes, and hands it over a pipe: a 1 MiB copy costs
about 0.2 ms, against about 60 ms of QUIC work per MB on each side.

Every lane is a process of ours, started with ``spawn`` and ended by its PID.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import multiprocessing as mp
import threading
import zlib
from collections.abc import Callable
from dataclasses import asdict
from multiprocessing.connection import Connection
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from ciuic_p2p.admission import Trust
from ciuic_p2p.config import TransportSection
from ciuic_p2p.core.codec.origin import ChunkFilter
from ciuic_p2p.core.link.frames import FrameType
from ciuic_p2p.identity import NodeKey
from ciuic_p2p.transport.base import Address, FrameReceived
from ciuic_p2p.transport.quic import QuicTransport, TransportError


def _read_in_thread(
    conn: Connection, loop: asyncio.AbstractEventLoop, deliver: Callable[[Any], None]
) -> None:
    """Blocking reads of a pipe in a thread, each message handed to the loop: pipe
    ends stay blocking (an event loop's reader would make them non-blocking, and a
    large message then fails half-written)."""

    def run() -> None:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                return
            try:
                loop.call_soon_threadsafe(deliver, message)
            except RuntimeError:  # the loop is closed
                return

    threading.Thread(target=run, name="ciuic-lane-pipe", daemon=True).start()


def lane_of(chunk: bytes, lanes: int) -> int:
    """The lane a chunk travels on: a hash of its bucket and range start."""
    return zlib.crc32(chunk[88:96] + chunk[104:108]) % lanes


def _lane_main(
    conn: Connection,
    key_pem: bytes,
    cert_pem: bytes,
    ca_pem: bytes,
    settings: dict[str, Any],
    host: str,
) -> None:
    from ciuic_p2p.transport.loop import new_event_loop  # noqa: PLC0415

    async def run() -> None:
        key = NodeKey(serialization.load_pem_private_key(key_pem, None))  # type: ignore[arg-type]
        node = QuicTransport(
            key,
            x509.load_pem_x509_certificate(cert_pem),
            Trust(x509.load_pem_x509_certificate(ca_pem)),
            host=host,
            settings=TransportSection(**settings),
        )
        address = await node.start()
        conn.send(("ready", address))
        loop = asyncio.get_running_loop()
        inbox = ChunkFilter()
        commands: asyncio.Queue[Any] = asyncio.Queue()
        _read_in_thread(conn, loop, commands.put_nowait)

        async def forward() -> None:
            while True:
                event = await node.next_event()
                if (
                    isinstance(event, FrameReceived)
                    and event.type is FrameType.CHUNK
                    and inbox.admit(event.payload) is not None
                ):
                    conn.send(("chunk", event.peer, event.payload))

        forwarder = loop.create_task(forward())
        while True:
            command = await commands.get()
            if command[0] == "connect":
                try:
                    conn.send(("connected", await node.connect(command[1])))
                except TransportError as exc:
                    conn.send(("error", str(exc)))
            elif command[0] == "send":
                try:
                    await node.send(command[1], FrameType.CHUNK, command[2])
                except TransportError as exc:
                    conn.send(("error", str(exc)))
            elif command[0] == "stop":
                break
        forwarder.cancel()
        await node.close()

    loop = new_event_loop()
    try:
        loop.run_until_complete(run())
    finally:
        loop.close()


class LanePool:
    """K lane processes for one node. Use ``await pool.start()``, then
    :meth:`connect` to a peer's lane addresses, :meth:`send` chunks and
    :meth:`next_chunk` to receive; :meth:`close` ends the processes."""

    def __init__(
        self,
        key: NodeKey,
        certificate: x509.Certificate,
        ca: x509.Certificate,
        lanes: int,
        settings: TransportSection | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        if lanes < 1:
            raise ValueError("at least one lane")
        self.lanes = lanes
        self._args = (
            key.to_pem(),
            certificate.public_bytes(serialization.Encoding.PEM),
            ca.public_bytes(serialization.Encoding.PEM),
            asdict(settings or TransportSection()),
            host,
        )
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        self._replies: list[asyncio.Queue[Any]] = []
        self._chunks: asyncio.Queue[tuple[bytes, bytes]] = asyncio.Queue()
        self.addresses: list[Address] = []

    async def start(self) -> list[Address]:
        ctx = mp.get_context("spawn")
        loop = asyncio.get_running_loop()
        for _ in range(self.lanes):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_lane_main, args=(child, *self._args), daemon=True)
            proc.start()
            child.close()
            replies: asyncio.Queue[Any] = asyncio.Queue()
            _read_in_thread(parent, loop, functools.partial(self._on_message, replies))
            self._procs.append(proc)
            self._conns.append(parent)
            self._replies.append(replies)
        for replies in self._replies:
            kind, address = await asyncio.wait_for(replies.get(), 30)
            if kind != "ready":
                raise TransportError(f"lane failed to start: {address}")
            self.addresses.append(tuple(address))
        return self.addresses

    def _on_message(self, replies: asyncio.Queue[Any], message: Any) -> None:
        if message[0] == "chunk":
            self._chunks.put_nowait((message[1], message[2]))
        else:
            replies.put_nowait(message)

    async def connect(self, peer_lanes: list[Address]) -> bytes:
        """Connect lane i to the peer's lane i; return the peer's key."""
        if len(peer_lanes) != self.lanes:
            raise TransportError(f"peer has {len(peer_lanes)} lanes, this node {self.lanes}")
        for conn, address in zip(self._conns, peer_lanes, strict=True):
            conn.send(("connect", address))
        peers: set[bytes] = set()
        for replies in self._replies:
            kind, value = await asyncio.wait_for(replies.get(), 30)
            if kind != "connected":
                raise TransportError(f"lane connect failed: {value}")
            peers.add(value)
        if len(peers) != 1:
            raise TransportError("the peer's lanes belong to different nodes")
        return peers.pop()

    @property
    def pids(self) -> list[int]:
        """The lane processes' PIDs (ours, ended by :meth:`close`)."""
        return [p.pid for p in self._procs if p.pid is not None]

    def send(self, peer: bytes, chunk: bytes) -> None:
        """Hand a signed chunk to its lane (returns at once; the lane paces it)."""
        self._conns[lane_of(chunk, self.lanes)].send(("send", peer, chunk))

    async def next_chunk(self) -> tuple[bytes, bytes]:
        """(origin peer, chunk) of the next verified chunk from any lane."""
        return await self._chunks.get()

    async def close(self) -> None:
        loop = asyncio.get_running_loop()
        for conn in self._conns:
            with contextlib.suppress(BrokenPipeError, OSError):
                conn.send(("stop",))
        for proc in self._procs:
            await loop.run_in_executor(None, proc.join, 5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for conn in self._conns:
            conn.close()
