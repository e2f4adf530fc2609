"""A paced link (core.link.pacer through QuicTransport.pace) sends its bulk bytes no
faster than its rate, its control frames at once, and all of them once the pace is
lifted."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from ciuic_p2p.config.sections import MAX_CHUNK_PAYLOAD_BYTES
from ciuic_p2p.core.link.frames import FrameType
from ciuic_p2p.core.link.pacer import MIN_BURST_BYTES
from ciuic_p2p.transport.base import FrameReceived, PeerConnected
from tests.conftest import eventually
from tests.transport.conftest import FAST, NodeFactory
from tests.transport.test_quic import next_of

pytestmark = pytest.mark.network


async def test_bulk_goes_at_the_pace_and_control_passes_it(make_node: NodeFactory) -> None:
    a, b = await make_node(), await make_node()
    await a.connect((b.host, b.port), expected_peer=b.local_key)
    await next_of(b, PeerConnected)
    rate_bps, size = 4e6, 300_000
    a.pace(b.local_key, rate_bps)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await a.send(b.local_key, FrameType.CHUNK, b"c" * size)
    assert a.unacked_bytes() > size // 2  # held by the pacer, counted for a leave
    await a.send(b.local_key, FrameType.GOSSIP, b"news")
    first = await next_of(b, FrameReceived)
    assert isinstance(first, FrameReceived) and first.type is FrameType.GOSSIP
    chunk = await next_of(b, FrameReceived, timeout=10.0)
    took_s = loop.time() - t0
    assert isinstance(chunk, FrameReceived) and chunk.payload == b"c" * size
    least_s = (size - MIN_BURST_BYTES) * 8 / rate_bps  # what the pace allows, at most
    assert took_s >= 0.9 * least_s
    await eventually(lambda: a.unacked_bytes() == 0)


async def test_lifting_the_pace_releases_what_waits(make_node: NodeFactory) -> None:
    a, b = await make_node(), await make_node()
    await a.connect((b.host, b.port), expected_peer=b.local_key)
    await next_of(b, PeerConnected)
    a.pace(b.local_key, 1e6)  # 1 MB would take 8 s
    payload = bytes(range(256)) * (1_000_000 // 256)
    await a.send(b.local_key, FrameType.CHUNK, payload)
    await asyncio.sleep(0)  # the pacer holds it: nothing on time
    a.pace(b.local_key, None)
    got = await next_of(b, FrameReceived, timeout=5.0)
    assert isinstance(got, FrameReceived) and got.payload == payload


async def test_pacing_an_unknown_peer_is_no_fault(make_node: NodeFactory) -> None:
    a = await make_node()
    a.pace(b"\x01" * 32, 5e6)
    a.pace(b"\x01" * 32, None)
    assert a.unacked_bytes() == 0


async def test_a_sender_its_own_pace_holds_back_is_not_a_stalled_peer(
    make_node: NodeFactory,
) -> None:
    """Credit comes back only for bytes the peer received; while this node's pacer
    still holds them, waiting for credit past ``stall_timeout_s`` (0.5 s here, against
    about 1.1 s of pace per half window) is not the peer's fault."""
    window = MAX_CHUNK_PAYLOAD_BYTES + 128 * 1024
    small = dataclasses.replace(
        FAST, stall_timeout_s=0.5, receive_window_bytes=window, receive_window_max_bytes=window
    )
    a, b = await make_node(settings=small), await make_node(settings=small)
    await a.connect((b.host, b.port), expected_peer=b.local_key)
    await next_of(b, PeerConnected)
    a.pace(b.local_key, 4e6)
    chunks = [bytes([i]) * 700_000 for i in range(3)]

    async def read() -> list[bytes]:
        got = [await next_of(b, FrameReceived, timeout=10.0) for _ in chunks]
        return [g.payload for g in got if isinstance(g, FrameReceived)]

    reader = asyncio.create_task(read())  # b reads as they come: credit goes back
    for chunk in chunks:  # each after the one before has been credited back
        await a.send(b.local_key, FrameType.CHUNK, chunk)
    assert await reader == chunks
    assert a.peers() == [b.local_key]
