"""The same behaviour on the QUIC transport and the in-memory one: the layers above
can run on either without knowing which."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest

from ciuic_p2p.admission import ClusterCA, Trust
from ciuic_p2p.core.link.frames import FrameType
from ciuic_p2p.identity import NodeKey
from ciuic_p2p.transport.base import FrameReceived, PeerDisconnected, Transport
from ciuic_p2p.transport.memory import MemoryNetwork, MemoryTransport
from ciuic_p2p.transport.quic import QuicTransport, TransportError
from tests.transport.conftest import FAST, NOW, Cluster
from tests.transport.test_quic import next_of

pytestmark = pytest.mark.network

Factory = Callable[[Trust | None, ClusterCA | None], Awaitable[Transport]]


@pytest.fixture(params=["quic", "memory"])
async def factory(request: pytest.FixtureRequest, cluster: Cluster):  # type: ignore[no-untyped-def]
    network = MemoryNetwork()
    made: list[Transport] = []

    async def make(trust: Trust | None = None, issuer: ClusterCA | None = None) -> Transport:
        key = NodeKey.generate()
        cert = (issuer or cluster.ca).issue(key.public_key, NOW)
        node: Transport
        if request.param == "quic":
            node = QuicTransport(key, cert, trust or cluster.trust, settings=FAST)
        else:
            node = MemoryTransport(network, key, cert, trust or cluster.trust, FAST)
        await node.start()
        made.append(node)
        return node

    yield make
    for node in made:
        await node.close()


def address(node: Transport) -> tuple[str, int]:
    return (node.host, node.port) if isinstance(node, QuicTransport) else node.address  # type: ignore[attr-defined]


async def test_frames_flow_and_close_is_reported(factory: Factory) -> None:
    a, b = await factory(None, None), await factory(None, None)
    assert await a.connect(address(b)) == b.local_key
    await a.send(b.local_key, FrameType.CHUNK, b"c" * 100_000)
    got = await next_of(b, FrameReceived)  # type: ignore[arg-type]
    assert isinstance(got, FrameReceived) and got.payload == b"c" * 100_000
    await b.disconnect(a.local_key, "bye")
    gone = await next_of(a, PeerDisconnected)  # type: ignore[arg-type]
    assert isinstance(gone, PeerDisconnected) and "bye" in gone.reason


async def test_foreign_node_is_refused(factory: Factory) -> None:
    server = await factory(None, None)
    stranger = await factory(None, ClusterCA.create("elsewhere", NOW))
    with pytest.raises(TransportError, match="refused"):
        await stranger.connect(address(server))
    assert not server.peers()


async def test_slow_reader_is_dropped(factory: Factory) -> None:
    a, b = await factory(None, None), await factory(None, None)
    await a.connect(address(b))
    with pytest.raises(TransportError, match="stopped reading"):
        for _ in range(20):
            await a.send(b.local_key, FrameType.CHUNK, b"s" * 1_000_000)
            stats = a.link_stats(b.local_key)
            assert stats is not None and stats.bulk_buffered_bytes <= FAST.receive_window_bytes
    assert b.local_key not in a.peers()
