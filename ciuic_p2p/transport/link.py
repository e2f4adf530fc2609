"""The state of one QUIC connection to a peer: authentication, stream readers, credit
in both directions, timers and counters. QuicTransport drives it."""

from __future__ import annotations

import asyncio
import itertools
import ssl

from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from cryptography import x509

from ciuic_p2p.config import TransportSection
from ciuic_p2p.core.link.auth import ServerAdmission
from ciuic_p2p.core.link.frames import CreditSender, FrameReader, ReceiveQuota
from ciuic_p2p.core.link.rtt import RttEstimator
from ciuic_p2p.identity import NodeKey
from ciuic_p2p.transport.base import Address, LinkStats, RttStats

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


class QuicLink:
    """One QUIC connection and what we know of its peer."""

    def __init__(self, quic: QuicConnection, address: Address, dialed: bool, window: int) -> None:
        self.quic = quic
        self.address = address
        self.dialed = dialed
        self.peer: bytes | None = None
        self.claimed = "?"
        self.certificate: x509.Certificate | None = None
        """The peer's node certificate, once checked (a revocation list reloaded later
        is held against it)."""
        self.authenticated = False
        self.closed = False
        self.pending = False
        """Accepted and not yet settled (authenticated, refused or gone): counted
        against the gate's caps (transport.gate)."""
        self.admission: ServerAdmission | None = None
        """An accepted link's check of its client, until it is admitted."""
        self.readers = {
            CONTROL_STREAM: FrameReader(),
            BULK_STREAM: FrameReader(),
            SERVER_BULK_STREAM: FrameReader(),
        }
        self.credit_out = CreditSender(0)
        self.peer_window = 0
        self.quota = ReceiveQuota(window)
        self.credit_changed = asyncio.Event()
        self.ready: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        # Nobody awaits an accepted link's future: mark its failure as seen.
        self.ready.add_done_callback(lambda f: f.cancelled() or f.exception())
        self.timer: asyncio.TimerHandle | None = None
        self.timer_at: float | None = None
        self.auth_deadline: asyncio.TimerHandle | None = None
        self.ping_task: asyncio.Task[None] | None = None
        self.rtt = RttEstimator()
        self.ping_ids = itertools.count(1)
        self.bytes_sent = 0
        self.bytes_received = 0
        self.transmit_pending = False
        self.gone = asyncio.Event()
        self.established_at = 0.0

    @property
    def bulk_out(self) -> int:
        """The stream this side sends bulk frames on."""
        return BULK_STREAM if self.dialed else SERVER_BULK_STREAM

    @property
    def bulk_in(self) -> int:
        """The stream the peer sends bulk frames on."""
        return SERVER_BULK_STREAM if self.dialed else BULK_STREAM

    def control_unacked(self) -> int:
        """Control-stream bytes sent and not acknowledged yet (aioquic keeps them in
        the stream's send buffer; no public accessor)."""
        stream = self.quic._streams.get(CONTROL_STREAM)
        return 0 if stream is None else len(getattr(stream.sender, "_buffer", b""))

    def rtt_stats(self) -> RttStats:
        loss = self.quic._loss  # aioquic has no public accessor for its RTT estimate
        have_quic = loss._rtt_min != float("inf")
        return RttStats(
            ping_min_s=self.rtt.min_s,
            ping_smoothed_s=self.rtt.smoothed_s,
            ping_var_s=self.rtt.var_s,
            quic_min_s=loss._rtt_min if have_quic else None,
            quic_smoothed_s=loss._rtt_smoothed if have_quic else None,
            quic_var_s=loss._rtt_variance if have_quic else None,
            samples=self.rtt.samples,
        )

    def stats(self) -> LinkStats:
        return LinkStats(
            bytes_sent=self.bytes_sent,
            bytes_received=self.bytes_received,
            bulk_buffered_bytes=max(0, self.peer_window - self.credit_out.available),
            credit_available=self.credit_out.available,
        )
