"""Framed messages on a byte stream, and credit-based flow control.

A frame is ``type (u8) | length (u32, little-endian) | payload``. Every type has a hard
payload limit; a frame over its limit, an unknown type or a truncated stream is a
:class:`FramingError` and closes the connection. The reader buffers at most one frame.

Flow control: QUIC's own windows grow as data arrives whether or not the application
reads it (aioquic), so they never slow a fast sender down. Bulk frames (chunks)
therefore spend *credit* that the receiver grants in ``CREDIT`` frames as its
application consumes data: a sender holds at most the credit it was given, and a
receiver that sees more bulk bytes than it granted closes the connection. Control
frames (auth, ping, gossip) travel on their own stream and spend no credit.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

from ciuic_p2p.core.bytequeue import ByteQueue
from ciuic_p2p.core.codec.chunk import MAX_CHUNK_BYTES
from ciuic_p2p.core.link.lanes import MAX_LANES_PAYLOAD
from ciuic_p2p.core.mesh.messages import MAX_CHUNK_MESSAGE_BYTES
from ciuic_p2p.core.store.messages import MAX_CONTROL_BYTES, MAX_DATA_BYTES
from ciuic_p2p.errors import CiuicError

FRAME_HEADER = struct.Struct("<BI")


class FramingError(CiuicError):
    """A peer sent bytes that are not a valid frame sequence."""


class FlowControlError(FramingError):
    """A peer sent more bulk bytes than the credit it was granted."""


CONTROL_FRAME_COST = 64
"""What an unread control frame counts for against the quota beyond its payload (the
frame held in memory): a flood of empty frames is bounded too."""
MAX_RATE_PROBE_BYTES = 256 * 1024
"""One RATE_PROBE frame's payload at most."""


class FrameType(enum.IntEnum):
    """Append only: the numbers are part of the protocol."""

    AUTH = 1
    """Client → server, first frame: node certificate and proof of possession."""
    AUTH_OK = 2
    """Server → client: the proof was accepted."""
    PING = 3
    PONG = 4
    CHUNK = 5
    """An origin-signed update chunk (core.codec.chunk); bulk, spends credit."""
    CREDIT = 6
    """Grants the peer more bulk bytes (u64)."""
    GOSSIP = 7
    """Membership and routing messages (later layers)."""
    CLOSE = 8
    """A clean close with a UTF-8 reason."""
    MESH_CHUNK = 9
    """A mesh dissemination message carrying a chunk (core.mesh.messages CHUNK); bulk."""
    DIRECT = 10
    """Bytes from one trainer to the peer's trainer, not forwarded (the dense
    all-reduce baseline's segments); bulk."""
    STORE_CONTROL = 11
    """Shared-store queries and requests (core.store.messages), not forwarded."""
    STORE_DATA = 12
    """Shared-store offers and pieces (core.store.messages); bulk."""
    RATE_PROBE = 13
    """Filler the receiver measures its link's rate from and drops: sent, bounded, to a
    peer that has not measured the link yet (daemon.node); bulk."""
    LANES = 14
    """The UDP ports of this node's lane processes (core.link.lanes); control, once per
    link."""


MAX_PAYLOAD = {
    FrameType.AUTH: 4096,
    FrameType.AUTH_OK: 256,
    FrameType.PING: 64,
    FrameType.PONG: 64,
    FrameType.CHUNK: MAX_CHUNK_BYTES,
    FrameType.CREDIT: 8,
    FrameType.GOSSIP: 64 * 1024,
    FrameType.CLOSE: 512,
    FrameType.MESH_CHUNK: MAX_CHUNK_MESSAGE_BYTES,
    FrameType.DIRECT: MAX_CHUNK_MESSAGE_BYTES,
    FrameType.STORE_CONTROL: MAX_CONTROL_BYTES,
    FrameType.STORE_DATA: MAX_DATA_BYTES,
    FrameType.RATE_PROBE: MAX_RATE_PROBE_BYTES,
    FrameType.LANES: MAX_LANES_PAYLOAD,
}
BULK_TYPES = frozenset(
    {
        FrameType.CHUNK,
        FrameType.MESH_CHUNK,
        FrameType.DIRECT,
        FrameType.STORE_DATA,
        FrameType.RATE_PROBE,
    }
)
MAX_BULK_FRAME = max(MAX_PAYLOAD[t] for t in BULK_TYPES) + FRAME_HEADER.size


@dataclass(frozen=True, slots=True)
class Frame:
    type: FrameType
    payload: bytes


def frame_header(frame_type: FrameType, payload_len: int) -> bytes:
    """A frame's header, for a payload written after it as it is."""
    if payload_len > MAX_PAYLOAD[frame_type]:
        raise FramingError(f"{frame_type.name} payload of {payload_len} bytes exceeds its limit")
    return FRAME_HEADER.pack(frame_type, payload_len)


def encode_frame(frame_type: FrameType, payload: bytes | bytearray | memoryview) -> bytes:
    return frame_header(frame_type, len(payload)) + bytes(payload)


def bulk_cost(frame_type: FrameType, payload_len: int) -> int:
    """Credit a frame spends: its whole size for bulk types, 0 otherwise."""
    return FRAME_HEADER.size + payload_len if frame_type in BULK_TYPES else 0


