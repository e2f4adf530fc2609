"""Mesh messages: every kind round-trips; no byte sequence does anything but decode or
raise MeshDecodeError."""

from __future__ import annotations

import contextlib
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ciuic_p2p.core.meshwire import (
    MAX_ID_BYTES,
    Ack,
    Alive,
    Chunk,
    Coordinate,
    Dead,
    Gossip,
    Heads,
    Left,
    LinkEntry,
    Links,
    MeshDecodeError,
    Message,
    Nack,
    Ping,
    PingReq,
    Suspect,
    Sync,
    Want,
    decode_message,
    encode_message,
)

ids = st.text(min_size=1, max_size=30)
u64 = st.integers(0, 2**64 - 1)
u32 = st.integers(0, 2**32 - 1)
coords = st.builds(
    Coordinate,
    st.tuples(*[st.floats(-1e3, 1e3, width=32)] * 8),
    st.floats(0, 1e3, width=32),
    st.floats(0, 1.5, width=32),
)
updates = st.one_of(
    st.builds(Alive, ids, u64, ids, ids),
    st.builds(Suspect, ids, u64, ids),
    st.builds(Dead, ids, u64, ids),
    st.builds(Left, ids, u64),
    st.builds(
        Links,
        ids,
        u32,
        st.lists(st.builds(LinkEntry, ids, u32, st.integers(0, 1000)), max_size=5).map(tuple),
    ),
)
ups = st.lists(updates, max_size=6).map(tuple)
bodies = st.one_of(
    st.builds(Ping, u32, ids, coords, u32, ups),
    st.builds(Ack, u32, coords, u32, ups),
    st.builds(PingReq, u32, ids, ids),
    st.builds(Nack, u32),
    st.builds(Gossip, ups),
    st.builds(Sync, st.booleans(), ups),
    st.builds(Chunk, ids, u64, st.integers(0, 255), st.binary(max_size=300)),
    st.builds(Heads, st.lists(st.tuples(ids, u64), max_size=5).map(tuple)),
    st.builds(Want, ids, st.lists(u64, max_size=5).map(tuple)),
)


@given(ids, bodies)
def test_every_message_round_trips(sender: str, body: object) -> None:
    msg = Message(sender, body)  # type: ignore[arg-type]
    assert decode_message(encode_message(msg)) == msg


@given(ids, bodies, st.data())
def test_every_truncation_and_extension_is_a_typed_error(
    sender: str, body: object, data: st.DataObject
) -> None:
    raw = encode_message(Message(sender, body))  # type: ignore[arg-type]
    cut = data.draw(st.integers(0, len(raw) - 1))
    with pytest.raises(MeshDecodeError):
        decode_message(raw[:cut])
    with pytest.raises(MeshDecodeError):
        decode_message(raw + b"\x00")


def test_random_bytes_and_mutations_only_raise_typed_errors() -> None:
    rng = random.Random(7)
    samples = [
        encode_message(Message("a", Ping(1, "b", Coordinate(), 7, (Alive("c", 2, "h:1"),)))),
        encode_message(Message("a", Sync(True, (Links("a", 3, (LinkEntry("b", 5000, 1),)),)))),
        encode_message(Message("a", Chunk("o", 9, 1, b"x" * 50))),
    ]
    for i in range(20_000):
        if i % 2:
            data = bytes(rng.randrange(256) for _ in range(rng.randrange(64)))
        else:
            mutated = bytearray(rng.choice(samples))
            for _ in range(rng.randrange(1, 4)):
                mutated[rng.randrange(len(mutated))] = rng.randrange(256)
            data = bytes(mutated)
        with contextlib.suppress(MeshDecodeError):
            decode_message(data)


def test_limits_are_enforced_both_ways() -> None:
    with pytest.raises(ValueError):
        encode_message(Message("x" * (MAX_ID_BYTES + 1), Nack(1)))
    huge = Message("a", Gossip(tuple(Alive("n" * 100, 1, "a" * 100) for _ in range(400))))
    with pytest.raises(ValueError):
        encode_message(huge)
    # A length field claiming more than is there is refused before any allocation.
    forged = (
        bytes([1, 7, 1, 97, 1, 111])
        + (5).to_bytes(8, "little")
        + bytes([0])
        + (2**31).to_bytes(4, "little")
    )
    with pytest.raises(MeshDecodeError, match=r"exceeds|truncated"):
        decode_message(forged)
    bad_coord = bytearray(encode_message(Message("a", Ack(1, Coordinate()))))
    bad_coord[8:12] = b"\x00\x00\xc0\x7f"  # NaN in the first component
    with pytest.raises(MeshDecodeError, match=r"coordinate"):
        decode_message(bytes(bad_coord))
