"""The state of one QUIC connection to a peer: authentication, stream readers, credit
in both directions, timers and counters. QuicTransport drives it."""

from __future__ import annotations

import asyncio
import itertools

from aioquic.quic.connection import QuicConnection

from ciuic_p2p.core.frames import CreditReceiver, CreditSender, FrameReader
from ciuic_p2p.core.rtt import RttEstimator
from ciuic_p2p.transport.base import Address

CONTROL_STREAM = 0
BULK_STREAM = 4


class QuicLink:
    """One QUIC connection and what we know of its peer."""

    def __init__(self, quic: QuicConnection, address: Address, dialed: bool, window: int) -> None:
        self.quic = quic
        self.address = address
        self.dialed = dialed
        self.peer: bytes | None = None
        self.claimed = "?"
        self.authenticated = False
        self.closed = False
        self.readers = {CONTROL_STREAM: FrameReader(), BULK_STREAM: FrameReader()}
        self.credit_out = CreditSender(0)
        self.peer_window = 0
        self.credit_in = CreditReceiver(window)
        self.credit_changed = asyncio.Event()
        self.ready: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
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
