"""The input queue behind the frame readers: every split of a stream gives the same
bytes, and each byte is copied once."""

from __future__ import annotations

import random

import pytest

from ciuic_p2p.core.bytequeue import ByteQueue
from ciuic_p2p.core.link.frames import FrameReader, FrameType, encode_frame
from ciuic_p2p.core.replica.trainersocket import TrainerFrame, TrainerFrameReader, frame_header


@pytest.mark.parametrize("seed", range(5))
def test_any_split_of_a_stream_reads_back_the_same(seed: int) -> None:
    rng = random.Random(seed)
    stream = rng.randbytes(20_000)
    q = ByteQueue()
    at = 0
    while at < len(stream):
        n = rng.choice([1, 7, 100, 3000])
        q.append(stream[at : at + n])
        at += n
    out = bytearray()
    while len(q):
        n = min(len(q), rng.choice([0, 1, 5, 999, 4096]))
        assert q.peek(min(n, 3)) == stream[len(out) : len(out) + min(n, 3)]
        if rng.random() < 0.2:
            q.skip(n)
            out += stream[len(out) : len(out) + n]
        else:
            out += q.take(n)
    assert bytes(out) == stream
    with pytest.raises(ValueError):
        q.take(1)


def test_a_piece_that_is_one_frame_is_not_copied_and_a_bytearray_is() -> None:
    q = ByteQueue()
    piece = bytes(1 << 20)
    q.append(piece)
    assert q.take(len(piece)) is piece
    owned = bytearray(b"abc")
    q.append(owned)
    owned[0] = ord("z")  # the owner reuses its buffer: what was queued stays
    assert q.take(3) == b"abc"


def test_frames_split_anywhere_come_out_whole() -> None:
    rng = random.Random(3)
    payloads = [rng.randbytes(rng.choice([0, 10, 70_000])) for _ in range(30)]
    stream = b"".join(encode_frame(FrameType.MESH_CHUNK, p) for p in payloads)
    reader = FrameReader()
    frames = []
    at = 0
    while at < len(stream):
        n = rng.randint(1, 5000)
        frames += reader.feed(memoryview(stream)[at : at + n])
        at += n
    assert [f.payload for f in frames] == payloads
    assert reader.buffered == 0
    reader.end_of_stream()

    bodies = [rng.randbytes(rng.choice([0, 3, 50_000])) for _ in range(20)]
    raw = b"".join(frame_header(TrainerFrame.PUBLISH, len(b)) + b for b in bodies)
    trainer = TrainerFrameReader()
    got = []
    for at in range(0, len(raw), 777):
        got += [bytes(body) for _, body in trainer.feed(raw[at : at + 777])]
    assert got == bodies


def test_a_frame_sent_a_byte_at_a_time_costs_its_size_not_an_object_per_byte() -> None:
    """A peer may send a 1 MiB frame as 1-2 byte stream frames: kept one object per
    piece, that held 20 times the frame's size while it was incomplete (and 200 times
    while taken). Small pieces are gathered into buffers of 64 KiB."""
    q = ByteQueue()
    frame = bytes(range(256)) * 4096
    for at in range(0, len(frame), 2):
        q.append(frame[at : at + 2])
    assert len(q._pieces) <= len(frame) // (64 * 1024) + 1
    assert q.take(len(frame)) == frame
