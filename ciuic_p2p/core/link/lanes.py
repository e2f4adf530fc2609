"""What two nodes say to spread their bulk frames over lane processes, and the pure
choices about it (transport.lanes runs the processes, transport.laned drives them).

A node with K lane processes sends each linked peer one ``LANES`` frame on the control
stream: ``version (u8) | count (u8) | port (u16 BE) x count``. Lanes pair up only when
both sides run the same count; then the side with the smaller key dials lane i of the
other at the host of the link it already has, so one member can make this node send
handshakes to that member's own host only, once per link, never elsewhere.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from ciuic_p2p.errors import CiuicError

LANES_VERSION = 1
MAX_LANES = 16
"""Lane processes per node, at most (and ports in one ``LANES`` frame)."""
MAX_LANES_PAYLOAD = 2 + 2 * MAX_LANES
_HEAD = struct.Struct(">BB")


class LanesError(CiuicError):
    """A ``LANES`` frame that is not one this version reads."""


def encode_lane_ports(ports: Sequence[int]) -> bytes:
    """The ``LANES`` payload announcing ``ports`` (one per lane, in lane order)."""
    if not 1 <= len(ports) <= MAX_LANES or not all(0 < p < 65536 for p in ports):
        raise ValueError(f"lane ports must be 1 to {MAX_LANES} ports in 1..65535")
    return _HEAD.pack(LANES_VERSION, len(ports)) + struct.pack(f">{len(ports)}H", *ports)


def decode_lane_ports(payload: bytes) -> tuple[int, ...]:
    """The ports a ``LANES`` payload announces; :class:`LanesError` for any payload
    that is not exactly one well-formed announcement."""
    if len(payload) < _HEAD.size:
        raise LanesError(f"LANES frame of {len(payload)} bytes")
    version, count = _HEAD.unpack_from(payload)
    if version != LANES_VERSION:
        raise LanesError(f"LANES version {version}, this node reads {LANES_VERSION}")
    if not 1 <= count <= MAX_LANES:
        raise LanesError(f"{count} lanes announced (1 to {MAX_LANES})")
    if len(payload) != _HEAD.size + 2 * count:
        raise LanesError(f"LANES frame of {len(payload)} bytes for {count} ports")
    ports = struct.unpack_from(f">{count}H", payload, _HEAD.size)
    if 0 in ports:
        raise LanesError("lane port 0")
    return tuple(ports)


def dials_lanes(local_key: bytes, peer_key: bytes) -> bool:
    """Whether this node dials the lanes of a link (the smaller key does: one lane
    connection per pair, never two racing)."""
    return local_key < peer_key


def pick_lane(queued_bytes: Sequence[int], up: Sequence[int]) -> int:
    """Of the lanes ``up`` to a peer, the one with the fewest bytes queued for it
    (the first of equals): a burst spreads over every lane at once."""
    if not up:
        raise ValueError("no lane is up")
    return min(up, key=lambda lane: (queued_bytes[lane], lane))
