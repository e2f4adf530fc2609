from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt

import pytest

from ciuic_p2p.admission import ClusterCA, Trust
from ciuic_p2p.config import TransportSection
from ciuic_p2p.core.link.frames import FrameType
from ciuic_p2p.identity import NodeKey
from ciuic_p2p.transport.base import FrameReceived, PeerConnected, PeerDisconnected, TransportEvent
from ciuic_p2p.transport.quic import QuicTransport, TransportError
from tests.conftest import eventually
from tests.transport.conftest import FAST, Cluster, NodeFactory

pytestmark = pytest.mark.network


async def next_of(
    node: QuicTransport, kind: type, timeout: float = 5.0, peer: bytes | None = None
) -> TransportEvent:
    async def wait() -> TransportEvent:
        while True:
            event = await node.next_event()
            if isinstance(event, kind) and (peer is None or getattr(event, "peer", None) == peer):
                return event

    return await asyncio.wait_for(wait(), timeout)


async def test_two_nodes_authenticate_and_exchange_every_frame_type(make_node: NodeFactory) -> None:
    a, b = await make_node(), await make_node()
    peer = await a.connect((b.host, b.port), expected_peer=b.local_key)
    assert peer == b.local_key
    connected = await next_of(b, PeerConnected)
    assert isinstance(connected, PeerConnected) and connected.peer == a.local_key
    assert not connected.dialed
    for ftype, payload in ((FrameType.GOSSIP, b"hello"), (FrameType.CHUNK, b"x" * 300_000)):
        await a.send(b.local_key, ftype, payload)
        got = await next_of(b, FrameReceived)
        assert isinstance(got, FrameReceived)
        assert (got.peer, got.type, got.payload) == (a.local_key, ftype, payload)
        await b.send(a.local_key, ftype, payload[::-1])
        back = await next_of(a, FrameReceived)
        assert isinstance(back, FrameReceived) and back.payload == payload[::-1]

    # PING/PONG and CREDIT are handled by the transport itself: RTT samples appear.
    def measured() -> bool:
        s = a.rtt(b.local_key)
        return s is not None and bool(s.samples) and s.quic_smoothed_s is not None

    await eventually(measured)
    stats = a.rtt(b.local_key)
    assert stats is not None and stats.ping_min_s is not None and 0 < stats.ping_min_s < 1
    # QUIC's own estimate: the minimum where the library shows it (qh3 2.x: none).
    assert (stats.quic_min_s is None) == a.backend.native_core
    assert a.peers() == [b.local_key] and b.peers() == [a.local_key]


async def test_the_accepting_side_may_send_bulk_first(make_node: NodeFactory) -> None:
    """Regression: both sides used the dialer's stream 4, which the accepting side
    cannot open; its first chunk failed until the dialer had sent one."""
    a, b = await make_node(), await make_node()
    await a.connect((b.host, b.port))
    await next_of(b, PeerConnected)
    await b.send(a.local_key, FrameType.CHUNK, b"first" * 1000)
    got = await next_of(a, FrameReceived)
    assert isinstance(got, FrameReceived) and got.payload == b"first" * 1000


async def test_three_nodes_form_links_pairwise(make_node: NodeFactory) -> None:
    nodes = [await make_node() for _ in range(3)]
    for i, j in ((0, 1), (1, 2), (0, 2)):
        await nodes[i].connect((nodes[j].host, nodes[j].port))
    for n in nodes:
        assert sorted(n.peers()) == sorted(m.local_key for m in nodes if m is not n)
    await nodes[2].send(nodes[0].local_key, FrameType.GOSSIP, b"from 2")
    got = await next_of(nodes[0], FrameReceived)
    assert isinstance(got, FrameReceived) and got.peer == nodes[2].local_key


