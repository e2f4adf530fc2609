from __future__ import annotations

import contextlib
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ciuic_p2p.core.trainwire import (
    MAX_FRAME_BYTES,
    FrameReader,
    FrameType,
    Kind,
    TrainWireError,
    decode_done,
    decode_message,
    encode_done,
    envelope,
    frame_header,
    json_frame,
    parse_json,
    peer_prefix,
    split_peer,
)


def test_done_round_trips_and_messages_keep_their_kind() -> None:
    msg = decode_message(encode_done(b"r" * 16, 42, 7))
    assert msg.kind is Kind.DONE
    assert decode_done(msg.body) == (b"r" * 16, 42, 7)
    update = decode_message(envelope(Kind.UPDATE) + b"chunk")
    assert update.kind is Kind.UPDATE and bytes(update.body) == b"chunk"


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"", "truncated"),
        (b"XX\x01\x01", "magic"),
        (b"CT\x02\x01", "version"),
        (b"CT\x01\x09", "kind"),
    ],
)
def test_bad_messages_get_typed_errors(data: bytes, why: str) -> None:
    with pytest.raises(TrainWireError, match=why):
        decode_message(data)


def test_frames_split_across_reads_and_peers_round_trip() -> None:
    body = peer_prefix("ciuicabc") + b"payload"
    stream = (
        json_frame(FrameType.HELLO, {"run": "x"})
        + frame_header(FrameType.DELIVER, len(body))
        + body
    )
    reader = FrameReader()
    frames = [f for i in range(len(stream)) for f in reader.feed(stream[i : i + 1])]
    assert [t for t, _ in frames] == [FrameType.HELLO, FrameType.DELIVER]
    assert parse_json(frames[0][1]) == {"run": "x"}
    peer, payload = split_peer(frames[1][1])
    assert (peer, bytes(payload)) == ("ciuicabc", b"payload")


def test_an_oversize_length_is_refused_before_the_body_arrives() -> None:
    with pytest.raises(TrainWireError, match="length"):
        FrameReader().feed(struct.pack("<IB", MAX_FRAME_BYTES + 1, 4))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_any_bytes_decode_or_fail_typed(data: bytes) -> None:
    for decode in (decode_message, lambda d: FrameReader().feed(d)):
        with contextlib.suppress(TrainWireError):
            decode(data)
    for body_decoder in (split_peer, parse_json, decode_done):
        with contextlib.suppress(TrainWireError):
            body_decoder(memoryview(data))
