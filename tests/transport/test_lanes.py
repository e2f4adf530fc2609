"""A node's chunks over lane processes (transport.laned, transport.lanes)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import pytest_asyncio

from ciuic_p2p.admission import Trust
from ciuic_p2p.core.link.frames import FrameType
from ciuic_p2p.transport.base import FrameReceived, Transport
from ciuic_p2p.transport.errors import TransportError
from ciuic_p2p.transport.laned import LanedTransport
from ciuic_p2p.transport.quic import QuicTransport
from tests.procs import running
from tests.transport.conftest import FAST, NOW, Cluster

pytestmark = pytest.mark.network

LaneFactory = Callable[..., Awaitable[LanedTransport]]


@pytest_asyncio.fixture
async def make_laned(cluster: Cluster, quic_backend: str) -> AsyncIterator[LaneFactory]:
    nodes: list[LanedTransport] = []

    async def factory(lanes: int = 2) -> LanedTransport:
        """``lanes``: paths, the link included (lanes - 1 processes)."""
        key, cert = cluster.node_credentials()
        settings = dataclasses.replace(FAST, quic_backend=quic_backend)  # type: ignore[arg-type]
        node = LanedTransport(
            QuicTransport(key, cert, cluster.trust, settings=settings), key, cert, lanes
        )
        await node.start()
        nodes.append(node)
        return node

    yield factory
    for node in nodes:
        await node.close()


async def until(cond: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    """Wait for a condition, bounded (lane processes take a second to start)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not cond():
        assert loop.time() < end, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


class Inbox:
    """A node's events, read as a daemon reads them: all the time, in a task."""

    def __init__(self, node: Transport) -> None:
        self.frames: asyncio.Queue[FrameReceived] = asyncio.Queue()
        self.task = asyncio.ensure_future(self._read(node))

    async def _read(self, node: Transport) -> None:
        while True:
            event = await node.next_event()
            if isinstance(event, FrameReceived):
                self.frames.put_nowait(event)

    async def take(self, count: int) -> list[FrameReceived]:
        return [await asyncio.wait_for(self.frames.get(), 20) for _ in range(count)]


async def paired(
    a: LanedTransport, b: LanedTransport, lanes: list[int] | None = None
) -> tuple[Inbox, Inbox]:
    """Connect a to b, read both, and wait until each has every lane to the other."""
    lanes = [0, 1] if lanes is None else lanes
    inboxes = Inbox(a), Inbox(b)
    assert await a.connect(b.main.address) == b.local_key
    await until(lambda: a._lanes_to(b.local_key) == lanes, "a's lanes to b")
    await until(lambda: b._lanes_to(a.local_key) == lanes, "b's lanes to a")
    return inboxes


@pytest.mark.timeout(120)
async def test_chunks_go_over_paired_lanes_and_the_rest_over_the_link(
    make_laned: LaneFactory,
) -> None:
    a, b = await make_laned(3), await make_laned(3)  # the link and two lane processes
    inbox_a, inbox_b = await paired(a, b)
    chunks = [os.urandom(64 * 1024) + bytes([i]) for i in range(40)]
    for c in chunks:
        await a.send(b.local_key, FrameType.MESH_CHUNK, c)
        await a.send(b.local_key, FrameType.GOSSIP, c[:100])
    got = await inbox_b.take(80)
    assert {f.peer for f in got} == {a.local_key}
    assert sorted(f.payload for f in got if f.type is FrameType.MESH_CHUNK) == sorted(chunks)
    assert sum(f.type is FrameType.GOSSIP for f in got) == 40
    # Every path carried some: both lane processes and the link.
    assert all(b.frames_by_lane) and b.counters["link_frames_received"] > 0
    assert sum(b.frames_by_lane) + b.counters["link_frames_received"] == 40
    # The other way too: b accepted its lanes, and sends on them.
    for c in chunks[:10]:
        await b.send(a.local_key, FrameType.MESH_CHUNK, c)
    back = await inbox_a.take(10)
    assert sorted(f.payload for f in back) == sorted(chunks[:10])
    assert sum(a.frames_by_lane) + a.counters["link_frames_received"] == 10
    # The link's counters include its lanes' (reported every second).
    await until(
        lambda: (b.link_stats(a.local_key) or pytest.fail()).bytes_received > 40 * 64 * 1024,
        "lane bytes in link_stats",
    )
    pids = a.pool.pids + b.pool.pids
    assert len(pids) == 4
    await a.close()
    await b.close()
    for pid in pids:  # ours, ended by close
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.timeout(120)
async def test_a_revoked_peer_loses_its_lanes_with_its_link(
    cluster: Cluster, quic_backend: str
) -> None:
    settings = dataclasses.replace(FAST, quic_backend=quic_backend)  # type: ignore[arg-type]
    nodes = []
    for _ in range(2):
        key, cert = cluster.node_credentials()
        node = LanedTransport(
            QuicTransport(key, cert, cluster.trust, settings=settings), key, cert, 2
        )
        await node.start()
        nodes.append((node, cert))
    (a, _), (b, b_cert) = nodes
    try:
        inbox_a, _ = await paired(a, b, lanes=[0])
        crl = cluster.ca.revocation_list([b_cert.serial_number], NOW)
        assert a.set_trust(Trust(cluster.ca.certificate, crl)) == [b.local_key]
        # Every lane drops b: nothing of b's reaches a by any path any more.
        await until(lambda: not a.lanes_status()["paired"], "a's lanes to drop b")  # type: ignore[index]
        assert a._lanes_to(b.local_key) == []
        with pytest.raises(TransportError):
            await a.send(b.local_key, FrameType.MESH_CHUNK, b"x" * 70_000)
        assert inbox_a.frames.empty()
    finally:
        for node, _ in nodes:
            await node.close()


