"""What a replica broadcasts over the mesh (the trainer socket's frames are
core.replica.trainersocket).

Mesh payload (version 1), carried as the payload of a mesh ``CHUNK``::

    off size field
      0    2 magic      b"CT"
      2    1 version    1
      3    1 kind       UPDATE 1 | PARAMS 2 | DONE 3 | JOIN 4 | GONE 5 | FINAL 6
      4    .  body      UPDATE, PARAMS, FINAL: one chunk (core.codec.chunk, signed
                        by its origin)
                        DONE: run_id (16) + last step (u64 LE) + update
                        chunks sent in all (u64 LE)
                        JOIN, GONE: run_id (16) [+ JOIN: the sender's
                        current step (u64 LE) and flags (u8; 1: answer
                        with your JOIN): a replica that joins mid-run
                        asks where the others are, and says where it is]

``UPDATE`` is one chunk of a step's compressed update; ``PARAMS`` one chunk of a
replica's parameters (dense, for the consensus mix); ``DONE`` says the origin took its
last step, so that nobody waits for it any more; ``JOIN`` says a trainer of the run is
attached to the origin (the replicas of a run are the members that sent it, not every
member of the mesh); ``GONE``, sent by a daemon whose trainer went away without
``DONE``, says it no longer is. ``FINAL`` is one chunk of a replica's whole
parameters, sent once at the end of its run (dense, fp16 by default: the last round,
core.replica.final).
"""

from __future__ import annotations

import enum
import hashlib
import struct
from dataclasses import dataclass

from ciuic_p2p.core.codec.chunk import MAX_CHUNK_BYTES, RUN_ID_LEN
from ciuic_p2p.errors import CiuicError

MAGIC = b"CT"
VERSION = 1
ENVELOPE_LEN = 4
MAX_PAYLOAD_BYTES = ENVELOPE_LEN + MAX_CHUNK_BYTES
_DONE = struct.Struct(f"<{RUN_ID_LEN}sQQ")
_STEP_FLAGS = struct.Struct("<QB")
_LAYOUT = struct.Struct("<QIQ")
MAX_STEP = 1 << 40
"""A step a replica may claim (a trillion steps: no run has that many)."""
MAX_PRESENCE_BODY = 256
"""A JOIN body: run_id, step and flags, the layout (appended later); fields appended
by later versions are skipped, up to this size."""


@dataclass(frozen=True, slots=True)
class LayoutSummary:
    """The sender's parameter layout, as a JOIN states it (core.codec.layout)."""

    layout_id: int
    tensors: int
    params: int


@dataclass(frozen=True, slots=True)
class Presence:
    """A decoded JOIN or GONE."""

    run_id: bytes
    step: int
    """0 when not said."""
    ask: bool
    """Whether the sender asks for this replica's JOIN in answer."""
    layout: LayoutSummary | None
    """None from a sender that does not say it."""
    stateless: bool = False
    """The sender hands no state to joiners (a sharded replica, train.sharded): ask
    another replica for the run's state, and for samples of it."""


class TrainWireError(CiuicError):
    """A training message or trainer-socket frame that cannot be decoded."""


class PayloadKind(enum.IntEnum):
    UPDATE = 1
    PARAMS = 2
    DONE = 3
    JOIN = 4
    GONE = 5
    FINAL = 6


@dataclass(frozen=True, slots=True)
class TrainMessage:
    kind: PayloadKind
    body: memoryview


def envelope(kind: PayloadKind) -> bytes:
    """The 4 bytes that precede a body (sent as a separate buffer: no copy)."""
    return MAGIC + bytes((VERSION, kind))


def encode_done(run_id: bytes, step: int, chunks: int) -> bytes:
    if len(run_id) != RUN_ID_LEN or not 0 <= step < 1 << 64 or not 0 <= chunks < 1 << 64:
        raise ValueError("run_id is 16 bytes, step and chunks u64")
    return envelope(PayloadKind.DONE) + _DONE.pack(run_id, step, chunks)


