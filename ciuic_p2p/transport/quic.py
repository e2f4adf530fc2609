"""QUIC transport over aioquic or qh3 (transport.backend), driving one link session
(core.link.session) per connection: authentication, credit, ping/pong and close are
the session's; this edge maps its two lanes onto QUIC streams and owns the socket,
the connection IDs, the gate in front of strangers and the timers.

One UDP socket per node, bound where the config says, serves both the connections
this node dials and the ones it accepts; datagrams are routed to connections by
destination connection ID. Each link to a peer has these streams:
stream 0 for control frames (auth, ping, credit, gossip, close) and a bulk stream
for chunks in each direction (4 from the dialer, 5 from the accepting side), so
control never queues behind bulk data we hold back for credit.

Until a peer has proven its identity, this node sends it nothing but the QUIC
handshake: the server waits for the client's ``AUTH`` frame on stream 0 (any other
stream, frame or datagram first closes the connection), for at most
``auth_timeout_s``; every refusal is logged with the address and the claimed ID.
Before a datagram from an unknown source costs any state at all, transport.gate
decides (versions spoken, caps on pending connections, QUIC Retry under load, a
handshake rate). Every callback the socket and the timers run goes through a
:class:`~ciuic_p2p.guard.Guard`: whatever a library raises is counted
(``internal_errors``) and the node goes on.

Datagrams of an authenticated link that arrive in one event-loop iteration are handed
to QUIC together at its end (qh3 2.x takes them in one call), and its events, the
link session and the transmit run once per batch instead of once per datagram: the
per-datagram Python work was most of a receiver's CPU (bench/transport.py: qh3 over
aioquic 0.40 -> 0.32 x aioquic's CPU per MB). The handshake and the proof go one by
one.

aioquic is driven with ``time.monotonic()`` as its clock: uvloop's ``loop.time()``
has libuv's 1 ms resolution, too coarse for aioquic's pacer (measured: 1.3 MB/s
instead of 38 MB/s on loopback).

What the two libraries expose differently (the peer's certificate, the server's
connection ID, QUIC's RTT, unacknowledged bytes) is reached through transport.backend;
tests/transport/test_quic.py checks the internals it uses exist in each.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import random
import socket
import time
from collections.abc import Callable
from typing import Any

from aioquic.buffer import Buffer  # type: ignore[attr-defined]
from aioquic.quic.packet import pull_quic_header
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from ciuic_p2p.addresses import network_of
from ciuic_p2p.admission import Trust
from ciuic_p2p.config import TransportSection
from ciuic_p2p.core.link.frames import FrameType
from ciuic_p2p.core.link.rtt import backoff_delay_s
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
from ciuic_p2p.identity import NodeKey, peer_id_of
from ciuic_p2p.logsetup import get_logger
from ciuic_p2p.transport.backend import QuicBackend
from ciuic_p2p.transport.base import (
    Address,
    LinkStats,
    RttStats,
    StrangerStats,
    Transport,
    TransportEvent,
)
from ciuic_p2p.transport.errors import DuplicateLinkError, TransportError
from ciuic_p2p.transport.gate import Drop, InitialGate, Reply
from ciuic_p2p.transport.gso import SegmentedSender, gso_supported
from ciuic_p2p.transport.link import (
    ALPN,
    BULK_STREAM,
    CID_LENGTH,
    CONTROL_STREAM,
    QuicLink,
)
from ciuic_p2p.transport.sessions import LinkBook
from ciuic_p2p.transport.sockbuf import size_buffers

log = get_logger("ciuic.transport")

AdmissionObserver = Callable[[bytes | None, Address, str], None]
"""Called with (peer key, address, "") for each authenticated link and (None, address,
reason) for each refused one or datagram dropped before any state (the audit log)."""


def _now() -> float:
    return time.monotonic()


def _utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class _Endpoint(asyncio.DatagramProtocol):
    def __init__(self, owner: QuicTransport) -> None:
        self.owner = owner

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self.owner.receive_datagram(data, (addr[0], addr[1]))

    def error_received(self, exc: Exception) -> None:
        log.debug("udp_error", error=str(exc))


MAX_REASON_BYTES = 256
"""A close reason longer than this is cut: it travels in one packet."""
PACE_TICK_S = 0.001
"""The least wait between two paced writes (the event loop's timer resolution)."""


class QuicTransport(Transport):
    """The production transport: QUIC (aioquic) with mutual authentication."""

    def __init__(
        self,
        key: NodeKey,
        certificate: x509.Certificate,
        trust: Trust,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        settings: TransportSection | None = None,
        clock: Callable[[], float] = _now,
        wallclock: Callable[[], dt.datetime] = _utcnow,
        wrap_udp: Callable[[asyncio.DatagramTransport], asyncio.DatagramTransport] | None = None,
        known_source: Callable[[Address], bool] = lambda addr: False,
        on_admission: AdmissionObserver | None = None,
    ) -> None:
        """``known_source``: whether an address is one where a member was authenticated
        before (the gate exempts it from its caps: transport.gate)."""
        self.key = key
        self.known_source = known_source
        self.local_key = key.public_key
        self.certificate = certificate
        self.certificate_der = certificate.public_bytes(serialization.Encoding.DER)
        self.identity = LocalIdentity(key, self.certificate_der)
        self.trust = trust
        self.on_admission = on_admission
        self.host, self.port = host, port
        self.settings = settings or TransportSection()
        self.clock = clock
        self.wallclock = wallclock
        self.wrap_udp = wrap_udp
        self._udp: asyncio.DatagramTransport | None = None
        self._segmented: SegmentedSender | None = None
        """Sends a transmit's datagrams in few system calls (transport.gso); None when
        ``transport.udp_gso`` is off, off this platform, or sends are shaped by
        ``wrap_udp`` (the emulator must see every datagram)."""
        self.udp_bytes_sent = 0
        """Every UDP payload byte this node's socket sent (all links, all frames)."""
        self.socket_buffers = (0, 0)
        """Receive and send buffer bytes the kernel granted the UDP socket."""
        self._by_cid: dict[bytes, QuicLink] = {}
        self._rx_batches: dict[QuicLink, tuple[Address, list[bytes]]] = {}
        """Datagrams of authenticated links received in this loop iteration, in order."""
        self._rx_scheduled = False
        self._book: LinkBook[QuicLink] = LinkBook(
            self.local_key, self.settings, flush=self._flush_session, drop=self._drop
        )
        self.refused = 0
        self._maintained: dict[Address, asyncio.Task[None]] = {}
        self._rng = random.Random(int.from_bytes(self.local_key[:8], "little"))
        self.reconnects = 0
        self.guard = Guard("transport")
        """What the socket's and the timers' callbacks could not handle, counted."""
        self.backend = QuicBackend(self.settings.quic_backend)
        """The QUIC library behind this transport (transport.backend)."""
        self.gate = InitialGate(
            self.settings,
            self.backend.supported_versions(self.settings),
            retry_padded=self.backend.retry_padded_initials,
        )
        """Datagrams from unknown sources: what they may cost (transport.gate)."""

    # -- set-up -------------------------------------------------------------------------

    def _configuration(self, is_client: bool) -> Any:
        cert, key = (None, None) if is_client else (self.certificate, self.key)
        return self.backend.configuration(self.settings, ALPN, CID_LENGTH, cert, key)

    def _session(self, dialed: bool) -> LinkSession:
        return LinkSession(
            dialed=dialed,
            identity=self.identity,
            trust=self.trust,
            settings=self.settings,
            now=self.clock(),
        )

    async def start(self) -> Address:
        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_datagram_endpoint(
            lambda: _Endpoint(self), local_addr=(self.host, self.port)
        )
        self.socket_buffers = size_buffers(
            transport.get_extra_info("socket"), self.settings.socket_buffer_bytes
        )
        self._udp = transport if self.wrap_udp is None else self.wrap_udp(transport)
        if self.settings.udp_gso and self.wrap_udp is None and gso_supported():
            # Both loops' datagram transports have it; asyncio's interface does not.
            queued: Callable[[], int] = getattr(transport, "get_write_buffer_size", lambda: 0)
            try:
                self._segmented = SegmentedSender(
                    transport.get_extra_info("socket").fileno(), transport.sendto, queued
                )
            except OSError as exc:  # out of descriptors: plain sends do the same job
                log.info("udp_gso_off", reason=str(exc))
        sock = self._udp.get_extra_info("sockname")
        self.host, self.port = sock[0], sock[1]
        return (self.host, self.port)

    @property
    def segmented_datagrams(self) -> int:
        """Datagrams this node sent in UDP GSO groups (transport.gso), not one by one."""
        return 0 if self._segmented is None else self._segmented.datagrams

    @property
    def address(self) -> Address:
        return (self.host, self.port)

    async def resolve(self, host: str, port: int) -> Address:
        try:  # an address of our own socket's family: one socket serves every link
            infos = await asyncio.get_running_loop().getaddrinfo(
                host,
                port,
                family=socket.AF_INET6 if ":" in self.host else socket.AF_INET,
                type=socket.SOCK_DGRAM,
            )
        except OSError as exc:
            raise TransportError(f"cannot resolve {host}: {exc.strerror or exc}") from None
        return (str(infos[0][4][0]), port)

    async def connect(self, address: Address, expected_peer: bytes | None = None) -> bytes:
        if self._udp is None:
            raise TransportError("transport not started")
        if expected_peer is not None:
            for key, other in self._book.links.items():
                if other.address == address and key != expected_peer and not other.closed:
                    # The peer at the far end would take this dial for a second link
                    # from us and drop the one it has: a member naming another's
                    # address as its own must not cut this node off from that one.
                    raise TransportError(
                        f"{address[0]}:{address[1]} is {peer_id_of(key)}'s, not the peer expected"
                    )
        quic = self.backend.connection(self._configuration(is_client=True))
        link = QuicLink(quic, self._session(dialed=True), address, True, self.backend)
        if expected_peer:
            link.session.claimed = peer_id_of(expected_peer)
            link.expected_peer = expected_peer
        self._register(link, quic.host_cid)
        quic.connect(address, now=self.clock())
        self._transmit(link)
        deadline = self.clock() + self.settings.connect_timeout_s
        try:
            peer = await asyncio.wait_for(
                asyncio.shield(link.ready), timeout=self.settings.connect_timeout_s
            )
        except TimeoutError:
            self._close_link(link, "connect timeout")
            raise TransportError(
                f"no authenticated connection to {address[0]}:{address[1]} within "
                f"{self.settings.connect_timeout_s:g} s (nothing answered, or not a ciuic node)"
            ) from None
        except DuplicateLinkError:
            # The peer dialled us at the same time and kept its own connection, which
            # is authenticating at our end now: that one is the link.
            peer = await self._link_at(address, deadline)
        if expected_peer is not None and peer != expected_peer:
            self._close_link(link, "unexpected peer")
            raise TransportError(f"{address} is {peer_id_of(peer)}, not the peer expected")
        return peer

    async def _link_at(self, address: Address, deadline: float) -> bytes:
        while self.clock() < deadline:
            for key, lk in self._book.links.items():
                if lk.address == address and lk.admitted and not lk.closed:
                    return key
            await asyncio.sleep(0.005)
        raise TransportError(f"no authenticated connection to {address[0]}:{address[1]} in time")

    # -- datagrams, timers, events --------------------------------------------------------

    def _register(self, link: QuicLink, cid: bytes) -> None:
        self._by_cid[cid] = link

    def receive_datagram(self, data: bytes, addr: Address) -> None:
        """One datagram from the socket: what the UDP endpoint calls (and the pre-auth
        fuzz target). Never raises: see the module docstring."""
        self.guard.call("datagram", self._datagram_received, data, addr)

    def _datagram_received(self, data: bytes, addr: Address) -> None:
        if len(data) > CID_LENGTH and not data[0] & 0x80:
            # A short header (RFC 9000, 17.3): the destination CID is the next
            # CID_LENGTH bytes. Bulk traffic is all such datagrams on known links, and
            # parsing each header in Python cost about 3 us a datagram.
            link = self._by_cid.get(data[1 : 1 + CID_LENGTH])
            if link is not None and link.session.authenticated:
                link.bytes_received += len(data)
                self._batch(link, data, addr)
                return
        try:
            header = pull_quic_header(Buffer(data=data), host_cid_length=CID_LENGTH)
        except ValueError:
            self.gate.dropped["not a QUIC packet"] += 1
            return
        link = self._by_cid.get(header.destination_cid)
        if link is None:
            known = self.known_source(addr)
            decision = self.gate.decide(header, len(data), addr, self.clock(), known)
            if isinstance(decision, Reply):
                self._sendto(decision.data, addr)
                return
            if isinstance(decision, Drop):
                self._stranger_dropped(addr, decision.reason)
                return
            quic = self.backend.connection(
                self._configuration(is_client=False),
                original_destination_connection_id=decision.original_dcid,
                retry_source_connection_id=decision.retry_scid,
            )
            link = QuicLink(quic, self._session(dialed=False), addr, False, self.backend)
            link.pending = True
            self.gate.opened(addr)
            self._register(link, header.destination_cid)
            self._register(link, quic.host_cid)
        link.bytes_received += len(data)
        if not link.session.authenticated:  # the handshake and the proof: one by one
            link.quic.receive_datagram(data, addr, now=self.clock())
            self._process(link)
            return
        self._batch(link, data, addr)

    def _batch(self, link: QuicLink, data: bytes, addr: Address) -> None:
        # An authenticated link's datagrams wait for the end of this loop iteration
        # and go to QUIC together: one pass over its events and the session per batch
        # instead of per datagram (qh3 2.x takes the batch in one call).
        batch = self._rx_batches.get(link)
        if batch is not None and batch[0] != addr:  # the peer moved: keep the order
            del self._rx_batches[link]
            self._receive_batch(link, *batch)
            batch = None
        if batch is None:
            self._rx_batches[link] = (addr, [data])
        else:
            batch[1].append(data)
        if not self._rx_scheduled:
            self._rx_scheduled = True
            asyncio.get_running_loop().call_soon(self._on_batches)

    def _on_batches(self) -> None:
        self._rx_scheduled = False
        batches, self._rx_batches = self._rx_batches, {}
        for link, (addr, datagrams) in batches.items():
            if not link.closed:  # each link's batch guarded on its own
                self.guard.call("datagram", self._receive_batch, link, addr, datagrams)

    def _receive_batch(self, link: QuicLink, addr: Address, datagrams: list[bytes]) -> None:
        now = self.clock()
        if len(datagrams) > 1 and self.backend.native_core:
            link.quic.receive_many_datagrams(datagrams, addr, now=now)
        else:
            for data in datagrams:
                link.quic.receive_datagram(data, addr, now=now)
        self._process(link)

    def _sendto(self, data: bytes, addr: Address) -> None:
        if self._udp is not None:
            self.udp_bytes_sent += len(data)
            self._udp.sendto(data, addr)

    def _stranger_dropped(self, addr: Address, reason: str) -> None:
        """A datagram that made no state: counted by the gate, summed in the audit log
        (one entry per interval), never one log line each."""
        if self.on_admission is not None:
            self.on_admission(None, addr, reason)

    def _transmit(self, link: QuicLink) -> None:
        udp = self._udp
        if udp is None:
            return
        datagrams = link.quic.datagrams_to_send(now=self.clock())
        for data, _ in datagrams:
            link.bytes_sent += len(data)
            self.udp_bytes_sent += len(data)
        segmented = self._segmented
        if segmented is not None and len(datagrams) > 1 and segmented.active:
            first = datagrams[0][1]
            if all(addr == first for _, addr in datagrams):
                segmented.send([data for data, _ in datagrams], first)
                self._arm_timer(link)
                return
        for data, addr in datagrams:
            udp.sendto(data, addr)
        self._arm_timer(link)

    def _arm_timer(self, link: QuicLink) -> None:
        timer_at = link.timer_due()
        if timer_at != link.timer_at:
            if link.timer is not None:
                link.timer.cancel()
            link.timer = None
            link.timer_at = timer_at
            if timer_at is not None:
                loop = asyncio.get_running_loop()
                delay = max(0.0, timer_at - self.clock())
                link.timer = loop.call_at(loop.time() + delay, self._on_timer, link)

    def _on_timer(self, link: QuicLink) -> None:
        self.guard.call("timer", self._timer_fired, link)

    def _timer_fired(self, link: QuicLink) -> None:
        link.timer = None
        link.timer_at = None
        if link.closed:
            return
        now = self.clock()
        quic_at = link.quic.get_timer()
        if quic_at is not None and now >= quic_at:
            try:
                link.quic.handle_timer(now=now)
            except self.backend.connection_error as exc:  # the library closed it already
                self._link_gone(link, f"connection closed ({exc})")
                return
        session_at = link.session.get_timer()
        if session_at is not None and now >= session_at:
            link.session.handle_timer(now)
        self._process(link)

    def _process(self, link: QuicLink) -> None:
        """Hand QUIC's events to the session, the session's to the layers above."""
        while (event := link.quic.next_event()) is not None:
            try:
                self._handle_event(link, event)
            except Exception as exc:  # a fault of ours or a library's: the link goes
                self.guard.record("event", exc)
                self._refuse_or_drop(link, f"internal error ({type(exc).__name__})")
            if link.closed:
                break
        if not link.closed:
            self._session_events(link)
        if not link.closed:
            self._flush_session(link, transmit=False)
        self._schedule_transmit(link)

    def _handle_event(self, link: QuicLink, event: Any) -> None:
        session = link.session
        qe = self.backend.events
        if isinstance(event, qe.ConnectionIdIssued):
            self._register(link, event.connection_id)
        elif isinstance(event, qe.ConnectionIdRetired):
            self._by_cid.pop(event.connection_id, None)
        elif isinstance(event, qe.HandshakeCompleted):
            if link.dialed:
                quic = link.quic
                session.server_hello(
                    self.backend.peer_certificate(quic),
                    self.backend.server_cid(quic),
                    quic.original_destination_connection_id,
                    self.wallclock(),
                )
        elif isinstance(event, qe.StreamDataReceived):
            lane = link.lane_of_stream(event.stream_id)
            if lane is None or (not session.authenticated and event.stream_id != CONTROL_STREAM):
                self._refuse_or_drop(link, f"unexpected stream {event.stream_id}", event.stream_id)
                return
            if not link.dialed and not session.bound:  # the CIDs are final by now
                quic = link.quic
                session.bind_server(quic.host_cid, quic.original_destination_connection_id)
            session.receive(lane, event.data, self.clock(), self.wallclock())
            if event.end_stream:
                session.end_of_stream(lane)
        elif isinstance(event, qe.DatagramFrameReceived):
            self._refuse_or_drop(link, "datagram frames are not used")
            return
        elif isinstance(event, qe.ConnectionTerminated):
            session.close(event.reason_phrase or f"error {event.error_code}", quiet=True)
            self._link_gone(link, event.reason_phrase or f"error {event.error_code}")
            return
        self._session_events(link)

    def _session_events(self, link: QuicLink) -> None:
        while not link.closed and (event := link.session.next_event()) is not None:
            if isinstance(event, FrameArrived):
                self._book.frame_arrived(link, event.type, event.payload)
            elif isinstance(event, CreditGranted):
                link.credit_changed.set()
            elif isinstance(event, Authenticated):
                self._authenticated(link)
            elif isinstance(event, Closed):
                if event.by_peer:
                    self._close_link(link, event.reason)
                else:
                    stream = None if event.lane is None else link.stream_from(event.lane)
                    self._refuse_or_drop(link, event.reason, stream)

    def _flush_session(self, link: QuicLink, transmit: bool = True) -> None:
        """Write what the session queued to its streams (bulk bytes through the link's
        pacer when it has a rate)."""
        sent_control = False
        for lane, data in link.session.data_to_send():
            stream = link.stream_of(lane)
            if lane is Lane.BULK and (link.pacer.rate_bps is not None or link.paced):
                link.paced.append(data)
                link.paced_bytes += len(data)
                continue
            try:
                link.quic.send_stream_data(stream, data)
            except self.backend.connection_error as exc:  # the library closed it already
                self._link_gone(link, f"connection closed ({exc})")
                return
            sent_control |= stream == CONTROL_STREAM
        if sent_control:
            self._check_control_backlog(link)
        if link.paced and link.pace_timer is None:
            self._write_paced(link, transmit=False)
        if transmit and not link.closed:
            self._transmit(link)

    def pace(self, peer: bytes, rate_bps: float | None) -> None:
        link = self._book.links.get(peer)
        if link is None or link.closed:
            return
        link.pacer.set_rate(rate_bps, self.clock())
        if link.paced:  # a new rate (or none) applies to what waits now
            if link.pace_timer is not None:
                link.pace_timer.cancel()
                link.pace_timer = None
            self._write_paced(link)

    def _paced_timer(self, link: QuicLink) -> None:
        link.pace_timer = None
        if not link.closed:
            self.guard.call("pace", self._write_paced, link)

    def _write_paced(self, link: QuicLink, transmit: bool = True) -> None:
        """Hand the bulk stream what the pacer allows now; come back when it allows
        the rest."""
        now = self.clock()
        pacer, stream = link.pacer, link.bulk_out
        while link.paced:
            allowed = pacer.allowance(now)
            if allowed <= 0:
                break
            head = link.paced[0]
            n = min(allowed, len(head))
            whole = n == len(head) and isinstance(head, bytes)
            try:  # whole pieces as they are; a piece cut by the pace, once copied
                link.quic.send_stream_data(stream, head if whole else bytes(head[:n]))
            except self.backend.connection_error as exc:
                self._link_gone(link, f"connection closed ({exc})")
                return
            pacer.spend(n)
            link.paced_bytes -= n
            if n == len(head):
                link.paced.popleft()
            else:
                link.paced[0] = memoryview(head)[n:]
        if link.paced:
            wait_s = max(PACE_TICK_S, pacer.wait_s(len(link.paced[0]), now))
            link.pace_timer = asyncio.get_running_loop().call_later(wait_s, self._paced_timer, link)
        if transmit:
            self._transmit(link)

    def _schedule_transmit(self, link: QuicLink) -> None:
        """Send once per loop iteration, not once per datagram received: datagrams
        that arrive together are acknowledged together, and each call of aioquic's
        ``datagrams_to_send`` fills whole packets (measured: fewer, fuller packets)."""
        if not link.transmit_pending:
            link.transmit_pending = True
            asyncio.get_running_loop().call_soon(self._flush, link)

    def _flush(self, link: QuicLink) -> None:
        link.transmit_pending = False
        if not link.closed:
            self.guard.call("transmit", self._transmit, link)

    def _check_control_backlog(self, link: QuicLink) -> None:
        """Control frames spend no credit, so a peer that withholds QUIC's flow-control
        window (or never acknowledges) would make this node buffer every answer to
        it (a pong per ping, a sync per sync): past ``max_control_send_bytes``
        unacknowledged, the link goes."""
        if link.control_unacked() > self.settings.max_control_send_bytes and not link.closed:
            self._refuse_or_drop(link, "peer leaves its control stream unacknowledged")

    # -- admission --------------------------------------------------------------------------

    def _settle(self, link: QuicLink) -> None:
        """The link no longer counts as pending at the gate (transport.gate)."""
        if link.pending:
            link.pending = False
            self.gate.settled(link.address)

    def _authenticated(self, link: QuicLink) -> None:
        assert link.peer is not None
        if link.expected_peer is not None and link.peer != link.expected_peer:
            # Refused before admission: admitted, it would replace the link this node
            # has to the key it proved (a member naming another's port as its own).
            self._close_link(link, "unexpected peer")
            return
        self._settle(link)
        if self.on_admission is not None:
            self.on_admission(link.peer, link.address, "")
        self._book.admit(link, self.clock())

    def _refuse_or_drop(self, link: QuicLink, reason: str, stream: int | None = None) -> None:
        # The stream is named when a frame on it broke the rules (framing, limits).
        where = {} if stream is None else {"stream": stream}
        if not link.admitted:
            self.refused += 1
            # Rate-limited per source network (logsetup): a stranger that varies its
            # port or address within its network is one line a minute, not thousands.
            log.warning(
                "peer_refused",
                address=f"{link.address[0]}:{link.address[1]}",
                network=network_of(link.address[0]),
                claimed=link.claimed,
                reason=reason,
                **where,
            )
            if self.on_admission is not None:
                self.on_admission(None, link.address, reason)
        else:
            log.warning("peer_dropped", peer=link.claimed, reason=reason, **where)
        self._close_link(link, reason)

    def _drop(self, link: QuicLink, reason: str, quiet: bool) -> None:
        """What the link book calls: a duplicate (quiet) or a stalled peer."""
        if quiet:
            self._close_link(link, reason, quiet=True)
        else:
            self._refuse_or_drop(link, reason)
            self._transmit(link)

    # -- the interface --------------------------------------------------------------------

    async def send(self, peer: bytes, frame_type: FrameType, payload: bytes) -> None:
        await self._book.send(peer, frame_type, payload)

    async def next_event(self) -> TransportEvent:
        return await self._book.next_event()

    def set_trust(self, trust: Trust) -> list[bytes]:
        """Use a new CA/revocation list from now on, and close every link whose peer's
        certificate it no longer accepts; the keys of those peers."""
        self.trust = trust
        now = self.wallclock()
        dropped = []
        for link in self._by_cid.values():
            if not link.session.bound and not link.session.authenticated:
                link.session.trust = trust  # a link still to be checked: by the new one
        for key, link in list(self._book.links.items()):
            if link.closed or link.certificate is None:
                continue
            try:
                trust.verify(link.certificate, now)
            except AdmissionError as exc:
                log.warning("peer_dropped", peer=link.claimed, reason=str(exc))
                self._close_link(link, f"no longer admitted: {exc}")
                dropped.append(key)
        return dropped

    def unacked_bytes(self) -> int:
        """Stream bytes sent on live links that the peers have not acknowledged yet
        (aioquic keeps each stream's unacknowledged data in its sender's buffer)."""
        return sum(
            self.backend.unacked_bytes(link.quic) + link.paced_bytes
            for link in self._book.links.values()
            if not link.closed
        )

    def peers(self) -> list[bytes]:
        return self._book.peers()

    def strangers(self) -> StrangerStats:
        gate = self.gate
        return StrangerStats(
            pending_connections=gate.pending,
            connections_opened=gate.opened_total,
            retries_sent=gate.retries_sent,
            refused=self.refused,
            dropped=dict(gate.dropped),
        )

    def connection(self, peer: bytes) -> QuicLink | None:
        """The QUIC connection of a peer's link (benchmarks read its congestion state)."""
        return self._book.links.get(peer)

    def rtt(self, peer: bytes) -> RttStats | None:
        link = self._book.links.get(peer)
        return None if link is None else self._book.ping_rtt(peer, link.quic_rtt())

    def link_stats(self, peer: bytes) -> LinkStats | None:
        stats, link = self._book.link_stats(peer), self._book.links.get(peer)
        if stats is None or link is None or link.pacer.rate_bps is None:
            return stats
        return dataclasses.replace(stats, pace_bps=link.pacer.rate_bps)

    def maintain(self, address: Address, expected_peer: bytes | None = None) -> None:
        """Keep a link to ``address`` up: dial now, and again whenever it is lost,
        after a delay with exponential backoff and full jitter (core.link.rtt)."""
        if address not in self._maintained:
            task = asyncio.get_running_loop().create_task(self._keep_up(address, expected_peer))
            self._maintained[address] = task

    async def _keep_up(self, address: Address, expected_peer: bytes | None) -> None:
        s = self.settings
        attempt = 0
        while True:
            link = next(
                (lk for lk in self._book.links.values() if lk.address == address and not lk.closed),
                None,
            )
            if link is None:
                try:
                    await self.connect(address, expected_peer)
                    attempt = 0
                    self.reconnects += 1
                    continue
                except TransportError as exc:
                    delay = backoff_delay_s(
                        attempt, s.reconnect_base_s, s.reconnect_max_s, self._rng
                    )
                    log.info(
                        "reconnect_failed",
                        address=f"{address[0]}:{address[1]}",
                        reason=str(exc),
                        retry_in_s=round(delay, 3),
                    )
                    attempt += 1
                    await asyncio.sleep(delay)
                    continue
            await link.gone.wait()

    async def disconnect(self, peer: bytes, reason: str) -> None:
        link = self._book.links.get(peer)
        if link is not None:
            self._close_link(link, reason)

    def _close_link(self, link: QuicLink, reason: str, quiet: bool = False) -> None:
        if link.closed:
            return
        # The link is forgotten whatever closing it raises: a connection that a
        # library fault kept registered would stay in memory for good.
        self.guard.call("close", self._say_close, link, reason, quiet)
        self._link_gone(link, reason, quiet=quiet)

    def _say_close(self, link: QuicLink, reason: str, quiet: bool) -> None:
        link.session.close(reason, quiet=quiet)  # a CLOSE frame when it was admitted
        try:
            for lane, data in link.session.data_to_send():
                link.quic.send_stream_data(link.stream_of(lane), data)
        except self.backend.connection_error:  # the library closed it already:
            return  # nothing more to say on it
        # The CLOSE frame goes out before QUIC's close: qh3 cannot fit stream data and a
        # CONNECTION_CLOSE into one packet ("packet builder capacity exhausted").
        self._transmit(link)
        link.quic.close(
            error_code=0, reason_phrase=reason.encode()[:MAX_REASON_BYTES].decode(errors="ignore")
        )
        self._transmit(link)

    def _link_gone(self, link: QuicLink, reason: str, quiet: bool = False) -> None:
        if link.closed:
            return
        link.session.close(reason, quiet=True)
        self._settle(link)
        if link.timer is not None:
            link.timer.cancel()
            link.timer = None
        if link.pace_timer is not None:
            link.pace_timer.cancel()
            link.pace_timer = None
        link.paced.clear()
        link.paced_bytes = 0
        for cid in [c for c, lk in self._by_cid.items() if lk is link]:
            del self._by_cid[cid]
        self._book.gone(link, reason, quiet)

    async def close(self) -> None:
        for task in self._maintained.values():
            task.cancel()
        self._maintained.clear()
        for link in list(self._by_cid.values()) + list(self._book.links.values()):
            self._close_link(link, "node shutting down")
        if self._segmented is not None:
            self._segmented.close()
            self._segmented = None
        if self._udp is not None:
            self._udp.close()
            self._udp = None
        await asyncio.sleep(0)


__all__ = [
    "ALPN",
    "BULK_STREAM",
    "CONTROL_STREAM",
    "QuicTransport",
    "TransportError",
]
