"""The frames between a trainer and its node's daemon (the trainer socket), version 1::


    u32 LE length (of type + body) | u8 type | body

with types below. ``HELLO``/``WELCOME``/``MEMBERS``/``STATS`` bodies are UTF-8 JSON
objects; ``PUBLISH`` carries a mesh payload; ``DELIVER`` and ``DIRECT_*`` start with
the peer (u8 length + ASCII peer ID). ``PUT_PART`` and ``GOT_PART`` carry one part
of a store object: name (u8 length + UTF-8), version, total size and offset (u64 LE
each), compat digest (32), then the part's bytes (at most ``PART_BYTES``). A frame
is at most ``MAX_FRAME_BYTES``; the reader refuses a longer length before reading the
body, and every malformed frame is a :class:`TrainWireError`. Numeric values only ever get appended.
"""

from __future__ import annotations

import enum
import json
import struct
from dataclasses import dataclass
from typing import Any

from ciuic_p2p.core.bytequeue import ByteQueue
from ciuic_p2p.core.replica.messages import MAX_PAYLOAD_BYTES, TrainWireError

MAX_FRAME_BYTES = MAX_PAYLOAD_BYTES + 256
MAX_JSON_BYTES = 1 << 20
MAX_PEER_BYTES = 128
_LEN = struct.Struct("<IB")
_PART = struct.Struct("<QQQ32s")
PART_BYTES = 512 * 1024


class TrainerFrame(enum.IntEnum):
    HELLO = 1  # trainer -> daemon: {"run": name}
    WELCOME = 2  # daemon -> trainer: {"peer", "public_key", "incarnation", "members"}
    PUBLISH = 3  # trainer -> daemon: a mesh payload to broadcast
    DELIVER = 4  # daemon -> trainer: peer + a mesh payload from that origin
    MEMBERS = 5  # daemon -> trainer: {"alive": [peer, ...]}
    STATS_REQUEST = 6  # trainer -> daemon: empty, or {"step", "encode_s", "decode_s", ...}
    STATS = 7  # daemon -> trainer: {"udp_bytes_sent", "backlog_bytes", ...}
    DIRECT_OUT = 8  # trainer -> daemon: peer + bytes for that peer's trainer
    DIRECT_IN = 9  # daemon -> trainer: peer + bytes from that peer's trainer
    PUT_PART = 10  # trainer -> daemon: part of an object to hold (the state snapshot, a put)
    SNAPSHOT_REQUEST = 11  # daemon -> trainer: empty; send a fresh state snapshot
    GET_REQUEST = 12  # trainer -> daemon: {"name", "min_version", "slack", "patient", "id"}
    GOT_PART = 13  # daemon -> trainer: part of a fetched object
    STORE_RESULT = 14  # daemon -> trainer: {"id", "ok", "version", "error", ...}
    PUT_REQUEST = 15  # trainer -> daemon: {"name", "id"}: replicate what PUT_PART sent
    CHECKPOINT = 16  # trainer -> daemon: {"path", "step", "digest"}: one written (audit log)
    SAMPLE_REQUEST = 17  # trainer -> daemon: {"id", "name", "writers", "spans", ...}: see
    # daemon.trainer; answered by STORE_RESULT {"samples": [{"writer", "version", "data"}]}
    STOPPING = 18  # daemon -> trainer: {"wait_s"}: the daemon stops; checkpoint now
    STOP_READY = 19  # trainer -> daemon: {"step", "checkpoint": path or null}: done


@dataclass(frozen=True, slots=True)
class Part:
    name: str
    version: int
    total: int
    offset: int
    compat: bytes
    data: memoryview


