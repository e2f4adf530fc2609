"""A destination's outbox: a chunk is queued once, pieces alternate with messages."""

from __future__ import annotations

import asyncio
import datetime as dt
from pathlib import Path

from ciuic_p2p.admission import ClusterCA, Trust
from ciuic_p2p.config import Config
from ciuic_p2p.core.link.frames import FrameType
from ciuic_p2p.daemon.node import MeshDaemon, _Destination
from ciuic_p2p.daemon.outbox import MAX_HANDED, MAX_OUTBOX, Outbox
from ciuic_p2p.identity import NodeKey
from ciuic_p2p.transport.base import Address, PeerConnected, PeerDisconnected
from ciuic_p2p.transport.memory import MemoryNetwork, MemoryTransport

UTC = dt.datetime(2026, 12, 4, tzinfo=dt.UTC)


def test_a_chunk_still_queued_is_not_queued_again() -> None:
    box = Outbox()
    assert box.push(FrameType.MESH_CHUNK, b"a" * 100, ("o", 1))
    assert box.push(FrameType.MESH_CHUNK, b"b" * 100, ("o", 2))
    assert not box.push(FrameType.MESH_CHUNK, b"a" * 100, ("o", 1))  # a repair of a queued one
    assert box.already_queued == 1 and box.queued_bytes == 200
    assert box.take() == (FrameType.MESH_CHUNK, b"a" * 100, ("o", 1))
    # Once handed to the transport, a later repair is queued again.
    assert box.push(FrameType.MESH_CHUNK, b"a" * 100, ("o", 1))
    assert [box.take()[1][:1] for _ in range(2)] == [b"b", b"a"]
    assert not box and box.queued_bytes == 0 and not box.chunks


def test_pieces_alternate_with_messages_and_overflow_drops_the_oldest() -> None:
    box = Outbox()
    for i in range(3):
        box.push(FrameType.STORE_DATA, bytes([i]))
    for i in range(MAX_OUTBOX + 2):
        box.push(FrameType.MESH_CHUNK, b"c", ("o", i))
    assert box.dropped == 2 and ("o", 0) not in box.chunks and ("o", 2) in box.chunks
    kinds = [box.take()[0] for _ in range(6)]
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


def test_the_chunks_remembered_as_handed_are_bounded_and_forgotten_when_due() -> None:
    box = Outbox(in_flight_s=1e9)
    for i in range(MAX_HANDED + 5):
        box.handed_to_link(("o", i), now=float(i))
    assert len(box.handed) == MAX_HANDED and ("o", 0) not in box.handed
    due = Outbox(in_flight_s=10.0)
    for i in range(30):
        due.handed_to_link(("o", i), now=float(i))
    assert len(due.handed) == 10 and ("o", 19) not in due.handed
    # Without an in-flight time (lanes: their losses are not heard of) nothing is kept.
    none = Outbox(in_flight_s=0.0)
    none.handed_to_link(("o", 1), now=0.0)
    assert not none.handed and none.push(FrameType.MESH_CHUNK, b"a", ("o", 1), now=0.0)


def _daemon(tmp_path: Path, transport_type: type[MemoryTransport]) -> MeshDaemon:
    """A daemon over an in-memory transport of ``transport_type``, not started."""
    ca = ClusterCA.create("outbox", UTC)
    key = NodeKey.generate()
    transport = transport_type(
        MemoryNetwork(),
        key,
        ca.issue(key.public_key, UTC),
        Trust(ca.certificate),
        Config().transport,
        wallclock=lambda: UTC,
    )
    return MeshDaemon(Config(), key, transport, state_dir=tmp_path)


def test_the_daemon_forgets_what_a_lost_or_replaced_link_carried(tmp_path: Path) -> None:
    """The outboxes are keyed by address and a peer may be known at two (the one it
    advertises, the one it dialled from); a link may also be replaced by a newer one
    with no PeerDisconnected (a restarted peer re-dialling). Either way every outbox
    that sends to that peer stops counting its handed chunks as on their way."""
    daemon = _daemon(tmp_path, MemoryTransport)
    peer = NodeKey.generate().public_key
    advertised, dialled_from = "peer.example:7946", "10.0.0.7:50000"
    boxes = []
    for address in (advertised, dialled_from):
        box = Outbox(in_flight_s=10.0)
        daemon._outboxes[(address, 1)] = _Destination(box)
        boxes.append(box)
    daemon._learn_peer(peer, advertised)
    daemon._learn_peer(peer, dialled_from)  # its later inbound link
    for event in (
        PeerDisconnected(peer, "idle"),
        PeerConnected(peer, ("10.0.0.7", 50001), dialed=False),
    ):
        for box in boxes:
            box.handed_to_link(("o", 1), now=0.0)
        daemon._on_event(event)
        assert all(box.push(FrameType.MESH_CHUNK, b"x", ("o", 1), now=1.0) for box in boxes)
        for box in boxes:
            box.take()


class _HangingDials(MemoryTransport):
    """A transport whose dials never finish (a peer that never answers the handshake
    within the test)."""

    async def connect(self, address: Address, expected_peer: bytes | None = None) -> bytes:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


async def test_closing_the_daemon_ends_the_dials_its_senders_were_waiting_on(
    tmp_path: Path,
) -> None:
    """A dial is shared by every sender waiting for its address and shielded from
    their cancellation: a close that ended only the senders left it pending, and the
    loop's end destroyed it ("Task was destroyed but it is pending!" at `leave`)."""
    daemon = _daemon(tmp_path, _HangingDials)
    daemon._enqueue("127.0.0.1:9", FrameType.GOSSIP, b"x")
    for _ in range(100):  # the sender task starts and dials
        if daemon._dialing:
            break
        await asyncio.sleep(0)
    dials = list(daemon._dialing.values())
    assert dials and not any(d.done() for d in dials)
    await daemon.close()
    assert all(d.done() for d in dials)