async def test_simultaneous_dials_resolve_to_one_link(make_node: NodeFactory) -> None:
    a, b = await make_node(), await make_node()
    peer_b, peer_a = await asyncio.gather(a.connect((b.host, b.port)), b.connect((a.host, a.port)))
    assert (peer_b, peer_a) == (b.local_key, a.local_key)
    await asyncio.sleep(0.05)  # let the duplicate's close reach the other side
    assert a.peers() == [b.local_key] and b.peers() == [a.local_key]
    # Exactly one connected event per side, and the surviving link carries frames.
    await a.send(b.local_key, FrameType.GOSSIP, b"one link")
    got = await next_of(b, FrameReceived)
    assert isinstance(got, FrameReceived) and got.payload == b"one link"


async def test_clean_close_tells_the_peer_why(make_node: NodeFactory) -> None:
    a, b = await make_node(), await make_node()
    await a.connect((b.host, b.port))
    await next_of(b, PeerConnected)
    await a.disconnect(b.local_key, "maintenance")
    gone = await next_of(b, PeerDisconnected)
    assert isinstance(gone, PeerDisconnected) and "maintenance" in gone.reason
    assert not a.peers() and not b.peers()


def test_transport_runs_on_uvloop_with_its_own_clock() -> None:
    import uvloop  # noqa: PLC0415

    async def exchange() -> bytes:
        from tests.transport.conftest import FAST  # noqa: PLC0415

        ca = ClusterCA.create("uv", dt.datetime.now(dt.UTC))
        nodes = []
        for _ in range(2):
            key = NodeKey.generate()
            cert = ca.issue(key.public_key, dt.datetime.now(dt.UTC))
            node = QuicTransport(key, cert, Trust(ca.certificate), settings=FAST)
            await node.start()
            nodes.append(node)
        a, b = nodes
        await a.connect((b.host, b.port))
        await a.send(b.local_key, FrameType.CHUNK, b"u" * 1_000_000)
        got = await next_of(b, FrameReceived)
        for n in nodes:
            await n.close()
        assert isinstance(got, FrameReceived)
        return got.payload

    loop = uvloop.new_event_loop()
    try:
        payload = loop.run_until_complete(asyncio.wait_for(exchange(), 20))
    finally:
        loop.close()
    assert payload == b"u" * 1_000_000


async def test_maintained_link_comes_back_after_the_peer_restarts(
    make_node: NodeFactory, cluster: Cluster
) -> None:
    creds = cluster.node_credentials()
    b = await make_node(credentials=creds)
    port = b.port
    a = await make_node()
    a.maintain((b.host, port), expected_peer=b.local_key)
    await next_of(a, PeerConnected)
    await b.close()  # the peer goes away (a restart): a's link drops
    await next_of(a, PeerDisconnected)
    b2 = QuicTransport(
        creds[0], creds[1], cluster.trust, host="127.0.0.1", port=port, settings=FAST
    )
    await b2.start()
    try:
        back = await next_of(a, PeerConnected, timeout=10)
        assert isinstance(back, PeerConnected) and back.peer == b2.local_key
        assert a.reconnects >= 2
    finally:
        await b2.close()


async def test_peer_that_vanishes_silently_is_dropped_by_the_idle_timeout(
    make_node: NodeFactory, cluster: Cluster
) -> None:
    from tests.transport.test_hostile import authenticated_raw  # noqa: PLC0415

    server = await make_node(settings=TransportSection(idle_timeout_s=0.5, ping_interval_s=0.1))
    client = await authenticated_raw(server, cluster)
    await next_of(server, PeerConnected)
    client.close()  # gone without a word: no CONNECTION_CLOSE, no more packets
    gone = await next_of(server, PeerDisconnected, timeout=5)
    assert isinstance(gone, PeerDisconnected) and not server.peers()


async def test_the_udp_socket_gets_the_configured_buffers_or_the_kernel_cap(
    make_node: NodeFactory,
) -> None:
    # Linux's default UDP receive buffer holds about 90 full datagrams; a node fed by
    # several peers overflowed it and QUIC took every overflow for congestion.
    wanted = 2 * 1024 * 1024
    node = await make_node(settings=dataclasses.replace(FAST, socket_buffer_bytes=wanted))
    receive, send = node.socket_buffers
    with open("/proc/sys/net/core/rmem_max") as f:
        rmem_max = int(f.read())
    with open("/proc/sys/net/core/wmem_max") as f:
        wmem_max = int(f.read())
    # Linux reports twice the usable size (its bookkeeping included).
    assert receive >= 2 * min(wanted, rmem_max)
    assert send >= 2 * min(wanted, wmem_max)


