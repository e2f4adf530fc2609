"""Admission on a QUIC link: the client's proof of possession, the server's check,
and what happens once a link is authenticated (one link per peer: simultaneous dials
and a restarted peer's stale link are resolved here). Part of QuicTransport, kept
apart because it is one concept: see core/link/auth.py for the proof itself.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import struct
from collections.abc import Callable

from cryptography.hazmat.primitives.serialization import Encoding

from ciuic_p2p.addresses import network_of
from ciuic_p2p.admission import Trust
from ciuic_p2p.config import TransportSection
from ciuic_p2p.core.link.auth import ServerAdmission, build_auth
from ciuic_p2p.core.link.frames import Frame, FrameType
from ciuic_p2p.errors import AdmissionError
from ciuic_p2p.identity import NodeKey, peer_id_of
from ciuic_p2p.logsetup import get_logger
from ciuic_p2p.transport.base import PeerConnected, TransportEvent
from ciuic_p2p.transport.errors import RefusedError
from ciuic_p2p.transport.gate import InitialGate
from ciuic_p2p.transport.link import CONTROL_STREAM, QuicLink

log = get_logger("ciuic.transport")


class AdmissionMixin:
    """The admission steps of :class:`ciuic_p2p.transport.quic.QuicTransport`."""

    key: NodeKey
    local_key: bytes
    certificate_der: bytes
    trust: Trust
    settings: TransportSection
    clock: Callable[[], float]
    wallclock: Callable[[], dt.datetime]
    refused: int
    on_admission: Callable[[bytes | None, tuple[str, int], str], None] | None
    _links: dict[bytes, QuicLink]
    _events: asyncio.Queue[TransportEvent]
    gate: InitialGate

    def _send_frame(self, link: QuicLink, ftype: FrameType, payload: bytes) -> None:
        raise NotImplementedError

    def _close_link(self, link: QuicLink, reason: str, quiet: bool = False) -> None:
        raise NotImplementedError

    def _transmit(self, link: QuicLink) -> None:
        raise NotImplementedError

    async def _ping_loop(self, link: QuicLink) -> None:
        raise NotImplementedError

    def _client_prove(self, link: QuicLink) -> None:
        cert = link.quic.tls._peer_certificate
        if cert is None:
            raise AdmissionError("server sent no certificate")
        server_key = self.trust.verify(cert, self.wallclock())
        link.certificate = cert
        link.claimed = peer_id_of(server_key)
        link.peer = server_key
        proof = build_auth(
            self.key,
            self.certificate_der,
            self.trust.cluster,
            server_key,
            link.quic._peer_cid.cid,
            link.quic.original_destination_connection_id,
        )
        self._send_frame(link, FrameType.AUTH, proof)

    def _server_receive(self, link: QuicLink, data: bytes) -> list[Frame]:
        """Control-stream bytes on an accepted link before its peer is admitted
        (core.link.auth.ServerAdmission); the frames after ``AUTH``, to handle as the
        member's once it is admitted."""
        if link.admission is None:  # made at the first bytes: the CIDs are final then
            link.admission = ServerAdmission(
                self.trust,
                self.local_key,
                link.quic.host_cid,
                link.quic.original_destination_connection_id,
            )
        try:
            admitted = link.admission.receive(data, self.wallclock())
        finally:
            link.claimed = link.admission.claimed
        if admitted is None:
            return []
        link.peer = admitted.key
        link.certificate = admitted.certificate
        link.claimed = peer_id_of(admitted.key)
        link.readers[CONTROL_STREAM] = link.admission.reader
        self._send_frame(link, FrameType.AUTH_OK, b"")
        self._authenticated(link)
        return admitted.rest

    def _settle(self, link: QuicLink) -> None:
        """The link no longer counts as pending at the gate (transport.gate)."""
        if link.pending:
            link.pending = False
            self.gate.settled(link.address)

    def _authenticated(self, link: QuicLink) -> None:
        assert link.peer is not None
        if link.auth_deadline is not None:
            link.auth_deadline.cancel()
        self._settle(link)
        link.authenticated = True
        link.established_at = self.clock()
        if self.on_admission is not None:
            self.on_admission(link.peer, link.address, "")
        existing = self._links.get(link.peer)
        if existing is not None and not existing.closed:
            # Simultaneous dials: both ends keep the link dialed by the smaller key. An
            # older link is a restarted peer's previous life, dead at its end: replace.
            stale = link.established_at - existing.established_at > self.settings.auth_timeout_s
            keep_new = stale or self._dialer(link) < self._dialer(existing)
            loser = existing if keep_new else link
            winner = link if keep_new else existing
            if not loser.ready.done():
                loser.ready.set_result(link.peer)
            self._links[link.peer] = winner
            self._close_link(loser, "duplicate link", quiet=True)
            if not keep_new:
                return
        self._links[link.peer] = link
        self._send_frame(link, FrameType.CREDIT, struct.pack("<Q", link.quota.window))
        if not link.ready.done():
            link.ready.set_result(link.peer)
        if existing is None or existing.closed:
            der = b"" if link.certificate is None else link.certificate.public_bytes(Encoding.DER)
            self._events.put_nowait(PeerConnected(link.peer, link.address, link.dialed, der))
        link.ping_task = asyncio.get_running_loop().create_task(self._ping_loop(link))

    def _dialer(self, link: QuicLink) -> bytes:
        assert link.peer is not None
        return self.local_key if link.dialed else link.peer

    def _auth_timeout(self, link: QuicLink) -> None:
        if not link.authenticated and not link.closed:
            self._refuse_or_drop(link, "not authenticated in time")
            self._transmit(link)

    def _refuse_or_drop(self, link: QuicLink, reason: str, stream: int | None = None) -> None:
        # The stream is named when a frame on it broke the rules (framing, limits).
        where = {} if stream is None else {"stream": stream}
        if not link.authenticated:
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
            if not link.ready.done():
                link.ready.set_exception(RefusedError(f"refused: {reason}"))
            if self.on_admission is not None:
                self.on_admission(None, link.address, reason)
        else:
            log.warning("peer_dropped", peer=link.claimed, reason=reason, **where)
        self._close_link(link, reason)
