"""The attackers of the hostile tests and of bench/hostile.py.

- Strangers: datagrams from many source addresses of 127.0.0.0/8 (Linux routes the
  whole block to loopback, so one process can send from 127.x.y.z without any set-up),
  bounded in count.
- :class:`Liar`: a member of the cluster. It holds a real node certificate of the
  cluster CA, so every daemon admits it; it speaks as itself (the daemons drop any frame
  whose sender is not its link's authenticated peer) and says whatever it is told
  about the others. It answers probes, so it stays a member while it is used.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import random
import socket
import struct
from collections.abc import Callable

from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from cryptography.hazmat.primitives import serialization

from ciuic_p2p.admission import ClusterCA, Trust
from ciuic_p2p.core.link.frames import FrameType
from ciuic_p2p.core.mesh.identities import Identities
from ciuic_p2p.core.mesh.messages import (
    Ack,
    Alive,
    Body,
    Chunk,
    Coordinate,
    Credential,
    Dead,
    Gossip,
    Message,
    Ping,
    Suspect,
    Sync,
    Update,
    decode_message,
    encode_message,
)
from ciuic_p2p.identity import NodeKey, peer_id_of
from ciuic_p2p.transport.base import FrameReceived
from ciuic_p2p.transport.link import ALPN
from ciuic_p2p.transport.quic import QuicTransport


def source_hosts(count: int, first_octet: int = 1) -> list[str]:
    """``count`` loopback addresses outside 127.0.0.0/24 (where honest nodes listen),
    spread over ``count // 250 + 1`` networks of /24."""
    hosts = []
    for i in range(count):
        third, fourth = divmod(i, 250)
        hosts.append(f"127.{first_octet}.{third}.{fourth + 2}")
    return hosts


def long_header(version: int, first: int = 0xC0, rng: random.Random | None = None) -> bytes:
    """A 1200-byte datagram with a QUIC long header (Initial type by default) of
    ``version``, random connection IDs and a random, undecryptable payload."""
    rng = rng or random.Random(0)
    dcid, scid = rng.randbytes(8), rng.randbytes(8)
    head = bytes([first]) + struct.pack(">I", version) + bytes([8]) + dcid + bytes([8]) + scid
    if first & 0x30 == 0:  # Initial: token length 0, then a length that covers the rest
        rest = 1200 - len(head) - 3
        head += b"\x00" + struct.pack(">H", 0x4000 | rest)
    return head + rng.randbytes(1200 - len(head))


def client_hello(addr: tuple[str, int], padded_after: bool = True) -> bytes:
    """A real QUIC Initial with a TLS ClientHello, as a client sends first: aioquic's,
    padded to 1200 bytes after the packet, or (``padded_after`` False) qh3 2.x's,
    padded inside it, which a qh3 2.x server takes without a Retry
    (transport.backend)."""
    quic: QuicConnection
    if padded_after:
        conf = QuicConfiguration(is_client=True, alpn_protocols=[ALPN])
        quic = QuicConnection(configuration=conf)
    else:
        from qh3.quic.configuration import QuicConfiguration as Qh3Configuration  # noqa: PLC0415
        from qh3.quic.connection import QuicConnection as Qh3Connection  # noqa: PLC0415

        qh3_conf = Qh3Configuration(is_client=True, alpn_protocols=[ALPN])
        quic = Qh3Connection(configuration=qh3_conf)  # type: ignore[assignment]
    quic.connect(addr, now=0.0)
    return bytes(quic.datagrams_to_send(now=0.0)[0][0])


class Sprayer:
    """One UDP socket per source address; sends what it is given, round robin."""

    def __init__(self, hosts: list[str]) -> None:
        self.sockets = []
        for host in hosts:
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.setblocking(False)
            s.bind((host, 0))
            self.sockets.append(s)
        self.sent = 0

    async def spray(
        self, target: tuple[str, int], datagrams: list[bytes], per_tick: int = 200
    ) -> None:
        """Send every datagram once, ``per_tick`` per loop turn (so the target's loop,
        in this same process, gets its turns)."""
        for i, data in enumerate(datagrams):
            s = self.sockets[i % len(self.sockets)]
            try:
                s.sendto(data, target)
                self.sent += 1
            except BlockingIOError:
                pass
            if i % per_tick == per_tick - 1:
                await asyncio.sleep(0)

    def close(self) -> None:
        for s in self.sockets:
            s.close()


def random_datagrams(count: int, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(rng.randrange(1, 1400)) for _ in range(count)]


