"""One QUIC connection to a peer: the link session it carries (core.link.session), the
streams its two lanes map to, its timer."""

from __future__ import annotations

import asyncio
import collections
from typing import Any

from ciuic_p2p.core.link.pacer import Pacer
from ciuic_p2p.core.link.session import Lane, LinkSession
from ciuic_p2p.transport.backend import QuicBackend
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


class QuicLink(SessionLink):
    """One QUIC connection, the link session it carries, and its timers."""

    def __init__(
        self,
        quic: Any,
        session: LinkSession,
        address: Address,
        dialed: bool,
        backend: QuicBackend,
    ) -> None:
        """``quic``: the backend's connection (transport.backend)."""
        super().__init__(session, address, dialed)
        self.quic = quic
        self.backend = backend
        self.pending = False
        """Accepted and not yet settled (authenticated, refused or gone): counted
        against the gate's caps (transport.gate)."""
        self.timer: asyncio.TimerHandle | None = None
        self.timer_at: float | None = None
        self.transmit_pending = False
        self.expected_peer: bytes | None = None
        """The key a dial expects: a link that proves another is refused before it can
        take the place of that key's existing link."""
        self.pacer = Pacer()
        self.paced: collections.deque[bytes | memoryview] = collections.deque()
        """Bulk bytes the pacer holds back, in order, for the bulk stream (what the
        daemon's per-peer outbox hands the link, as QUIC's send buffer held before)."""
        self.pace_timer: asyncio.TimerHandle | None = None

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
        """Control-stream bytes sent and not acknowledged yet (transport.backend)."""
        return self.backend.unacked_bytes(self.quic, CONTROL_STREAM)

    def quic_rtt(self) -> tuple[float | None, float, float | None] | None:
        """QUIC's own RTT estimate: min, smoothed, variance."""
        return self.backend.rtt(self.quic)
