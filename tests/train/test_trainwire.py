from __future__ import annotations

import contextlib
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ciuic_p2p.core.replica.messages import (
    MAX_PRESENCE_BODY,
    MAX_STEP,
    LayoutSummary,
    PayloadKind,
    TrainWireError,
    decode_done,
    decode_payload,
    decode_presence,
    encode_done,
    encode_presence,
    envelope,
)
from ciuic_p2p.core.replica.trainersocket import (
    MAX_FRAME_BYTES,
    TrainerFrame,
    TrainerFrameReader,
    frame_header,
    json_frame,
    parse_json,
    peer_prefix,
    split_peer,
)


def test_done_round_trips_and_messages_keep_their_kind() -> None:
    msg = decode_payload(encode_done(b"r" * 16, 42, 7))
    assert msg.kind is PayloadKind.DONE
    assert decode_done(msg.body) == (b"r" * 16, 42, 7)
    past = decode_payload(encode_done(b"r" * 16, MAX_STEP + 1, 7))
    with pytest.raises(TrainWireError, match="exceeds"):
        decode_done(past.body)
    update = decode_payload(envelope(PayloadKind.UPDATE) + b"chunk")
    assert update.kind is PayloadKind.UPDATE and bytes(update.body) == b"chunk"


def test_a_join_states_its_layout_and_older_or_newer_joins_still_decode() -> None:
    run = b"r" * 16
    layout = LayoutSummary(0xFEEDFACE, 12, 85_002)
    said = decode_presence(
        decode_payload(encode_presence(PayloadKind.JOIN, run, 7, True, layout)).body
    )
    assert (said.run_id, said.step, said.ask, said.layout) == (run, 7, True, layout)
    older = decode_presence(decode_payload(encode_presence(PayloadKind.JOIN, run, 7)).body)
    assert older.layout is None and older.step == 7
    body = decode_payload(encode_presence(PayloadKind.JOIN, run, 7, False, layout)).body
    newer = decode_presence(memoryview(bytes(body) + b"future field"))  # appended later
    assert newer.layout == layout
    for cut in (17, len(body) - 1):
        with pytest.raises(TrainWireError, match="JOIN/GONE body"):
            decode_presence(body[:cut])
    with pytest.raises(TrainWireError, match="JOIN/GONE body"):
        decode_presence(memoryview(bytes(body) + bytes(MAX_PRESENCE_BODY)))
    # A step no run reaches is refused: a joiner would start from it.
    huge = bytearray(body)
    huge[16:24] = (MAX_STEP + 1).to_bytes(8, "little")
    with pytest.raises(TrainWireError, match="exceeds"):
        decode_presence(memoryview(bytes(huge)))
    with pytest.raises(ValueError):
        encode_presence(PayloadKind.JOIN, run, MAX_STEP + 1)
    # A sharded replica says it hands no state (flag bit 1); the ask bit stays apart.
    both = encode_presence(PayloadKind.JOIN, run, 7, True, layout, stateless=True)
    said = decode_presence(decode_payload(both).body)
    assert said.stateless and said.ask and said.layout == layout
    assert not decode_presence(
        decode_payload(encode_presence(PayloadKind.JOIN, run, 7)).body
    ).stateless


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
        decode_payload(data)


def test_frames_split_across_reads_and_peers_round_trip() -> None:
    body = peer_prefix("ciuicabc") + b"payload"
    stream = (
        json_frame(TrainerFrame.HELLO, {"run": "x"})
        + frame_header(TrainerFrame.DELIVER, len(body))
        + body
    )
    reader = TrainerFrameReader()
    frames = [f for i in range(len(stream)) for f in reader.feed(stream[i : i + 1])]
    assert [t for t, _ in frames] == [TrainerFrame.HELLO, TrainerFrame.DELIVER]
    assert parse_json(frames[0][1]) == {"run": "x"}
    peer, payload = split_peer(frames[1][1])
    assert (peer, bytes(payload)) == ("ciuicabc", b"payload")


def test_an_oversize_length_is_refused_before_the_body_arrives() -> None:
    with pytest.raises(TrainWireError, match="length"):
        TrainerFrameReader().feed(struct.pack("<IB", MAX_FRAME_BYTES + 1, 4))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_any_bytes_decode_or_fail_typed(data: bytes) -> None:
    for decode in (decode_payload, lambda d: TrainerFrameReader().feed(d)):
        with contextlib.suppress(TrainWireError):
            decode(data)
    for body_decoder in (split_peer, parse_json, decode_done, decode_presence):
        with contextlib.suppress(TrainWireError):
            body_decoder(memoryview(data))