async def test_the_library_internals_we_read_exist(make_node: NodeFactory) -> None:
    """transport/backend.py reads a few private fields of each QUIC library (its
    docstring says which and why): a release that renames one fails here, not in
    production."""
    a, b = await make_node(), await make_node()
    await a.connect((b.host, b.port))
    link = a.connection(b.local_key)
    assert link is not None
    be = link.backend
    assert be.peer_certificate(link.quic) is not None
    assert isinstance(be.server_cid(link.quic), bytes) and be.server_cid(link.quic)
    rtt = be.rtt(link.quic)
    assert rtt is not None and isinstance(rtt[1], float) and rtt[1] > 0
    shown = [x for x in (rtt[0], rtt[2]) if x is not None]
    assert all(isinstance(x, float) and x >= 0 for x in shown)
    assert len(shown) == (0 if be.native_core else 2)
    assert be.unacked_bytes(link.quic) >= 0
    assert link.control_unacked() >= 0
    if be.native_core:  # the qlog hook we skip (transport.backend.connection)
        assert callable(getattr(type(link.quic), "_log_packets", None))


async def test_a_peer_that_leaves_its_control_stream_unacknowledged_is_dropped(
    make_node: NodeFactory, cluster: Cluster
) -> None:
    """Control frames spend no credit: a peer that withholds QUIC's window would make
    this node buffer every answer to it (review: 1,500 syncs left 73 MiB buffered)."""
    from tests.transport.test_hostile import authenticated_raw  # noqa: PLC0415

    settings = dataclasses.replace(FAST, max_control_send_bytes=1 << 20)
    server = await make_node(settings=settings)
    # The member lets the server send it 4 KiB per stream, and no more, ever.
    hostile = await authenticated_raw(server, cluster, max_stream_data=4096)
    await eventually(server.peers, 5)
    peer = server.peers()[0]
    with pytest.raises(TransportError):
        for _ in range(40):  # 40 x 60 KB of gossip it never lets through
            await server.send(peer, FrameType.GOSSIP, b"g" * 60_000)
    assert peer not in server.peers()
    hostile.close()


async def test_a_connection_the_library_closed_under_the_link_is_dropped_quietly(
    make_node: NodeFactory,
) -> None:
    """The QUIC library may close a connection on its own (an idle timeout, its own
    error): the link goes and nothing counts as a fault (a timer of ours that outlives
    the connection, which qh3 2.x answers with "connection is closed", drops the link
    too: seen when a mesh of daemons closed at once)."""
    a, b = await make_node(), await make_node()
    await a.connect((b.host, b.port))
    link = a.connection(b.local_key)
    assert link is not None
    link.quic.close(error_code=0, reason_phrase="gone")
    await eventually(lambda: b.local_key not in a.peers(), timeout_s=10)
    assert a.guard.total == 0, a.guard.counts


@pytest.mark.parametrize("then", ["send", "disconnect"])
async def test_writing_to_a_connection_the_library_closed_is_no_fault(
    make_node: NodeFactory, then: str
) -> None:
    """What the session queued after the library closed the connection (a frame, or
    our own CLOSE) met qh3's "connection is closed" and counted as an internal error
    (seen in bench/strategy.py's large rounds): the link goes, quietly."""
    a, b = await make_node(), await make_node()
    await a.connect((b.host, b.port))
    link = a.connection(b.local_key)
    assert link is not None
    link.quic.close(error_code=0, reason_phrase="gone")
    if then == "send":
        with contextlib.suppress(TransportError):
            await a.send(b.local_key, FrameType.GOSSIP, b"g" * 1000)
    else:
        await a.disconnect(b.local_key, "bye")
    await eventually(lambda: b.local_key not in a.peers(), timeout_s=10)
    assert a.guard.total == 0, a.guard.counts