def decode_done(body: memoryview) -> tuple[bytes, int, int]:
    """(run_id, last step, update chunks sent)."""
    if len(body) != _DONE.size:
        raise TrainWireError(f"DONE body of {len(body)} bytes, expected {_DONE.size}")
    run_id, step, chunks = _DONE.unpack(body)
    if step > MAX_STEP:  # a daemon shows it as the trainer's last step
        raise TrainWireError(f"DONE step {step} exceeds {MAX_STEP}")
    return bytes(run_id), int(step), int(chunks)


MAX_NODE_RANKS = 64
"""Ranks a node may shard its model over (a node of 8 GPUs has 8): the most sessions
its daemon takes for one trainer (daemon.rankwriters), and what a receiver allows a
sharded sender's short copy chunks, one per piece of each of its ranks."""


def run_id_of(run: str) -> bytes:
    """The 16-byte run ID every chunk of a run carries (two runs never mix)."""
    return hashlib.blake2b(run.encode(), digest_size=16).digest()


def encode_presence(
    kind: PayloadKind,
    run_id: bytes,
    step: int | None = None,
    ask: bool = False,
    layout: LayoutSummary | None = None,
    stateless: bool = False,
) -> bytes:
    """A JOIN (with the sender's step; ``ask``: answer with yours; its ``layout``;
    ``stateless``: it hands no state, flag bit 1, which older readers ignore) or GONE
    message."""
    if kind not in (PayloadKind.JOIN, PayloadKind.GONE) or len(run_id) != RUN_ID_LEN:
        raise ValueError("JOIN or GONE, with a 16-byte run_id")
    if kind is PayloadKind.GONE or step is None:
        return envelope(kind) + run_id
    if not 0 <= step <= MAX_STEP:
        raise ValueError(f"step must be in [0, {MAX_STEP}], got {step}")
    tail = _STEP_FLAGS.pack(step, int(ask) | (2 if stateless else 0))
    if layout is not None:
        tail += _LAYOUT.pack(layout.layout_id, layout.tensors, layout.params)
    return envelope(kind) + run_id + tail


def decode_presence(body: memoryview) -> Presence:
    """A JOIN or GONE body; TrainWireError for one that is cut or too long."""
    n = len(body)
    with_step = RUN_ID_LEN + _STEP_FLAGS.size
    with_layout = with_step + _LAYOUT.size
    if n > MAX_PRESENCE_BODY or (n not in (RUN_ID_LEN, with_step) and n < with_layout):
        raise TrainWireError(f"JOIN/GONE body of {n} bytes")
    run_id = bytes(body[:RUN_ID_LEN])
    if n == RUN_ID_LEN:
        return Presence(run_id, 0, False, None)
    step, flags = _STEP_FLAGS.unpack_from(body, RUN_ID_LEN)
    if step > MAX_STEP:
        raise TrainWireError(f"JOIN step {step} exceeds {MAX_STEP}")
    layout = None
    if n >= with_layout:
        layout = LayoutSummary(*_LAYOUT.unpack_from(body, with_step))
    return Presence(run_id, int(step), bool(flags & 1), layout, bool(flags & 2))


def decode_payload(data: bytes | bytearray | memoryview) -> TrainMessage:
    view = memoryview(data)
    if len(view) < ENVELOPE_LEN:
        raise TrainWireError(f"training message of {len(view)} bytes is truncated")
    if len(view) > MAX_PAYLOAD_BYTES:
        raise TrainWireError(f"training message of {len(view)} bytes exceeds the limit")
    if bytes(view[:2]) != MAGIC:
        raise TrainWireError("not a training message (bad magic)")
    if view[2] != VERSION:
        raise TrainWireError(f"training message version {view[2]} is not supported")
    try:
        kind = PayloadKind(view[3])
    except ValueError:
        raise TrainWireError(f"unknown training message kind {view[3]}") from None
    return TrainMessage(kind, view[ENVELOPE_LEN:])


# -- trainer socket frames ------------------------------------------------------------
