"""One QUIC connection to a peer: the link session it carries (core.link.session), the
streams its two lanes map to, its timer; and aioquic's configuration."""

from __future__ import annotations

import asyncio
import ssl

from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from cryptography import x509

from ciuic_p2p.config import TransportSection
from ciuic_p2p.core.link.session import Lane, LinkSession
from ciuic_p2p.identity import NodeKey
from ciuic_p2p.transport.base import Address
from ciuic_p2p.transport.sessions import SessionLink

ALPN = "ciuic/1"
CONTROL_STREAM = 0
BULK_STREAM = 4
"""The dialer's bulk stream (client-initiated, bidirectional)."""
SERVER_BULK_STREAM = 5
"""The accepting side's bulk stream: QUIC lets a side send only on streams it opened
or that its peer opened first, so each side sends bulk on a stream of its own."""
CID_LENGTH = 8


def quic_configuration(
    settings: TransportSection, certificate: x509.Certificate | None, key: NodeKey | None
) -> QuicConfiguration:
    """aioquic's configuration for one of our connections; a server passes its node
    certificate and key (the TLS certificate is the node certificate)."""
    conf = QuicConfiguration(
        is_client=certificate is None,
        alpn_protocols=[ALPN],
        idle_timeout=settings.idle_timeout_s,
        max_datagram_size=settings.max_datagram_size,
        congestion_control_algorithm=settings.congestion_control,
        connection_id_length=CID_LENGTH,
        max_data=8 * settings.receive_window_bytes,
        max_stream_data=4 * settings.receive_window_bytes,
        verify_mode=ssl.CERT_NONE,  # we verify the server's certificate ourselves
    )
    if certificate is not None and key is not None:
        conf.certificate = certificate
        conf.private_key = key.private_key
    return conf


class QuicLink(SessionLink):
    """One QUIC connection, the link session it carries, and its timers."""

    def __init__(
        self, quic: QuicConnection, session: LinkSession, address: Address, dialed: bool
    ) -> None:
        super().__init__(session, address, dialed)
        self.quic = quic
        self.pending = False
        """Accepted and not yet settled (authenticated, refused or gone): counted
        against the gate's caps (transport.gate)."""
        self.timer: asyncio.TimerHandle | None = None
        self.timer_at: float | None = None
        self.transmit_pending = False

    @property
    def bulk_out(self) -> int:
        """The stream this side sends bulk frames on."""
        return BULK_STREAM if self.dialed else SERVER_BULK_STREAM

    @property
    def bulk_in(self) -> int:
        """The stream the peer sends bulk frames on."""
        return SERVER_BULK_STREAM if self.dialed else BULK_STREAM

    def stream_of(self, lane: Lane) -> int:
        return CONTROL_STREAM if lane is Lane.CONTROL else self.bulk_out

    def stream_from(self, lane: Lane) -> int:
        """The stream the peer sends a lane's bytes on."""
        return CONTROL_STREAM if lane is Lane.CONTROL else self.bulk_in

    def lane_of_stream(self, stream_id: int) -> Lane | None:
        """The lane a stream's bytes from the peer belong to; None for any other."""
        if stream_id == CONTROL_STREAM:
            return Lane.CONTROL
        return Lane.BULK if stream_id == self.bulk_in else None

    def timer_due(self) -> float | None:
        """The earlier of QUIC's timer and the session's."""
        times = [t for t in (self.quic.get_timer(), self.session.get_timer()) if t is not None]
        return min(times) if times else None

    def control_unacked(self) -> int:
        """Control-stream bytes sent and not acknowledged yet (aioquic keeps them in
        the stream's send buffer; no public accessor)."""
        stream = self.quic._streams.get(CONTROL_STREAM)
        return 0 if stream is None else len(getattr(stream.sender, "_buffer", b""))

    def quic_rtt(self) -> tuple[float, float, float] | None:
        """QUIC's own RTT estimate: min, smoothed, variance (no public accessor)."""
        loss = self.quic._loss
        if loss._rtt_min == float("inf"):
            return None
        return (loss._rtt_min, loss._rtt_smoothed, loss._rtt_variance)
