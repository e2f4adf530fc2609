"""One link's protocol as a pure state machine: authentication before anything,
credit for bulk frames, ping/pong, a clean close.

    session = LinkSession(dialed=True, identity=me, trust=trust, settings=s, now=now)
    session.server_hello(certificate, server_cid, original_dcid, utc)  # dialer, after TLS
    session.receive(Lane.CONTROL, data, now, utc)   # a lane's bytes, as they arrive
    while (event := session.next_event()) is not None: ...
    for lane, data in session.data_to_send(): ...   # write them to the lane's stream
    session.get_timer(); session.handle_timer(now)

Both transports drive it, and neither writes a frame of its own: transport/quic.py
maps the two lanes onto QUIC streams (control on stream 0, bulk on a stream per
direction), transport/memory.py hands the bytes to the peer's session in memory.

The protocol (frames and their limits: core.link.frames; the proof: core.link.auth):

1. The dialer verifies the server's certificate (the TLS handshake's, or the memory
   transport's stand-in) and sends ``AUTH``; the accepting side checks it, answers
   ``AUTH_OK`` and only then anything else. Until a link is authenticated, the only
   bytes it accepts are that exchange, on the control lane; the accepting side gives
   up after ``auth_timeout_s``.
2. Each side then grants its receive window in a ``CREDIT`` frame. Bulk frames spend
   the peer's credit (``send`` says False when there is not enough: wait for
   :class:`CreditGranted`); the receiver grants more as its application consumes
   (``consumed``), and a peer that sends beyond its credit, or grants more than
   ``max_credit_bytes`` outstanding, breaks the rules.
3. ``PING`` every ``ping_interval_s``, answered by ``PONG``: the RTT samples
   (``rtt``) that routing uses. The bulk lane's frames, as they arrive, give the rate
   the peer's bytes reach this node (``receive_rate``, core.link.throughput).
4. ``CLOSE`` with a reason; a side that breaks a rule sends one too once it is
   authenticated (a stranger learns nothing), and the link is over.

Every rule broken ends the session with one :class:`Closed` event naming the reason
and the lane whose bytes broke it, never an exception: what a peer sends cannot
raise out of ``receive``.
"""

from __future__ import annotations

import datetime as dt
import enum
import struct
from dataclasses import dataclass

from cryptography import x509

from ciuic_p2p.config.sections import TransportSection
from ciuic_p2p.core.link.auth import ServerAdmission, build_auth
from ciuic_p2p.core.link.frames import (
    BULK_TYPES,
    FRAME_HEADER,
    MAX_PAYLOAD,
    CreditSender,
    Frame,
    FrameReader,
    FrameType,
    FramingError,
    ReceiveQuota,
    bulk_cost,
    encode_frame,
    frame_header,
)
from ciuic_p2p.core.link.keys import Signer, peer_id_of
from ciuic_p2p.core.link.rtt import RttEstimator
from ciuic_p2p.core.link.throughput import ReceiveRate
from ciuic_p2p.core.link.trust import Trust
from ciuic_p2p.errors import AdmissionError, CiuicError

MAX_RTT_SAMPLE_S = 60.0
"""A PONG claiming a longer round trip (or a negative one) is not an RTT sample."""
PING = struct.Struct("<Qd")
"""A ping's payload: its number and the sender's clock when sent (echoed in PONG)."""
CREDIT = struct.Struct("<Q")
MAX_CLOSE_REASON_BYTES = 500
SEPARATE_PAYLOAD_BYTES = 16 * 1024
"""A payload this large is handed to the stream after its header, not joined to it:
the QUIC library copies it into its send buffer anyway, and the join was one more
pass over every byte of a chunk (a small frame is cheaper joined than written twice)."""


class SessionStateError(CiuicError):
    """The caller asked a session for something its state does not allow (a bug of
    the transport, not the peer's doing)."""


class Lane(enum.IntEnum):
    """The two byte streams of a link: control frames never wait behind bulk data."""

    CONTROL = 0
    BULK = 1


def lane_of(frame_type: FrameType) -> Lane:
    return Lane.BULK if frame_type in BULK_TYPES else Lane.CONTROL


@dataclass(frozen=True, slots=True)
class LocalIdentity:
    """This node, as a link shows it: its key (signing the proof) and credential."""

    signer: Signer
    certificate_der: bytes


class SessionState(enum.Enum):
    HANDSHAKE = "handshake"
    """The dialer waits for the server's certificate (the TLS handshake)."""
    AUTHENTICATING = "authenticating"
    AUTHENTICATED = "authenticated"
    CLOSED = "closed"


@dataclass(frozen=True, slots=True)
class Authenticated:
    """The peer proved who it is; application frames may flow."""

    peer: bytes
    certificate: x509.Certificate


