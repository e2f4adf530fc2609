from __future__ import annotations

import random

import pytest

from ciuic_p2p.core.codec.chunk import MAX_CHUNK_BYTES
from ciuic_p2p.core.link.frames import (
    CONTROL_FRAME_COST,
    CreditReceiver,
    CreditSender,
    FlowControlError,
    Frame,
    FrameReader,
    FrameType,
    FramingError,
    ReceiveQuota,
    bulk_cost,
    encode_frame,
)


def test_frames_survive_any_split_of_the_stream() -> None:
    frames = [
        Frame(t, bytes([i]) * (i * 37 % 60))
        for i, t in enumerate(FrameType)
        if t != FrameType.CREDIT
    ]
    frames.append(Frame(FrameType.CREDIT, b"\x01" * 8))
    stream = b"".join(encode_frame(f.type, f.payload) for f in frames)
    rng = random.Random(1)
    for _ in range(50):
        reader, out, pos = FrameReader(), [], 0
        while pos < len(stream):
            step = rng.randint(1, 40)
            out += reader.feed(stream[pos : pos + step])
            pos += step
        reader.end_of_stream()
        assert out == frames


@pytest.mark.parametrize(
    "data",
    [
        bytes([99, 0, 0, 0, 0]),  # unknown type
        bytes([FrameType.PING]) + (65).to_bytes(4, "little"),  # over its limit
        bytes([FrameType.CHUNK]) + (MAX_CHUNK_BYTES + 1).to_bytes(4, "little"),
    ],
)
def test_bad_frames_are_framing_errors(data: bytes) -> None:
    with pytest.raises(FramingError):
        FrameReader().feed(data)


def test_truncated_stream_is_an_error_and_buffer_is_bounded() -> None:
    reader = FrameReader()
    reader.feed(encode_frame(FrameType.GOSSIP, b"x" * 1000)[:500])
    assert reader.buffered == 500
    with pytest.raises(FramingError, match="inside a frame"):
        reader.end_of_stream()
    with pytest.raises(FramingError):
        encode_frame(FrameType.PING, b"x" * 65)


def test_credit_bounds_what_a_sender_may_have_in_flight() -> None:
    window = 2 * MAX_CHUNK_BYTES
    receiver, sender = CreditReceiver(window), CreditSender(window)
    cost = bulk_cost(FrameType.CHUNK, 500_000)
    sent = 0
    while sender.try_spend(cost):
        receiver.received(cost)
        sent += 1
    assert sent == window // cost and receiver.unconsumed <= window
    grants = [receiver.consumed(cost) for _ in range(sent)]
    total = sum(grants)
    assert total > 0 and receiver.unconsumed == 0
    sender.grant(total)
    assert sender.try_spend(cost)
    assert bulk_cost(FrameType.PING, 10) == 0


def test_sender_exceeding_its_credit_is_caught() -> None:
    receiver = CreditReceiver(2 * MAX_CHUNK_BYTES)
    receiver.received(2 * MAX_CHUNK_BYTES)
    with pytest.raises(FlowControlError):
        receiver.received(1)


def test_receive_quota_bounds_unread_control_bytes_and_frees_them_when_read() -> None:
    quota = ReceiveQuota(2 * MAX_CHUNK_BYTES, control_quota=1000)
    quota.received(FrameType.GOSSIP, 600)
    with pytest.raises(FlowControlError, match="quota"):
        quota.received(FrameType.GOSSIP, 600)
    assert quota.consumed(FrameType.GOSSIP, 600) == 0
    quota.received(FrameType.GOSSIP, 600)  # room again once the application read
    quota.received(FrameType.CHUNK, 1000)  # bulk bytes count against credit instead
    assert quota.credit.unconsumed == bulk_cost(FrameType.CHUNK, 1000)


def test_a_flood_of_empty_control_frames_meets_the_quota_too() -> None:
    quota = ReceiveQuota(2 * MAX_CHUNK_BYTES, control_quota=CONTROL_FRAME_COST * 100)
    for _ in range(100):
        quota.received(FrameType.GOSSIP, 0)
    with pytest.raises(FlowControlError, match="quota"):
        quota.received(FrameType.GOSSIP, 0)
    quota.consumed(FrameType.GOSSIP, 0)
    quota.received(FrameType.GOSSIP, 0)