@pytest.mark.timeout(120)
async def test_a_peer_without_lanes_gets_its_chunks_on_the_link(
    make_laned: LaneFactory, make_node: Callable[..., Awaitable[QuicTransport]]
) -> None:
    a = await make_laned()
    plain = await make_node()
    _, inbox = Inbox(a), Inbox(plain)
    assert await a.connect(plain.address) == plain.local_key
    # The plain node hears a's LANES frame as a frame it does not use (the daemon
    # ignores it), and never answers with its own: a's chunks take the link.
    first = await inbox.take(1)
    assert first[0].type is FrameType.LANES
    for i in range(5):
        await a.send(plain.local_key, FrameType.MESH_CHUNK, bytes([i]) * 70_000)
    got = await inbox.take(5)
    assert [f.payload[0] for f in got] == list(range(5))
    assert a.counters["lane_frames_sent"] == 0


@pytest.mark.timeout(120)
async def test_a_member_cannot_make_a_node_dial_twice_or_crash_it_with_lanes(
    make_laned: LaneFactory, make_node: Callable[..., Awaitable[QuicTransport]]
) -> None:
    a = await make_laned()
    member = await make_node()
    # The member dials a, so a (whatever the keys' order) hears its frames first.
    inbox = Inbox(a)
    assert await member.connect(a.main.address) == a.local_key
    for payload in (
        b"",
        b"\x02\x01\x00\x50",
        b"\x01\x00",
        b"\x01\x02\x00\x50",
        b"\x01\x01\x00\x00",
    ):
        await member.send(a.local_key, FrameType.LANES, payload)
    good = b"\x01\x02\x00\x50\x00\x51"
    await member.send(a.local_key, FrameType.LANES, good)
    await member.send(a.local_key, FrameType.MESH_CHUNK, b"after")
    got = await inbox.take(1)  # LANES frames are a's own: never handed up
    assert got[0].payload == b"after"
    assert a.counters["lanes_refused"] == 1  # the first one counts; later ones are ignored
    assert a.counters["lanes_repeated"] == 5
    assert a.counters["lane_dials_failed"] == 0
    assert member.local_key in a.peers()


