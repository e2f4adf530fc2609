"""A destination's outbox: a chunk is queued once, pieces alternate with messages."""

from __future__ import annotations

from ciuic_p2p.core.link.frames import FrameType
from ciuic_p2p.daemon.outbox import MAX_OUTBOX, Outbox


def test_a_chunk_still_queued_is_not_queued_again() -> None:
    box = Outbox()
    assert box.push(FrameType.MESH_CHUNK, b"a" * 100, ("o", 1))
    assert box.push(FrameType.MESH_CHUNK, b"b" * 100, ("o", 2))
    assert not box.push(FrameType.MESH_CHUNK, b"a" * 100, ("o", 1))  # a repair of a queued one
    assert box.already_queued == 1 and box.queued_bytes == 200
    assert box.pop() == (FrameType.MESH_CHUNK, b"a" * 100)
    # Once handed to the transport, a later repair is queued again.
    assert box.push(FrameType.MESH_CHUNK, b"a" * 100, ("o", 1))
    assert [box.pop()[1][:1] for _ in range(2)] == [b"b", b"a"]
    assert not box and box.queued_bytes == 0 and not box.chunks


def test_pieces_alternate_with_messages_and_overflow_drops_the_oldest() -> None:
    box = Outbox()
    for i in range(3):
        box.push(FrameType.STORE_DATA, bytes([i]))
    for i in range(MAX_OUTBOX + 2):
        box.push(FrameType.MESH_CHUNK, b"c", ("o", i))
    assert box.dropped == 2 and ("o", 0) not in box.chunks and ("o", 2) in box.chunks
    kinds = [box.pop()[0] for _ in range(6)]
    assert kinds.count(FrameType.STORE_DATA) == 3 and kinds[0] is FrameType.STORE_DATA
    assert box.clear() == MAX_OUTBOX - 3 and not box and box.queued_bytes == 0
