"""An in-memory transport with the same interface and the same protocol as the QUIC
one: each link's two ends are link sessions (core.link.session), so admission (the
proof of possession, bound to the link's IDs), credit, ping/pong and close are the
very code QUIC runs; only the bytes travel through memory instead of UDP. The layers
above (the daemon included) run on it without knowing which transport they have.

Bytes arrive on the next loop iteration, in order per link; an optional one-way
latency delays them. The "TLS handshake" is the dialer reading the listener's
certificate from the switchboard, which is what a real handshake proves."""

from __future__ import annotations

import asyncio
import collections
import datetime as dt
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from ciuic_p2p.admission import Trust
from ciuic_p2p.config import TransportSection
from ciuic_p2p.core.link.frames import FrameType
from ciuic_p2p.core.link.keys import Signer
from ciuic_p2p.core.link.session import (
    Authenticated,
    Closed,
    CreditGranted,
    FrameArrived,
    Lane,
    LinkSession,
    LocalIdentity,
)
from ciuic_p2p.errors import AdmissionError
from ciuic_p2p.guard import Guard
from ciuic_p2p.identity import peer_id_of
from ciuic_p2p.transport.base import (
    Address,
    LinkStats,
    RttStats,
    StrangerStats,
    Transport,
    TransportEvent,
)
from ciuic_p2p.transport.errors import DuplicateLinkError, TransportError
from ciuic_p2p.transport.sessions import LinkBook, SessionLink


@dataclass
class MemoryNetwork:
    """The switchboard: which in-memory transport listens at which address."""

    latency_s: float = 0.0
    listeners: dict[Address, MemoryTransport] = field(default_factory=dict)
    next_port: int = 1
    link_ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))


class _MemLink(SessionLink):
    def __init__(
        self, owner: MemoryTransport, session: LinkSession, address: Address, dialed: bool
    ) -> None:
        super().__init__(session, address, dialed)
        self.owner = owner
        self.remote: _MemLink | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.timer_at: float | None = None
        self.inbox: collections.deque[tuple[float, Lane | None, bytes | str]] = collections.deque()
        """What the peer's end sent, in order: (when it arrives, lane, bytes), or
        (when, None, reason) for the peer's end closing."""
        self.inbox_timer: asyncio.TimerHandle | None = None