@pytest.mark.timeout(60)
def test_lanes_end_when_their_node_is_killed(tmp_path: os.PathLike[str]) -> None:
    """A node that dies (SIGKILL: no close) leaves no lane process behind."""
    script = textwrap.dedent(
        """
        import asyncio, datetime as dt, sys
        from ciuic_p2p.admission import ClusterCA, Trust
        from ciuic_p2p.identity import NodeKey
        from ciuic_p2p.transport.laned import LanedTransport
        from ciuic_p2p.transport.quic import QuicTransport

        async def main():
            now = dt.datetime.now(dt.UTC)
            ca = ClusterCA.create("t", now)
            key = NodeKey.generate()
            cert = ca.issue(key.public_key, now)
            node = LanedTransport(QuicTransport(key, cert, Trust(ca.certificate)), key, cert, 3)
            await node.start()
            print("lanes", *node.pool.pids, flush=True)
            await asyncio.sleep(60)

        if __name__ == "__main__":
            asyncio.run(main())
        """
    )
    path = os.path.join(tmp_path, "node.py")
    with open(path, "w") as f:
        f.write(script)
    proc = subprocess.Popen([sys.executable, path], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = ""
        while not line.startswith("lanes "):  # past the node's log lines
            line = proc.stdout.readline()
            assert line, "the node ended before its lanes started"
        pids = [int(p) for p in line.split()[1:]]
        assert len(pids) == 2
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()
    deadline = time.monotonic() + 30
    while any(map(running, pids)):  # each lane sees its pipe end and exits
        assert time.monotonic() < deadline, "a lane outlived its node"
        time.sleep(0.01)


@pytest.mark.timeout(120)
async def test_a_busy_lane_never_holds_back_the_links_events(make_laned: LaneFactory) -> None:
    a, b = await make_laned(), await make_laned()
    await paired(a, b, lanes=[0])
    reader = a.main._book.events  # what a's link has for a, not yet read
    inboxes = [task for task in asyncio.all_tasks() if "Inbox._read" in repr(task.get_coro())]
    for task in inboxes:  # a and b stop reading: the queues fill as a daemon's would
        task.cancel()
    await b.main.send(a.local_key, FrameType.GOSSIP, b"membership")
    pending = a._next_main  # a's read of its link already under way, or not

    def arrived() -> bool:
        return reader.qsize() > 0 or (pending is not None and pending.done())

    await until(arrived, "the gossip at a's link")
    for i in range(1000):  # a lane far busier than the link
        a.lane_frame(0, b.local_key, FrameType.MESH_CHUNK, i.to_bytes(4, "little"))
    first = []
    for _ in range(4):
        event = await asyncio.wait_for(a.next_event(), 10)
        if isinstance(event, FrameReceived):
            first.append(event.type)
    assert FrameType.GOSSIP in first


@pytest.mark.timeout(120)
async def test_frames_from_a_peer_with_no_link_are_never_queued(make_laned: LaneFactory) -> None:
    a = await make_laned()
    for _ in range(10_000):  # an admitted member linked to a lane only
        a.lane_frame(0, b"\x07" * 32, FrameType.MESH_CHUNK, b"")
    assert a._frames.qsize() == 0
    assert a.counters["frames_unlinked"] == 10_000


@pytest.mark.timeout(120)
async def test_a_dead_lane_is_reaped_and_the_link_carries_on(make_laned: LaneFactory) -> None:
    a, b = await make_laned(), await make_laned()
    inbox_a, inbox_b = await paired(a, b, lanes=[0])
    pid = a.pool.pids[0]
    os.kill(pid, signal.SIGINT)  # a Ctrl+C meant for the node: the lane stays
    await b.send(a.local_key, FrameType.MESH_CHUNK, b"x" * 70_000)
    assert len(await inbox_a.take(1)) == 1
    assert a.pool.ended == set() and running(pid)
    os.kill(pid, signal.SIGKILL)  # ours
    await until(lambda: a.pool.ended == {0}, "the lane's end seen")
    await until(lambda: not running(pid), "the lane reaped")
    assert a.lanes_status()["paired"] == {}  # type: ignore[index]
    for i in range(5):  # everything goes over the link now
        await a.send(b.local_key, FrameType.MESH_CHUNK, bytes([i]) * 70_000)
    assert [f.payload[0] for f in await inbox_b.take(5)] == list(range(5))
    assert a.counters["lane_frames_sent"] == 0


@pytest.mark.timeout(60)
async def test_a_dial_that_meets_another_key_leaves_that_keys_link_alone(
    make_node: Callable[..., Awaitable[QuicTransport]],
) -> None:
    """A member that names another member's port as its own: the dial expecting the
    member reaches the other, is refused, and the link to the other stays."""
    settings = dataclasses.replace(FAST, auth_timeout_s=0.05)
    a, n, m = await make_node(settings=settings), await make_node(), await make_node()
    assert await a.connect(n.address) == n.local_key
    link = a.connection(n.local_key)
    assert link is not None
    await until(lambda: a.clock() - link.established_at > 0.1, "the link older than auth")
    with pytest.raises(TransportError):
        await a.connect(n.address, expected_peer=m.local_key)
    assert a.connection(n.local_key) is link and not link.closed