@dataclass(frozen=True, slots=True)
class FrameArrived:
    """An application frame from the authenticated peer. The transport hands it up and
    calls :meth:`LinkSession.consumed` once the application has read it."""

    type: FrameType
    payload: bytes


@dataclass(frozen=True, slots=True)
class CreditGranted:
    """The peer granted credit: a bulk send that waited may go now."""

    available: int


@dataclass(frozen=True, slots=True)
class Closed:
    """The session is over: the peer closed it (``by_peer``) or broke a rule."""

    reason: str
    by_peer: bool
    authenticated: bool
    """Whether the peer had been admitted (a refusal, else a drop)."""
    lane: Lane | None = None
    """The lane whose bytes broke the rule, when it was a lane's."""


SessionEvent = Authenticated | FrameArrived | CreditGranted | Closed


class LinkSession:
    """One side of one link; see the module docstring."""

    def __init__(
        self,
        *,
        dialed: bool,
        identity: LocalIdentity,
        trust: Trust,
        settings: TransportSection,
        now: float,
    ) -> None:
        self.dialed = dialed
        self.identity = identity
        self.trust = trust
        self.settings = settings
        self.state = SessionState.HANDSHAKE if dialed else SessionState.AUTHENTICATING
        self.peer: bytes | None = None
        self.claimed = "?"
        """Who the peer says it is (for the logs), before and after it proved it."""
        self.certificate: x509.Certificate | None = None
        """The peer's node certificate once checked (a reloaded revocation list is
        held against it)."""
        self.close_reason = ""
        self.credit_out = CreditSender(0)
        self.peer_window = 0
        """The peer's first grant: its receive window."""
        self.quota = ReceiveQuota(settings.receive_window_bytes)
        self.rtt = RttEstimator()
        self.receive_rate = ReceiveRate()
        """The pace of the peer's bulk frames here (core.link.throughput)."""
        self._admission: ServerAdmission | None = None
        self._readers = {
            Lane.CONTROL: FrameReader(first=frozenset({FrameType.AUTH_OK})) if dialed else None,
            Lane.BULK: FrameReader(),
        }
        self._auth_sent = False
        self._auth_deadline = None if dialed else now + settings.auth_timeout_s
        self._next_ping: float | None = None
        self._ping_count = 0
        self._out: list[tuple[Lane, bytes]] = []
        self._events: list[SessionEvent] = []

    # -- state ----------------------------------------------------------------------------

    @property
    def authenticated(self) -> bool:
        return self.state is SessionState.AUTHENTICATED

    @property
    def closed(self) -> bool:
        return self.state is SessionState.CLOSED

    @property
    def bulk_buffered_bytes(self) -> int:
        """Bulk bytes sent and not yet credited back: what the peer holds unread."""
        return max(0, self.peer_window - self.credit_out.available)

    # -- authentication ---------------------------------------------------------------------

    def server_hello(
        self,
        certificate: x509.Certificate | None,
        server_cid: bytes,
        original_dcid: bytes,
        utc: dt.datetime,
    ) -> None:
        """The dialer learned the server's certificate and the connection's IDs (the
        TLS handshake completed): check the certificate and send the proof, bound to
        this connection (core.link.auth)."""
        if not self.dialed or self.state is not SessionState.HANDSHAKE:
            raise SessionStateError("server_hello is the dialer's, once")
        if certificate is None:
            self._fail("server sent no certificate", None)
            return
        try:
            server_key = self.trust.verify(certificate, utc)
        except AdmissionError as exc:
            self._fail(str(exc), None)
            return
        self.certificate = certificate
        self.peer = server_key
        self.claimed = peer_id_of(server_key)
        proof = build_auth(
            self.identity.signer,
            self.identity.certificate_der,
            self.trust.cluster,
            server_key,
            server_cid,
            original_dcid,
        )
        self.state = SessionState.AUTHENTICATING
        self._auth_sent = True
        self._queue(FrameType.AUTH, proof)

    def bind_server(self, server_cid: bytes, original_dcid: bytes) -> None:
        """The accepting side's connection IDs, which the client's proof must name.
        Call it before the first control bytes (QUIC: once the IDs are final)."""
        if self.dialed or self._admission is not None:
            raise SessionStateError("bind_server is the accepting side's, once")
        self._admission = ServerAdmission(
            self.trust, self.identity.signer.public_key, server_cid, original_dcid
        )

    @property
    def bound(self) -> bool:
        return self._admission is not None

    # -- bytes in ---------------------------------------------------------------------------

    def receive(self, lane: Lane, data: bytes, now: float, utc: dt.datetime) -> None:
        """Bytes the peer sent on ``lane``, in order."""
        if self.closed or not data:
            return
        try:
            if not self.authenticated:
                frames = self._receive_unauthenticated(lane, data, now, utc)
            else:
                reader = self._readers[lane]
                assert reader is not None
                frames = reader.feed(data)
                if lane is Lane.BULK:
                    sizes = [FRAME_HEADER.size + len(f.payload) for f in frames]
                    self.receive_rate.arrived(len(data), sizes, reader.buffered, now)
            for frame in frames:
                self._handle_frame(lane, frame, now)
                if self.closed:
                    return
        except (FramingError, AdmissionError) as exc:
            self._fail(str(exc), lane)

    def end_of_stream(self, lane: Lane) -> None:
        """The peer finished a lane's stream: a partial frame in it breaks the rules."""
        reader = self._readers[lane]
        if self.closed or reader is None:
            return
        try:
            reader.end_of_stream()
        except FramingError as exc:
            self._fail(str(exc), lane)

    def _receive_unauthenticated(
        self, lane: Lane, data: bytes, now: float, utc: dt.datetime
    ) -> list[Frame]:
        if lane is not Lane.CONTROL:
            raise FramingError("bulk bytes before authentication")
        if self.dialed:
            if not self._auth_sent:
                raise FramingError("bytes before the server's certificate")
            reader = self._readers[Lane.CONTROL]
            assert reader is not None
            return reader.feed(data)
        if self._admission is None:
            raise SessionStateError("an accepting session receives once bound")
        admission = self._admission
        try:
            admitted = admission.receive(data, utc)
        finally:
            self.claimed = admission.claimed
        if admitted is None:
            return []
        self.peer, self.certificate = admitted.key, admitted.certificate
        self.claimed = peer_id_of(admitted.key)
        self._readers[Lane.CONTROL] = admission.reader  # it holds what followed AUTH
        self._queue(FrameType.AUTH_OK, b"")
        self._authenticated(now)
        return admitted.rest

    def _authenticated(self, now: float) -> None:
        assert self.peer is not None and self.certificate is not None
        self.state = SessionState.AUTHENTICATED
        self._auth_deadline = None
        self._queue(FrameType.CREDIT, CREDIT.pack(self.quota.window))
        self._next_ping = now  # the first RTT sample at once: routing wants one
        self._events.append(Authenticated(self.peer, self.certificate))

    def _handle_frame(self, lane: Lane, frame: Frame, now: float) -> None:
        ftype, payload = frame.type, frame.payload
        if not self.authenticated:  # the dialer's reader let only AUTH_OK through
            self._authenticated(now)
            return
        if lane is not lane_of(ftype) or ftype in (FrameType.AUTH, FrameType.AUTH_OK):
            raise FramingError(f"{ftype.name} on the {lane.name.lower()} lane")
        if ftype is FrameType.PING:
            self._queue(FrameType.PONG, payload)
        elif ftype is FrameType.PONG:
            if len(payload) == PING.size:
                _, sent_at = PING.unpack(payload)
                rtt_s = now - sent_at  # our own clock, echoed: range-checked all the same
                if 0.0 <= rtt_s <= MAX_RTT_SAMPLE_S:
                    self.rtt.add(rtt_s)
                    self._size_window()
        elif ftype is FrameType.CREDIT:
            self._credit(payload)
        elif ftype is FrameType.CLOSE:
            text = payload.decode("utf-8", "replace")[:200]
            self._end("peer closed: " + text, by_peer=True, lane=None)
        else:
            self.quota.received(ftype, len(payload))
            self._events.append(FrameArrived(ftype, payload))

    def _size_window(self) -> None:
        """Grow the receive window toward what the path holds in flight: twice the
        smallest RTT seen times ``path_rate_bps``, within ``receive_window_max_bytes``
        (the smallest: queueing delay, a busy peer or one that holds its pongs back,
        must not buy a wider window)
        (a fixed 4 MiB capped one peer at 4 MiB per round trip: 12.8 MB/s at 327 ms).
        It only grows, by at least a quarter at a time or to the bound (each step is a
        CREDIT frame)."""
        base_rtt = self.rtt.min_s
        st = self.settings
        if base_rtt is None or st.path_rate_bps <= 0:
            return
        want = int(2.0 * base_rtt * st.path_rate_bps / 8.0)
        want = min(st.receive_window_max_bytes, max(st.receive_window_bytes, want))
        window = self.quota.window
        if want > window and (want >= window * 1.25 or want == st.receive_window_max_bytes):
            extra = self.quota.grow(want)
            if extra:
                self._queue(FrameType.CREDIT, CREDIT.pack(extra))

    def _credit(self, payload: bytes) -> None:
        if len(payload) != CREDIT.size:
            raise FramingError("CREDIT frame of the wrong size")
        (amount,) = CREDIT.unpack(payload)
        limit = self.settings.max_credit_bytes
        if not 0 < amount <= limit - self.credit_out.available:
            raise FramingError(f"CREDIT of {amount} bytes: outstanding credit would pass {limit}")
        if self.peer_window == 0:
            self.peer_window = amount
        self.credit_out.grant(amount)
        self._events.append(CreditGranted(self.credit_out.available))

    # -- the application's side ----------------------------------------------------------------

    def send(self, frame_type: FrameType, payload: bytes | bytearray | memoryview) -> bool:
        """Queue one application frame; False, with nothing queued, when a bulk frame
        needs more credit than the peer granted. Raises ``FramingError`` for a payload
        over its type's limit (before any credit is spent)."""
        if not self.authenticated:
            raise SessionStateError(f"send on a {self.state.value} link")
        if frame_type in (FrameType.AUTH, FrameType.AUTH_OK, FrameType.CREDIT):
            raise SessionStateError(f"{frame_type.name} is the session's own")
        if len(payload) > MAX_PAYLOAD[frame_type]:
            raise FramingError(
                f"{frame_type.name} payload of {len(payload)} bytes exceeds its limit"
            )
        cost = bulk_cost(frame_type, len(payload))
        if cost and not self.credit_out.try_spend(cost):
            return False
        self._queue(frame_type, payload)
        return True

    def consumed(self, frame_type: FrameType, payload_len: int) -> None:
        """The application read a frame that :class:`FrameArrived` handed it."""
        if self.closed:
            return
        grant = self.quota.consumed(frame_type, payload_len)
        if grant:
            self._queue(FrameType.CREDIT, CREDIT.pack(grant))

    def close(self, reason: str, *, quiet: bool = False) -> None:
        """End the session from this side: a ``CLOSE`` frame goes last (unless
        ``quiet``, or the peer was never admitted). No event: the caller knows."""
        if self.closed:
            return
        if self.authenticated and not quiet:
            self._queue(FrameType.CLOSE, reason.encode()[:MAX_CLOSE_REASON_BYTES])
        self.state = SessionState.CLOSED
        self.close_reason = reason

    # -- time ----------------------------------------------------------------------------

    def get_timer(self) -> float | None:
        times = [t for t in (self._auth_deadline, self._next_ping) if t is not None]
        return min(times) if times and not self.closed else None

    def handle_timer(self, now: float) -> None:
        if self.closed:
            return
        if self._auth_deadline is not None and now >= self._auth_deadline:
            self._fail("not authenticated in time", None)
            return
        if self._next_ping is not None and now >= self._next_ping:
            self._ping_count += 1
            self._queue(FrameType.PING, PING.pack(self._ping_count, now))
            self._next_ping = now + self.settings.ping_interval_s

    # -- out -----------------------------------------------------------------------------

    def data_to_send(self) -> list[tuple[Lane, bytes]]:
        """Bytes to write, each to its lane's stream, in order."""
        out, self._out = self._out, []
        return out

    def next_event(self) -> SessionEvent | None:
        return self._events.pop(0) if self._events else None

    def _queue(self, frame_type: FrameType, payload: bytes | bytearray | memoryview) -> None:
        lane = lane_of(frame_type)
        if len(payload) < SEPARATE_PAYLOAD_BYTES:
            self._out.append((lane, encode_frame(frame_type, payload)))
        else:  # the stream takes the header and the payload as two writes: no join
            self._out.append((lane, frame_header(frame_type, len(payload))))
            self._out.append((lane, payload if type(payload) is bytes else bytes(payload)))

    def _fail(self, reason: str, lane: Lane | None) -> None:
        if self.authenticated:
            self._queue(FrameType.CLOSE, reason.encode()[:MAX_CLOSE_REASON_BYTES])
        self._end(reason, by_peer=False, lane=lane)

    def _end(self, reason: str, *, by_peer: bool, lane: Lane | None) -> None:
        was_authenticated = self.authenticated
        self.state = SessionState.CLOSED
        self.close_reason = reason
        self._auth_deadline = self._next_ping = None
        self._events.append(Closed(reason, by_peer, was_authenticated, lane))


@dataclass(frozen=True, slots=True)
class LinkClaim:
    """What decides which of two authenticated links to one peer stays."""

    dialed: bool
    established_at: float


def keep_new_link(
    local_key: bytes, peer: bytes, new: LinkClaim, existing: LinkClaim, stale_after_s: float
) -> bool:
    """One link per peer. Simultaneous dials: both ends keep the link dialed by the
    smaller key, so they agree without a word. An older link established more than
    ``stale_after_s`` earlier is a restarted peer's previous life, dead at its end:
    the new one replaces it."""
    if new.established_at - existing.established_at > stale_after_s:
        return True

    def dialer(claim: LinkClaim) -> bytes:
        return local_key if claim.dialed else peer

    return dialer(new) < dialer(existing)
