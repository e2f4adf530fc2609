"""QUIC transport over aioquic, with our own admission (see core.link.auth).

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

aioquic is driven with ``time.monotonic()`` as its clock: uvloop's ``loop.time()``
has libuv's 1 ms resolution, too coarse for aioquic's pacer (measured: 1.3 MB/s
instead of 38 MB/s on loopback).

aioquic internals used, each with no public accessor in 1.7.2: ``tls._peer_certificate``
(the server's certificate, which we verify against the cluster CA ourselves),
``_peer_cid.cid`` (the connection ID the server chose, bound into the client's proof),
``_loss._rtt_*`` (QUIC's RTT estimate) and ``_streams[i].sender._buffer`` (bytes sent
and not yet acknowledged). tests/transport/test_quic.py checks they exist.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import random
import struct
import time
from collections.abc import Callable
from typing import Any

from aioquic.buffer import Buffer  # type: ignore[attr-defined]
from aioquic.quic import events as qe
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.packet import pull_quic_header
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from ciuic_p2p.admission import Trust
from ciuic_p2p.config import TransportSection
from ciuic_p2p.core.link.frames import (
    BULK_TYPES,
    FrameType,
    FramingError,
    bulk_cost,
    encode_frame,
)
from ciuic_p2p.core.link.rtt import backoff_delay_s
from ciuic_p2p.errors import AdmissionError
from ciuic_p2p.guard import Guard
from ciuic_p2p.identity import NodeKey, peer_id_of
from ciuic_p2p.logsetup import get_logger
from ciuic_p2p.transport.admit import AdmissionMixin
from ciuic_p2p.transport.base import (
    Address,
    FrameReceived,
    LinkStats,
    PeerDisconnected,
    RttStats,
    Transport,
    TransportEvent,
)
from ciuic_p2p.transport.errors import DuplicateLinkError, RefusedError, TransportError
from ciuic_p2p.transport.gate import Drop, InitialGate, Reply
from ciuic_p2p.transport.link import (
    ALPN,
    BULK_STREAM,
    CID_LENGTH,
    CONTROL_STREAM,
    QuicLink,
    quic_configuration,
)
from ciuic_p2p.transport.sockbuf import size_buffers

_PING = struct.Struct("<Qd")

log = get_logger("ciuic.transport")


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


class QuicTransport(AdmissionMixin, Transport):
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
    ) -> None:
        """``known_source``: whether an address is one where a member was authenticated
        before (the gate exempts it from its caps: transport.gate)."""
        self.key = key
        self.known_source = known_source
        self.local_key = key.public_key
        self.certificate = certificate
        self.certificate_der = certificate.public_bytes(serialization.Encoding.DER)
        self.trust = trust
        self.on_admission: Callable[[bytes | None, tuple[str, int], str], None] | None = None
        """Called with (peer key, address, "") for each authenticated link and (None,
        address, reason) for each refused one (the audit log)."""
        self.host, self.port = host, port
        self.settings = settings or TransportSection()
        self.clock = clock
        self.wallclock = wallclock
        self.wrap_udp = wrap_udp
        self._udp: asyncio.DatagramTransport | None = None
        self.udp_bytes_sent = 0
        """Every UDP payload byte this node's socket sent (all links, all frames)."""
        self.socket_buffers = (0, 0)
        """Receive and send buffer bytes the kernel granted the UDP socket."""
        self._by_cid: dict[bytes, QuicLink] = {}
        self._links: dict[bytes, QuicLink] = {}
        self._events: asyncio.Queue[TransportEvent] = asyncio.Queue()
        self.refused = 0
        self._maintained: dict[Address, asyncio.Task[None]] = {}
        self._rng = random.Random(int.from_bytes(self.local_key[:8], "little"))
        self.reconnects = 0
        self.guard = Guard("transport")
        """What the socket's and the timers' callbacks could not handle, counted."""
        self.gate = InitialGate(
            self.settings, quic_configuration(self.settings, None, None).supported_versions
        )
        """Datagrams from unknown sources: what they may cost (transport.gate)."""

    # -- set-up -------------------------------------------------------------------------

    def _configuration(self, is_client: bool) -> QuicConfiguration:
        if is_client:
            return quic_configuration(self.settings, None, None)
        return quic_configuration(self.settings, self.certificate, self.key)

    async def start(self) -> Address:
        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_datagram_endpoint(
            lambda: _Endpoint(self), local_addr=(self.host, self.port)
        )
        self.socket_buffers = size_buffers(
            transport.get_extra_info("socket"), self.settings.socket_buffer_bytes
        )
        self._udp = transport if self.wrap_udp is None else self.wrap_udp(transport)
        sock = self._udp.get_extra_info("sockname")
        self.host, self.port = sock[0], sock[1]
        return (self.host, self.port)

    async def connect(self, address: Address, expected_peer: bytes | None = None) -> bytes:
        if self._udp is None:
            raise TransportError("transport not started")
        quic = QuicConnection(configuration=self._configuration(is_client=True))
        link = QuicLink(quic, address, dialed=True, window=self.settings.receive_window_bytes)
        link.claimed = peer_id_of(expected_peer) if expected_peer else "?"
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
            for key, lk in self._links.items():
                if lk.address == address and lk.authenticated and not lk.closed:
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
            quic = QuicConnection(
                configuration=self._configuration(is_client=False),
                original_destination_connection_id=decision.original_dcid,
                retry_source_connection_id=decision.retry_scid,
            )
            link = QuicLink(quic, addr, dialed=False, window=self.settings.receive_window_bytes)
            link.pending = True
            self.gate.opened(addr)
            self._register(link, header.destination_cid)
            self._register(link, quic.host_cid)
            link.auth_deadline = asyncio.get_running_loop().call_later(
                self.settings.auth_timeout_s, self._auth_timer, link
            )
        link.bytes_received += len(data)
        link.quic.receive_datagram(data, addr, now=self.clock())
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
        for data, addr in link.quic.datagrams_to_send(now=self.clock()):
            link.bytes_sent += len(data)
            self.udp_bytes_sent += len(data)
            udp.sendto(data, addr)
        timer_at = link.quic.get_timer()
        if timer_at != link.timer_at:
            if link.timer is not None:
                link.timer.cancel()
            link.timer = None
            link.timer_at = timer_at
            if timer_at is not None:
                link.timer = asyncio.get_running_loop().call_at(timer_at, self._on_timer, link)

    def _on_timer(self, link: QuicLink) -> None:
        self.guard.call("timer", self._timer_fired, link)

    def _timer_fired(self, link: QuicLink) -> None:
        link.timer = None
        link.timer_at = None
        if link.closed:
            return
        link.quic.handle_timer(now=self.clock())
        self._process(link)

    def _process(self, link: QuicLink) -> None:
        while (event := link.quic.next_event()) is not None:
            try:
                self._handle_event(link, event)
            except (FramingError, AdmissionError) as exc:
                self._refuse_or_drop(link, str(exc), getattr(event, "stream_id", None))
            except Exception as exc:  # a fault of ours or a library's: the link goes
                self.guard.record("event", exc)
                self._refuse_or_drop(link, f"internal error ({type(exc).__name__})")
            if link.closed:
                break
        self._schedule_transmit(link)

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

    def _auth_timer(self, link: QuicLink) -> None:
        self.guard.call("auth_timeout", self._auth_timeout, link)

    def _handle_event(self, link: QuicLink, event: qe.QuicEvent) -> None:
        if isinstance(event, qe.ConnectionIdIssued):
            self._register(link, event.connection_id)
        elif isinstance(event, qe.ConnectionIdRetired):
            self._by_cid.pop(event.connection_id, None)
        elif isinstance(event, qe.HandshakeCompleted):
            if link.dialed:
                self._client_prove(link)
        elif isinstance(event, qe.StreamDataReceived):
            reader = link.readers.get(event.stream_id)
            if reader is None or (not link.authenticated and event.stream_id != CONTROL_STREAM):
                raise FramingError(f"unexpected stream {event.stream_id}")
            if not link.authenticated and not link.dialed:
                frames = self._server_receive(link, event.data)
            else:
                frames = reader.feed(event.data)
            for frame in frames:
                self._handle_frame(link, event.stream_id, frame.type, frame.payload)
                if link.closed:
                    return
            if event.end_stream:
                link.readers[event.stream_id].end_of_stream()
        elif isinstance(event, qe.DatagramFrameReceived):
            raise FramingError("datagram frames are not used")
        elif isinstance(event, qe.ConnectionTerminated):
            self._link_gone(link, event.reason_phrase or f"error {event.error_code}")

    # -- frames ---------------------------------------------------------------------------

    def _handle_frame(self, link: QuicLink, stream: int, ftype: FrameType, payload: bytes) -> None:
        if not link.authenticated:  # an accepted link's AUTH went through _server_receive
            if link.dialed and ftype is FrameType.AUTH_OK:
                self._authenticated(link)
            else:
                raise FramingError(f"{ftype.name} before authentication")
            return
        expected = link.bulk_in if ftype in BULK_TYPES else CONTROL_STREAM
        if stream != expected or ftype in (FrameType.AUTH, FrameType.AUTH_OK):
            raise FramingError(f"{ftype.name} on stream {stream}")
        assert link.peer is not None
        if ftype is FrameType.PING:
            self._send_frame(link, FrameType.PONG, payload)
        elif ftype is FrameType.PONG:
            if len(payload) == _PING.size:
                _, sent_at = _PING.unpack(payload)
                link.rtt.add(self.clock() - sent_at)
        elif ftype is FrameType.CREDIT:
            if len(payload) != 8:
                raise FramingError("CREDIT frame of the wrong size")
            (amount,) = struct.unpack("<Q", payload)
            if not 0 < amount <= self.settings.max_credit_bytes - link.credit_out.available:
                raise FramingError(
                    f"CREDIT of {amount} bytes: outstanding credit would pass "
                    f"{self.settings.max_credit_bytes}"
                )
            if link.peer_window == 0:
                link.peer_window = amount
            link.credit_out.grant(amount)
            link.credit_changed.set()
        elif ftype is FrameType.CLOSE:
            self._close_link(link, "peer closed: " + payload.decode("utf-8", "replace")[:200])
        else:
            link.quota.received(ftype, len(payload))
            self._events.put_nowait(FrameReceived(link.peer, ftype, payload))

    def _send_frame(self, link: QuicLink, ftype: FrameType, payload: bytes) -> None:
        stream = link.bulk_out if ftype in BULK_TYPES else CONTROL_STREAM
        link.quic.send_stream_data(stream, encode_frame(ftype, payload))
        if stream == CONTROL_STREAM:
            self._check_control_backlog(link)

    def _check_control_backlog(self, link: QuicLink) -> None:
        """Control frames spend no credit, so a peer that withholds QUIC's flow-control
        window (or never acknowledges) would make this node buffer every answer to
        it (a pong per ping, a sync per sync): past ``max_control_send_bytes``
        unacknowledged, the link goes."""
        if link.control_unacked() > self.settings.max_control_send_bytes and not link.closed:
            self._refuse_or_drop(link, "peer leaves its control stream unacknowledged")

    async def _ping_loop(self, link: QuicLink) -> None:
        while not link.closed:
            self.guard.call("ping", self._ping, link)
            await asyncio.sleep(self.settings.ping_interval_s)

    def _ping(self, link: QuicLink) -> None:
        self._send_frame(link, FrameType.PING, _PING.pack(next(link.ping_ids), self.clock()))
        self._transmit(link)

    # -- the interface --------------------------------------------------------------------

    async def send(self, peer: bytes, frame_type: FrameType, payload: bytes) -> None:
        link = self._links.get(peer)
        if link is None or link.closed:
            raise TransportError(f"no link to {peer_id_of(peer)}")
        frame = encode_frame(frame_type, payload)  # checks the size limit before any wait
        cost = bulk_cost(frame_type, len(payload))
        while cost and not link.credit_out.try_spend(cost):
            link.credit_changed.clear()
            try:
                await asyncio.wait_for(
                    link.credit_changed.wait(), timeout=self.settings.stall_timeout_s
                )
            except TimeoutError:
                self._refuse_or_drop(link, "peer stalled: no credit")
                self._transmit(link)
                raise TransportError(f"{peer_id_of(peer)} stopped reading; dropped") from None
            if link.closed:
                raise TransportError(f"link to {peer_id_of(peer)} closed")
        link.quic.send_stream_data(link.bulk_out if cost else CONTROL_STREAM, frame)
        if not cost:
            self._check_control_backlog(link)
            if link.closed:
                raise TransportError(f"link to {peer_id_of(peer)} dropped")
        self._transmit(link)

    async def next_event(self) -> TransportEvent:
        event = await self._events.get()
        if isinstance(event, FrameReceived):
            link = self._links.get(event.peer)
            if link is not None and not link.closed:
                grant = link.quota.consumed(event.type, len(event.payload))
                if grant:
                    self._send_frame(link, FrameType.CREDIT, struct.pack("<Q", grant))
                    self._transmit(link)
        return event

    def set_trust(self, trust: Trust) -> list[bytes]:
        """Use a new CA/revocation list from now on, and close every link whose peer's
        certificate it no longer accepts; the keys of those peers."""
        self.trust = trust
        now = self.wallclock()
        dropped = []
        for key, link in list(self._links.items()):
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
        total = 0
        for link in self._links.values():
            if link.closed:
                continue
            for stream in link.quic._streams.values():
                total += len(getattr(stream.sender, "_buffer", b""))
        return total

    def peers(self) -> list[bytes]:
        return [p for p, link in self._links.items() if not link.closed]

    def rtt(self, peer: bytes) -> RttStats | None:
        link = self._links.get(peer)
        return None if link is None else link.rtt_stats()

    def link_stats(self, peer: bytes) -> LinkStats | None:
        link = self._links.get(peer)
        return None if link is None else link.stats()

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
                (lk for lk in self._links.values() if lk.address == address and not lk.closed),
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
        link = self._links.get(peer)
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
        if link.authenticated and not quiet:
            with contextlib.suppress(FramingError):
                self._send_frame(link, FrameType.CLOSE, reason.encode()[:500])
        link.quic.close(error_code=0, reason_phrase=reason)
        self._transmit(link)

    def _link_gone(self, link: QuicLink, reason: str, quiet: bool = False) -> None:
        if link.closed:
            return
        link.closed = True
        link.gone.set()
        self._settle(link)
        for handle in (link.timer, link.auth_deadline):
            if handle is not None:
                handle.cancel()
        if link.ping_task is not None:
            link.ping_task.cancel()
        link.credit_changed.set()
        if not link.ready.done():
            error = DuplicateLinkError if reason == "duplicate link" else RefusedError
            link.ready.set_exception(error(f"refused: {reason}"))
        for cid in [c for c, lk in self._by_cid.items() if lk is link]:
            del self._by_cid[cid]
        if link.peer is not None and self._links.get(link.peer) is link:
            del self._links[link.peer]
            if not quiet:
                self._events.put_nowait(PeerDisconnected(link.peer, reason))

    async def close(self) -> None:
        for task in self._maintained.values():
            task.cancel()
        self._maintained.clear()
        for link in list(self._by_cid.values()) + list(self._links.values()):
            self._close_link(link, "node shutting down")
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