class FrameReader:
    """Incremental frame parser for one stream: ``feed`` bytes, get whole frames.

    ``first``, when set, are the types the stream's first frame may have: any other is
    refused from its header, before its payload is buffered (a link's first frame is
    ``AUTH``, so a stranger's unread bytes stay under that frame's limit)."""

    def __init__(self, first: frozenset[FrameType] | None = None) -> None:
        self._buf = ByteQueue()
        self._need: tuple[FrameType, int] | None = None
        self._first = first

    @property
    def buffered(self) -> int:
        return len(self._buf)

    def feed(self, data: bytes | bytearray | memoryview) -> list[Frame]:
        """The frames ``data`` completes, each payload copied once from the pieces
        it came in (core.bytequeue)."""
        self._buf.append(data)
        frames: list[Frame] = []
        while True:
            if self._need is None:
                if len(self._buf) < FRAME_HEADER.size:
                    return frames
                raw_type, length = FRAME_HEADER.unpack(self._buf.peek(FRAME_HEADER.size))
                try:
                    frame_type = FrameType(raw_type)
                except ValueError as exc:
                    raise FramingError(f"unknown frame type {raw_type}") from exc
                if self._first is not None and frame_type not in self._first:
                    raise FramingError(f"{frame_type.name} before authentication")
                if length > MAX_PAYLOAD[frame_type]:
                    raise FramingError(
                        f"{frame_type.name} frame of {length} bytes exceeds its limit"
                    )
                self._need = (frame_type, length)
            frame_type, length = self._need
            if len(self._buf) < FRAME_HEADER.size + length:
                return frames
            self._buf.skip(FRAME_HEADER.size)
            frames.append(Frame(frame_type, self._buf.take(length)))
            self._need = None
            self._first = None

    def end_of_stream(self) -> None:
        """The peer finished the stream: a partial frame is an error."""
        if len(self._buf):
            raise FramingError(f"stream ended inside a frame ({len(self._buf)} bytes left)")


class CreditSender:
    """The sending side's view of the credit its peer granted."""

    def __init__(self, initial: int) -> None:
        self.available = initial

    def grant(self, amount: int) -> None:
        self.available += amount

    def try_spend(self, cost: int) -> bool:
        if cost > self.available:
            return False
        self.available -= cost
        return True


class CreditReceiver:
    """The receiving side: the credit outstanding, and when to grant more.

    ``window`` is the receive quota per peer: bulk bytes received but not yet
    consumed by the application never exceed it."""

    def __init__(self, window: int) -> None:
        if window < MAX_BULK_FRAME:
            raise ValueError("the window must hold at least one largest chunk frame")
        self.window = window
        self.outstanding = window  # granted, not yet received
        self.unconsumed = 0
        self._consumed_since_grant = 0

    def received(self, cost: int) -> None:
        if cost > self.outstanding:
            raise FlowControlError(
                f"peer sent {cost} bulk bytes with {self.outstanding} bytes of credit"
            )
        self.outstanding -= cost
        self.unconsumed += cost

    def grow(self, window: int) -> int:
        """Widen the window to ``window`` (never narrower: credit granted stays
        granted); the extra credit to grant now."""
        extra = max(0, window - self.window)
        self.window += extra
        self.outstanding += extra
        return extra

    def consumed(self, cost: int) -> int:
        """The application consumed ``cost`` bytes; return the credit to grant now
        (0 until half the window has been consumed, to batch CREDIT frames)."""
        self.unconsumed -= cost
        self._consumed_since_grant += cost
        if self._consumed_since_grant * 2 < self.window:
            return 0
        grant = self._consumed_since_grant
        self._consumed_since_grant = 0
        self.outstanding += grant
        return grant


#: Unread control bytes (gossip, pings) one peer may have queued at a node.
CONTROL_QUOTA_BYTES = 1 << 20


class ReceiveQuota:
    """What one peer may have queued at this node, unread by its application: bulk
    bytes within the credit granted (``CreditReceiver``), control bytes within a fixed
    quota (they spend no credit). Both transports keep one per link."""

    def __init__(self, window: int, control_quota: int = CONTROL_QUOTA_BYTES) -> None:
        self.credit = CreditReceiver(window)
        self.control_quota = control_quota
        self.control_unconsumed = 0

    @property
    def window(self) -> int:
        return self.credit.window

    def grow(self, window: int) -> int:
        """Widen the bulk window (see :meth:`CreditReceiver.grow`)."""
        return self.credit.grow(window)

    def received(self, frame_type: FrameType, payload_len: int) -> None:
        cost = bulk_cost(frame_type, payload_len)
        if cost:
            self.credit.received(cost)
            return
        cost = payload_len + CONTROL_FRAME_COST
        if self.control_unconsumed + cost > self.control_quota:
            raise FlowControlError("control frames beyond the quota, unread")
        self.control_unconsumed += cost

    def consumed(self, frame_type: FrameType, payload_len: int) -> int:
        """The application read a frame; return the credit to grant now (or 0)."""
        cost = bulk_cost(frame_type, payload_len)
        if cost:
            return self.credit.consumed(cost)
        self.control_unconsumed -= payload_len + CONTROL_FRAME_COST
        return 0
