"""An in-memory transport with the same interface and semantics as the QUIC one:
admission by certificate, one link per peer pair, credit-based flow control on bulk
frames, clean closes. Used by unit tests of the layers above, so they never know
which transport they run on. Frames are delivered on the next loop iteration, in
order; an optional one-way latency delays them."""

from __future__ import annotations

import asyncio
import datetime as dt
import struct
from dataclasses import dataclass, field

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from ciuic_p2p.admission import Trust
from ciuic_p2p.config import TransportSection
from ciuic_p2p.core.link.frames import (
    CreditSender,
    FlowControlError,
    FrameType,
    ReceiveQuota,
    bulk_cost,
    encode_frame,
)
from ciuic_p2p.core.link.rtt import RttEstimator
from ciuic_p2p.errors import AdmissionError
from ciuic_p2p.identity import peer_id_of
from ciuic_p2p.transport.base import (
    Address,
    FrameReceived,
    LinkStats,
    PeerConnected,
    PeerDisconnected,
    RttStats,
    Transport,
    TransportEvent,
)
from ciuic_p2p.transport.quic import TransportError


@dataclass
class MemoryNetwork:
    """The switchboard: which in-memory transport listens at which address."""

    latency_s: float = 0.0
    listeners: dict[Address, MemoryTransport] = field(default_factory=dict)
    next_port: int = 1


@dataclass
class _MemLink:
    peer: bytes
    remote: MemoryTransport
    address: Address
    dialed: bool
    credit_out: CreditSender
    quota: ReceiveQuota
    credit_changed: asyncio.Event = field(default_factory=asyncio.Event)
    rtt: RttEstimator = field(default_factory=RttEstimator)
    bytes_sent: int = 0
    bytes_received: int = 0
    closed: bool = False


