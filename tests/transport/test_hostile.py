"""Bad bytes from authenticated peers, altered and replayed chunks, slow readers."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import tracemalloc

import pytest
import torch
from cryptography.hazmat.primitives import serialization

from ciuic_p2p.core.codec.bucket import BucketEncoder, BucketSpec, ChunkSource
from ciuic_p2p.core.codec.chunk import Codec
from ciuic_p2p.core.codec.origin import ChunkFilter, sign_chunk
from ciuic_p2p.core.link.auth import build_auth
from ciuic_p2p.core.link.frames import FRAME_HEADER, FrameType, encode_frame
from ciuic_p2p.transport.base import FrameReceived, PeerDisconnected
from ciuic_p2p.transport.quic import BULK_STREAM, CONTROL_STREAM, TransportError
from tests.transport.conftest import FAST, Cluster, NodeFactory
from tests.transport.rawclient import RawClient
from tests.transport.test_quic import next_of

pytestmark = pytest.mark.network


async def authenticated_raw(
    server: object, cluster: Cluster, max_stream_data: int | None = None
) -> RawClient:
    key, cert = cluster.node_credentials()
    address = (server.host, server.port)  # type: ignore[attr-defined]
    client = await RawClient.connect(address, max_stream_data=max_stream_data)
    der = cert.public_bytes(serialization.Encoding.DER)
    proof = build_auth(
        key,
        der,
        cluster.trust.cluster,
        server.local_key,  # type: ignore[attr-defined]
        client.server_cid(),
        client.quic.original_destination_connection_id,
    )
    client.send(CONTROL_STREAM, encode_frame(FrameType.AUTH, proof))
    return client


BAD_INPUTS = {
    "oversize": (CONTROL_STREAM, FRAME_HEADER.pack(FrameType.PING, 10_000)),
    "unknown_type": (CONTROL_STREAM, bytes([200, 1, 0, 0, 0, 0])),
    "chunk_on_control": (CONTROL_STREAM, encode_frame(FrameType.CHUNK, b"x")),
    "random": (CONTROL_STREAM, random.Random(3).randbytes(3000)),
    "over_credit": (BULK_STREAM, encode_frame(FrameType.CHUNK, b"x" * 1_000_000) * 6),
    "unknown_stream": (8, b"hello"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
async def test_bad_input_closes_that_peer_and_the_node_keeps_serving(
    make_node: NodeFactory, cluster: Cluster, case: str
) -> None:
    server = await make_node()
    good = await make_node()
    await good.connect((server.host, server.port))
    hostile = await authenticated_raw(server, cluster)
    stream, data = BAD_INPUTS[case]
    hostile.send(stream, data)
    reason = await hostile.wait_closed()
    assert reason
    await good.send(server.local_key, FrameType.GOSSIP, b"still there?")
    got = await next_of(server, FrameReceived, peer=good.local_key)
    assert isinstance(got, FrameReceived) and got.payload == b"still there?"
    hostile.close()


async def test_truncated_frame_at_end_of_stream_closes_the_peer(
    make_node: NodeFactory, cluster: Cluster
) -> None:
    server = await make_node()
    hostile = await authenticated_raw(server, cluster)
    hostile.quic.send_stream_data(
        CONTROL_STREAM, encode_frame(FrameType.GOSSIP, b"abc")[:5], end_stream=True
    )
    hostile.flush()
    assert "inside a frame" in await hostile.wait_closed()
    hostile.close()


def signed_chunks(key: object, n: int = 50_000) -> list[bytearray]:
    source = ChunkSource(b"r" * 16, key.public_key, 1, 7)  # type: ignore[attr-defined]
    spec = BucketSpec(codec=Codec.SPARSE_INT8, density=0.05)
    chunks = BucketEncoder(0, n, spec, source).encode(torch.randn(n), step=1)
    for c in chunks:
        sign_chunk(c, key)  # type: ignore[arg-type]
    return chunks


async def test_altered_or_replayed_chunk_through_a_relay_is_rejected_and_counted(
    make_node: NodeFactory, cluster: Cluster
) -> None:
    key, cert = cluster.node_credentials()
    origin = await make_node(credentials=(key, cert))
    relay, receiver = await make_node(), await make_node()
    await origin.connect((relay.host, relay.port))
    await relay.connect((receiver.host, receiver.port))
    chunk = bytes(signed_chunks(key)[0])
    await origin.send(relay.local_key, FrameType.CHUNK, chunk)
    at_relay = await next_of(relay, FrameReceived)
    assert isinstance(at_relay, FrameReceived)
    tampered = bytearray(at_relay.payload)
    tampered[-10] ^= 0x40
    for payload in (at_relay.payload, at_relay.payload, bytes(tampered)):  # forward, replay, alter
        await relay.send(receiver.local_key, FrameType.CHUNK, payload)
    inbox = ChunkFilter()
    for _ in range(3):
        got = await next_of(receiver, FrameReceived)
        assert isinstance(got, FrameReceived)
        inbox.admit(got.payload)
    assert (inbox.accepted, inbox.replayed, inbox.bad_signature + inbox.malformed) == (1, 1, 1)


async def test_peer_that_never_reads_is_dropped_with_bounded_sender_memory(
    make_node: NodeFactory,
) -> None:
    # The window stays at receive_window_bytes (path_rate_bps 0): a loaded loop's first
    # RTT samples would otherwise size it toward receive_window_max_bytes.
    fixed = dataclasses.replace(FAST, path_rate_bps=0.0)
    sender, sink = await make_node(settings=fixed), await make_node(settings=fixed)
    await sender.connect((sink.host, sink.port))
    # The sink's application never calls next_event() again: no credit comes back.
    payload = b"z" * 1_000_000
    tracemalloc.start()
    sent = 0
    with pytest.raises(TransportError, match="stopped reading"):
        for _ in range(50):  # bounded: 50 MB offered, far more than the 4 MiB window
            await sender.send(sink.local_key, FrameType.CHUNK, payload)
            sent += 1
            stats = sender.link_stats(sink.local_key)
            assert stats is not None
            assert stats.bulk_buffered_bytes <= sender.settings.receive_window_bytes
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert sent <= sender.settings.receive_window_bytes // len(payload)
    # What the sender held stays within a few windows (aioquic's buffers included),
    # nowhere near the 50 MB it was asked to send.
    assert peak < 4 * sender.settings.receive_window_bytes + 8_000_000
    assert sink.local_key not in sender.peers()
    assert isinstance(await next_of(sender, PeerDisconnected), PeerDisconnected)
    await asyncio.sleep(0)


async def test_peer_flooding_control_frames_is_dropped_at_the_quota(
    make_node: NodeFactory, cluster: Cluster
) -> None:
    server = await make_node()
    hostile = await authenticated_raw(server, cluster)
    gossip = encode_frame(FrameType.GOSSIP, b"g" * 60_000)
    for _ in range(40):  # 2.4 MB of control frames that the server's application never reads
        hostile.send(CONTROL_STREAM, gossip)
    assert "quota" in await hostile.wait_closed()
    hostile.close()