def part_frames(
    ftype: TrainerFrame,
    name: str,
    version: int,
    data: bytes | bytearray | memoryview,
    compat: bytes,
) -> list[list[bytes | memoryview]]:
    """An object as PUT_PART or GOT_PART frames (each a list of buffers, no copy of
    the data); an empty object is one empty part."""
    raw = name.encode("utf-8")
    if not 0 < len(raw) <= 200 or len(compat) != 32:
        raise ValueError("object names are 1-200 bytes, compat 32")
    view = memoryview(data).cast("B")
    frames: list[list[bytes | memoryview]] = []
    for offset in range(0, max(1, len(view)), PART_BYTES):
        piece = view[offset : offset + PART_BYTES]
        head = bytes((len(raw),)) + raw + _PART.pack(version, len(view), offset, compat)
        frames.append([frame_header(ftype, len(head) + len(piece)), head, piece])
    return frames


def decode_part(body: memoryview) -> Part:
    if not body or len(body) < 1 + body[0] + _PART.size:
        raise TrainWireError("object part is truncated")
    n = body[0]
    try:
        name = bytes(body[1 : 1 + n]).decode("utf-8")
    except UnicodeDecodeError:
        raise TrainWireError("object name is not UTF-8") from None
    version, total, offset, compat = _PART.unpack_from(body, 1 + n)
    data = body[1 + n + _PART.size :]
    if not name or len(data) > PART_BYTES or offset + len(data) > total or total > 1 << 36:
        raise TrainWireError("object part out of range")
    return Part(name, int(version), int(total), int(offset), bytes(compat), data)


def frame_header(ftype: TrainerFrame, body_len: int) -> bytes:
    if body_len + 1 > MAX_FRAME_BYTES:
        raise ValueError(f"frame body of {body_len} bytes exceeds {MAX_FRAME_BYTES}")
    return _LEN.pack(body_len + 1, ftype)


def json_frame(ftype: TrainerFrame, obj: dict[str, Any]) -> bytes:
    body = json.dumps(obj, separators=(",", ":")).encode()
    return frame_header(ftype, len(body)) + body


def peer_prefix(peer: str) -> bytes:
    raw = peer.encode("ascii")
    if not 0 < len(raw) <= MAX_PEER_BYTES:
        raise ValueError(f"peer ID of {len(raw)} bytes")
    return bytes((len(raw),)) + raw


def split_peer(body: memoryview) -> tuple[str, memoryview]:
    if not body:
        raise TrainWireError("frame body lacks its peer")
    n = body[0]
    if n == 0 or n > MAX_PEER_BYTES or len(body) < 1 + n:
        raise TrainWireError("frame body's peer ID is empty, too long or truncated")
    try:
        peer = bytes(body[1 : 1 + n]).decode("ascii")
    except UnicodeDecodeError:
        raise TrainWireError("peer ID is not ASCII") from None
    return peer, body[1 + n :]


def parse_json(body: memoryview) -> dict[str, Any]:
    if len(body) > MAX_JSON_BYTES:
        raise TrainWireError("JSON frame too large")
    try:
        obj = json.loads(bytes(body))
    except (ValueError, RecursionError):
        raise TrainWireError("frame body is not JSON") from None
    if not isinstance(obj, dict):
        raise TrainWireError("JSON frame body is not an object")
    return obj


class TrainerFrameReader:
    """Incremental frame decoder: :meth:`feed` bytes as they come, get whole frames.
    Holds at most one frame (``MAX_FRAME_BYTES``) of unread input."""

    def __init__(self) -> None:
        self._buf = ByteQueue()

    def feed(self, data: bytes | bytearray | memoryview) -> list[tuple[TrainerFrame, memoryview]]:
        """The frames ``data`` completes, each body copied once (core.bytequeue)."""
        self._buf.append(data)
        frames: list[tuple[TrainerFrame, memoryview]] = []
        buf = self._buf
        while len(buf) >= _LEN.size:
            length, raw_type = _LEN.unpack(buf.peek(_LEN.size))
            if length < 1 or length > MAX_FRAME_BYTES:
                raise TrainWireError(f"frame length {length} outside [1, {MAX_FRAME_BYTES}]")
            if len(buf) < 4 + length:
                break
            try:
                ftype = TrainerFrame(raw_type)
            except ValueError:
                raise TrainWireError(f"unknown frame type {raw_type}") from None
            buf.skip(_LEN.size)
            frames.append((ftype, memoryview(buf.take(length - 1))))
        return frames