class MemoryTransport(Transport):
    def __init__(
        self,
        network: MemoryNetwork,
        key: Signer,
        certificate: x509.Certificate,
        trust: Trust,
        settings: TransportSection | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        wallclock: Callable[[], dt.datetime] | None = None,
    ) -> None:
        self.network = network
        self.key = key
        self.local_key = key.public_key
        self.certificate = certificate
        self.certificate_der = certificate.public_bytes(serialization.Encoding.DER)
        self.identity = LocalIdentity(key, self.certificate_der)
        self.trust = trust
        self.settings = settings or TransportSection()
        self.clock = clock
        self.wallclock = wallclock or (lambda: dt.datetime.now(dt.UTC))
        self.address: Address = ("mem", 0)
        self.refused = 0
        self.udp_bytes_sent = 0
        """Bytes this end handed to memory (the name is the interface's)."""
        self.guard = Guard("transport")
        self._pending: set[_MemLink] = set()
        self._book: LinkBook[_MemLink] = LinkBook(
            self.local_key, self.settings, flush=self._flush, drop=self._drop
        )

    def _session(self, dialed: bool) -> LinkSession:
        return LinkSession(
            dialed=dialed,
            identity=self.identity,
            trust=self.trust,
            settings=self.settings,
            now=self.clock(),
        )

    async def start(self) -> Address:
        self.address = ("mem", self.network.next_port)
        self.network.next_port += 1
        self.network.listeners[self.address] = self
        return self.address

    async def resolve(self, host: str, port: int) -> Address:
        if (host, port) not in self.network.listeners:
            raise TransportError(f"nothing listens at {host}:{port}")
        return (host, port)

    async def connect(self, address: Address, expected_peer: bytes | None = None) -> bytes:
        remote = self.network.listeners.get(address)
        if remote is None:
            raise TransportError(f"nothing listens at {address}")
        number = next(self.network.link_ids)
        server_cid, original_dcid = b"S%07d" % number, b"C%07d" % number
        link = _MemLink(self, self._session(dialed=True), address, dialed=True)
        other = remote._accept(self.address, server_cid, original_dcid)
        link.remote, other.remote = other, link
        self._pending.add(link)
        link.session.server_hello(remote.certificate, server_cid, original_dcid, self.wallclock())
        self._process(link)
        try:
            peer = await asyncio.wait_for(
                asyncio.shield(link.ready), timeout=self.settings.connect_timeout_s
            )
        except TimeoutError:
            self._close(link, "connect timeout")
            raise TransportError(f"no authenticated link to {address} in time") from None
        except DuplicateLinkError:
            peer = self._book.live(remote.local_key).session.peer or b""
        if expected_peer is not None and peer != expected_peer:
            self._close(link, "unexpected peer")
            raise TransportError(f"{address} is {peer_id_of(peer)}, not the peer expected")
        return peer

    def _accept(self, address: Address, server_cid: bytes, original_dcid: bytes) -> _MemLink:
        link = _MemLink(self, self._session(dialed=False), address, dialed=False)
        link.session.bind_server(server_cid, original_dcid)
        self._pending.add(link)
        self._arm(link)
        return link

    # -- driving the sessions -------------------------------------------------------------

    def _process(self, link: _MemLink) -> None:
        while not link.closed and (event := link.session.next_event()) is not None:
            if isinstance(event, FrameArrived):
                self._book.frame_arrived(link, event.type, event.payload)
            elif isinstance(event, CreditGranted):
                link.credit_changed.set()
            elif isinstance(event, Authenticated):
                self._pending.discard(link)
                self._book.admit(link, self.clock())
            elif isinstance(event, Closed):
                if not event.authenticated:
                    self.refused += 1
                self._close(link, event.reason, quiet=False)
        if not link.closed:
            self._flush(link)

    def _flush(self, link: _MemLink) -> None:
        remote = link.remote
        for lane, data in link.session.data_to_send():
            link.bytes_sent += len(data)
            self.udp_bytes_sent += len(data)
            if remote is not None:
                self._post(remote, lane, data)
        self._arm(link)

    def _post(self, link: _MemLink, lane: Lane | None, data: bytes | str) -> None:
        """Queue bytes (or the end, ``lane`` None) for ``link``, the receiving end:
        they arrive ``latency_s`` later, in the order sent (one queue per link; timers
        due at the same instant could run in any order)."""
        loop = asyncio.get_running_loop()
        link.inbox.append((loop.time() + self.network.latency_s, lane, data))
        if link.inbox_timer is None:
            link.inbox_timer = loop.call_at(link.inbox[0][0], link.owner._arrive, link)

    def _arrive(self, link: _MemLink) -> None:
        link.inbox_timer = None
        loop = asyncio.get_running_loop()
        while link.inbox and link.inbox[0][0] <= loop.time():
            _, lane, data = link.inbox.popleft()
            if lane is None:
                assert isinstance(data, str)
                self._terminated(link, data)
            else:
                assert isinstance(data, bytes)
                self._receive(link, lane, data)
        if link.inbox:
            link.inbox_timer = loop.call_at(link.inbox[0][0], self._arrive, link)

    def _arm(self, link: _MemLink) -> None:
        when = link.session.get_timer()
        if when == link.timer_at:
            return
        if link.timer is not None:
            link.timer.cancel()
        link.timer, link.timer_at = None, when
        if when is not None:
            loop = asyncio.get_running_loop()
            delay = max(0.0, when - self.clock())
            link.timer = loop.call_at(loop.time() + delay, self._timer_fired, link)

    def _timer_fired(self, link: _MemLink) -> None:
        link.timer, link.timer_at = None, None
        if not link.closed:
            link.session.handle_timer(self.clock())
            self._process(link)

    def _close(self, link: _MemLink, reason: str, quiet: bool = False) -> None:
        """End this side: the session's last bytes (a CLOSE) go, then the peer's end
        hears the link is gone, as QUIC's CONNECTION_CLOSE tells it."""
        if link.closed:
            return
        link.session.close(reason, quiet=quiet)
        remote = link.remote
        for lane, data in link.session.data_to_send():
            if remote is not None:
                self._post(remote, lane, data)
        if remote is not None:
            self._post(remote, None, reason)
        if link.timer is not None:
            link.timer.cancel()
        self._pending.discard(link)
        self._book.gone(link, reason, quiet)

    def _drop(self, link: _MemLink, reason: str, quiet: bool) -> None:
        self._close(link, reason, quiet)

    def _receive(self, link: _MemLink, lane: Lane, data: bytes) -> None:
        if link.closed:
            return
        link.bytes_received += len(data)
        link.session.receive(lane, data, self.clock(), self.wallclock())
        self._process(link)

    def _terminated(self, link: _MemLink, reason: str) -> None:
        """The peer's end closed (QUIC: its CONNECTION_CLOSE arrived)."""
        if not link.closed:
            link.session.close(reason, quiet=True)
            if link.timer is not None:
                link.timer.cancel()
            self._pending.discard(link)
            self._book.gone(link, reason, False)

    # -- the interface --------------------------------------------------------------------

    async def send(self, peer: bytes, frame_type: FrameType, payload: bytes) -> None:
        await self._book.send(peer, frame_type, payload)

    async def next_event(self) -> TransportEvent:
        return await self._book.next_event()

    def peers(self) -> list[bytes]:
        return self._book.peers()

    def rtt(self, peer: bytes) -> RttStats | None:
        return self._book.ping_rtt(peer)

    def link_stats(self, peer: bytes) -> LinkStats | None:
        return self._book.link_stats(peer)

    def set_trust(self, trust: Trust) -> list[bytes]:
        """As QuicTransport.set_trust: links whose peer the new trust refuses close."""
        self.trust = trust
        now = self.wallclock()
        dropped = []
        for key, link in list(self._book.links.items()):
            if link.closed or link.certificate is None:
                continue
            try:
                trust.verify(link.certificate, now)
            except AdmissionError as exc:
                self._close(link, f"no longer admitted: {exc}")
                dropped.append(key)
        return dropped

    def unacked_bytes(self) -> int:
        return 0  # memory delivers on the next loop iteration: nothing waits for an ack

    def strangers(self) -> StrangerStats:
        return StrangerStats(refused=self.refused)

    async def disconnect(self, peer: bytes, reason: str) -> None:
        link = self._book.links.get(peer)
        if link is not None:
            self._close(link, reason)

    async def close(self) -> None:
        for link in list(self._book.links.values()) + list(self._pending):
            self._close(link, "node shutting down")
        self.network.listeners.pop(self.address, None)
        await asyncio.sleep(0)