class MemoryTransport(Transport):
    def __init__(
        self,
        network: MemoryNetwork,
        public_key: bytes,
        certificate: x509.Certificate,
        trust: Trust,
        settings: TransportSection | None = None,
        now: dt.datetime | None = None,
    ) -> None:
        self.network = network
        self.local_key = public_key
        self.certificate = certificate
        self.trust = trust
        self.settings = settings or TransportSection()
        self.now = now
        self.address: Address = ("mem", 0)
        self._links: dict[bytes, _MemLink] = {}
        self._events: asyncio.Queue[TransportEvent] = asyncio.Queue()
        self.refused = 0

    def _wallclock(self) -> dt.datetime:
        return self.now or dt.datetime.now(dt.UTC)

    async def start(self) -> Address:
        self.address = ("mem", self.network.next_port)
        self.network.next_port += 1
        self.network.listeners[self.address] = self
        return self.address

    async def connect(self, address: Address, expected_peer: bytes | None = None) -> bytes:
        remote = self.network.listeners.get(address)
        if remote is None:
            raise TransportError(f"nothing listens at {address}")
        try:
            server_key = self.trust.verify(remote.certificate, self._wallclock())
        except AdmissionError as exc:
            self.refused += 1
            raise TransportError(f"refused: {exc}") from exc
        if expected_peer is not None and server_key != expected_peer:
            raise TransportError(f"{address} is {peer_id_of(server_key)}, not the peer expected")
        try:
            remote.trust.verify(self.certificate, remote._wallclock())
        except AdmissionError as exc:
            remote.refused += 1
            raise TransportError(f"refused: {exc}") from exc
        if server_key in self._links:
            return server_key
        self._attach(remote, address, dialed=True)
        remote._attach(self, self.address, dialed=False)
        return server_key

    def _attach(self, remote: MemoryTransport, address: Address, dialed: bool) -> None:
        window = remote.settings.receive_window_bytes
        link = _MemLink(
            peer=remote.local_key,
            remote=remote,
            address=address,
            dialed=dialed,
            credit_out=CreditSender(window),
            quota=ReceiveQuota(self.settings.receive_window_bytes),
        )
        self._links[remote.local_key] = link
        der = remote.certificate.public_bytes(serialization.Encoding.DER)
        self._events.put_nowait(PeerConnected(remote.local_key, address, dialed, der))

    def _deliver(self, sender: bytes, frame_type: FrameType, payload: bytes) -> None:
        link = self._links.get(sender)
        if link is None or link.closed:
            return
        link.bytes_received += len(payload) + 5
        if frame_type is FrameType.CREDIT:
            (amount,) = struct.unpack("<Q", payload) if len(payload) == 8 else (0,)
            limit = self.settings.max_credit_bytes - link.credit_out.available
            if not 0 < amount <= limit:  # as the QUIC transport: the link goes
                asyncio.get_running_loop().create_task(
                    self.disconnect(sender, "CREDIT beyond the bound")
                )
                return
            link.credit_out.grant(amount)
            link.credit_changed.set()
            return
        try:
            link.quota.received(frame_type, len(payload))
        except FlowControlError as exc:
            asyncio.get_running_loop().create_task(self.disconnect(sender, str(exc)))
            return
        self._events.put_nowait(FrameReceived(sender, frame_type, payload))

    def _post(self, link: _MemLink, frame_type: FrameType, payload: bytes) -> None:
        link.bytes_sent += len(payload) + 5
        loop = asyncio.get_running_loop()
        args = (self.local_key, frame_type, payload)
        if self.network.latency_s > 0:
            loop.call_later(self.network.latency_s, link.remote._deliver, *args)
        else:
            loop.call_soon(link.remote._deliver, *args)

    async def send(self, peer: bytes, frame_type: FrameType, payload: bytes) -> None:
        link = self._links.get(peer)
        if link is None or link.closed:
            raise TransportError(f"no link to {peer_id_of(peer)}")
        encode_frame(frame_type, payload)  # the same size limits as on the wire
        cost = bulk_cost(frame_type, len(payload))
        while cost and not link.credit_out.try_spend(cost):
            link.credit_changed.clear()
            try:
                await asyncio.wait_for(link.credit_changed.wait(), self.settings.stall_timeout_s)
            except TimeoutError:
                await self.disconnect(peer, "peer stalled: no credit")
                raise TransportError(f"{peer_id_of(peer)} stopped reading; dropped") from None
            if link.closed:
                raise TransportError(f"link to {peer_id_of(peer)} closed")
        self._post(link, frame_type, payload)

    async def next_event(self) -> TransportEvent:
        event = await self._events.get()
        if isinstance(event, FrameReceived):
            link = self._links.get(event.peer)
            if link is not None and not link.closed:
                grant = link.quota.consumed(event.type, len(event.payload))
                if grant:
                    self._post(link, FrameType.CREDIT, struct.pack("<Q", grant))
        return event

    def peers(self) -> list[bytes]:
        return [p for p, link in self._links.items() if not link.closed]

    def rtt(self, peer: bytes) -> RttStats | None:
        if peer not in self._links:
            return None
        rtt = 2 * self.network.latency_s
        return RttStats(rtt, rtt, 0.0, rtt, rtt, 0.0, 1)

    def link_stats(self, peer: bytes) -> LinkStats | None:
        link = self._links.get(peer)
        if link is None:
            return None
        window = link.remote.settings.receive_window_bytes
        return LinkStats(
            link.bytes_sent,
            link.bytes_received,
            max(0, window - link.credit_out.available),
            link.credit_out.available,
        )

    async def disconnect(self, peer: bytes, reason: str) -> None:
        link = self._links.pop(peer, None)
        if link is None:
            return
        link.closed = True
        link.credit_changed.set()
        self._events.put_nowait(PeerDisconnected(peer, reason))
        await link.remote.disconnect(self.local_key, "peer closed: " + reason)

    async def close(self) -> None:
        for peer in list(self._links):
            await self.disconnect(peer, "node shutting down")
        self.network.listeners.pop(self.address, None)