class Liar:
    """A member with a real certificate that sends what it is told (see the module
    docstring)."""

    def __init__(self, ca: ClusterCA, addresses: Callable[[str], str]) -> None:
        """A member of ``ca``'s cluster; ``addresses`` gives a daemon's ``host:port``
        by the name a caller uses for it."""
        now = dt.datetime.now(dt.UTC)
        trust = Trust(ca.certificate)
        self.addresses = addresses
        self.key = NodeKey.generate()
        self.certificate = ca.issue(self.key.public_key, now)
        self.der = self.certificate.public_bytes(serialization.Encoding.DER)
        self.peer_id = peer_id_of(self.key.public_key)
        self.transport = QuicTransport(self.key, self.certificate, trust)
        self.identities = Identities(
            self.peer_id,
            self.der,
            self.key.sign,
            lambda node, der: trust.check_member(node, der, now),
        )
        self.address = ""
        self.incarnation = 0
        self.links: dict[str, bytes] = {}
        self.received: list[Message] = []
        self.store_frames: list[tuple[bytes, bytes]] = []
        """(sender key, payload) of every STORE_* frame the liar received."""
        self._reader: asyncio.Task[None] | None = None

    async def start(self) -> None:
        host, port = await self.transport.start()
        self.address = f"{host}:{port}"
        self._reader = asyncio.get_running_loop().create_task(self._read())

    def signed_chunk(self, chunk: Chunk) -> Chunk:
        """``chunk`` with the liar's signature (valid only if the liar is its origin)."""
        return dataclasses.replace(chunk, signature=self.identities.sign(chunk))

    def own_alive(self, incarnation: int = 0) -> Alive:
        alive = Alive(self.peer_id, incarnation, self.address)
        return dataclasses.replace(alive, signature=self.identities.sign(alive))

    async def link(self, name: str) -> bytes:
        if name not in self.links:
            host, port = self.addresses(name).rsplit(":", 1)
            self.links[name] = await self.transport.connect((host, int(port)))
        return self.links[name]

    async def join(self, *names: str) -> None:
        """Become a member of every named daemon's table (a SYNC with its credential)."""
        for name in names:
            await self.say(
                name, Sync(False, (Credential(self.peer_id, self.der), self.own_alive()))
            )

    async def say(self, name: str, *bodies: Body) -> None:
        """Mesh messages to daemon ``name``, each as its own frame."""
        key = await self.link(name)
        for body in bodies:
            ftype = FrameType.MESH_CHUNK if isinstance(body, Chunk) else FrameType.GOSSIP
            await self.transport.send(key, ftype, encode_message(Message(self.peer_id, body)))

    async def gossip(self, name: str, *updates: Update) -> None:
        await self.say(name, Gossip(tuple(updates)))

    async def frame(self, name: str, ftype: FrameType, payload: bytes) -> None:
        await self.transport.send(await self.link(name), ftype, payload)

    async def _read(self) -> None:
        while True:
            event = await self.transport.next_event()
            if not isinstance(event, FrameReceived):
                continue
            if event.type in (FrameType.STORE_CONTROL, FrameType.STORE_DATA):
                self.store_frames.append((event.peer, event.payload))
                continue
            if event.type not in (FrameType.GOSSIP, FrameType.MESH_CHUNK):
                continue
            msg = decode_message(event.payload)
            self.received.append(msg)
            body = msg.body
            # Answer probes and refute suspicion: a liar that stays a member while used.
            if isinstance(body, Ping) and body.target == self.peer_id:
                ack = Message(self.peer_id, Ack(body.seq, Coordinate()))
                await self.transport.send(event.peer, FrameType.GOSSIP, encode_message(ack))
            updates = getattr(body, "updates", ())
            accused = [
                u.incarnation
                for u in updates
                if isinstance(u, Suspect | Dead) and u.node == self.peer_id
            ]
            if accused and max(accused) >= self.incarnation:
                self.incarnation = max(accused) + 1
                refute = Message(self.peer_id, Gossip((self.own_alive(self.incarnation),)))
                for key in self.links.values():
                    with contextlib.suppress(Exception):
                        await self.transport.send(key, FrameType.GOSSIP, encode_message(refute))

    def stop_reading(self) -> None:
        """Read nothing more: no credit goes back, what is sent to the liar piles up at
        its senders (a member that asks and never reads)."""
        if self._reader is not None:
            self._reader.cancel()

    async def close(self) -> None:
        self.stop_reading()
        await self.transport.close()


def fresh_certificates(count: int, cluster: str = "hostile-test") -> list[Credential]:
    """``count`` credentials that look like the cluster's own: issued by a CA of the same
    name (so their issuer matches, and only the signature check refuses them), each for
    a key of its own whose peer ID it names. Each costs a member a full check."""
    now = dt.datetime.now(dt.UTC)
    forger = ClusterCA.create(cluster, now)
    out = []
    for _ in range(count):
        key = NodeKey.generate()
        der = forger.issue(key.public_key, now).public_bytes(serialization.Encoding.DER)
        out.append(Credential(peer_id_of(key.public_key), der))
    return out
