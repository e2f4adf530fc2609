"""A destination's outbox: a chunk is queued once, pieces alternate with messages."""

from __future__ import annotations

from ciuic_p2p.core.link.frames import FrameType
from ciuic_p2p.daemon.outbox import MAX_HANDED, MAX_OUTBOX, Outbox


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


def test_a_chunk_on_its_way_over_the_link_is_not_sent_again_until_it_is_due_or_lost() -> None:
    """A repair asked of the member whose copy is still crossing the link (a reliable
    stream) would be a second full copy behind the first: half the duplicates of a
    2.1 MB round on the multi-cloud matrix were that. It is refused for
    ``in_flight_s`` after the copy left, and at once again after the link is lost."""
    box = Outbox(in_flight_s=10.0)
    assert box.push(FrameType.MESH_CHUNK, b"a" * 100, ("o", 1), now=0.0)
    ftype, data, chunk = box.take()
    assert (ftype, data, chunk) == (FrameType.MESH_CHUNK, b"a" * 100, ("o", 1))
    box.handed_to_link(("o", 1), now=1.0)
    assert not box.push(FrameType.MESH_CHUNK, b"a" * 100, ("o", 1), now=5.0)
    assert box.in_flight == 1 and box.already_queued == 0 and not box
    assert box.push(FrameType.MESH_CHUNK, b"b" * 100, ("o", 2), now=5.0)  # others go
    # Past in_flight_s the peer may have lost it after the link delivered it: sent again.
    assert box.push(FrameType.MESH_CHUNK, b"a" * 100, ("o", 1), now=11.0)
    assert [box.take()[2] for _ in range(2)] == [("o", 2), ("o", 1)]
    box.handed_to_link(("o", 1), now=12.0)
    box.link_lost()  # what was on the link may never arrive
    assert box.push(FrameType.MESH_CHUNK, b"a" * 100, ("o", 1), now=12.5)
    assert box.in_flight == 1
    # Store pieces and frames of no chunk are never held back.
    box.handed_to_link(("o", 9), now=13.0)
    assert box.push(FrameType.STORE_DATA, b"p", now=13.0)
    assert box.push(FrameType.GOSSIP, b"g", None, now=13.0)


def test_the_chunks_remembered_as_handed_are_bounded() -> None:
    box = Outbox()
    for i in range(MAX_HANDED + 5):
        box.handed_to_link(("o", i), now=float(i))
    assert len(box.handed) == MAX_HANDED and ("o", 0) not in box.handed
