"""The emulator on the real clock, on real UDP datagrams over loopback."""

from __future__ import annotations

import asyncio
import dataclasses
import math
from typing import Any

import pytest

from ciuic_p2p.core.link.frames import FrameType
from ciuic_p2p.data import scenario_path
from ciuic_p2p.emulator.mesh import EmulatedMesh, PingNode, measure_rate_error_pct, measure_rtts
from ciuic_p2p.emulator.model.netem import LinkParams
from ciuic_p2p.emulator.model.scenario import scenario_from_mapping
from ciuic_p2p.emulator.scenarios import load_scenario
from ciuic_p2p.transport.base import FrameReceived
from ciuic_p2p.transport.quic import QuicTransport
from ciuic_p2p.transport.sockbuf import size_buffers
from tests.conftest import eventually
from tests.transport.conftest import FAST, Cluster
from tests.transport.test_quic import next_of

pytestmark = pytest.mark.network

PINGY = dataclasses.replace(FAST, ping_interval_s=0.02)


async def test_rtt_of_every_city_pair_matches_the_matrix() -> None:
    scenario = load_scenario(scenario_path("cities11"))
    # Calibrate delay alone: no loss, and rates high enough not to add queueing.
    links = {k: v.with_changes(loss=0.0, rate_bps=None) for k, v in scenario.links.items()}
    scenario = dataclasses.replace(scenario, links=links)

    def outside(measured: dict[tuple[str, str], float]) -> dict[tuple[str, str], float]:
        return {
            (a, b): rtt
            for (a, b), rtt in measured.items()
            if not math.isfinite(rtt)
            or abs(rtt - scenario.rtt_s(a, b)) > max(0.03 * scenario.rtt_s(a, b), 0.001)
        }

    measured = await measure_rtts(scenario)
    assert len(measured) == 55
    # A pair outside the bound is measured once more: a scheduling hiccup of this
    # shared 2-core machine does not repeat, an emulator error would (bench/emulator.py
    # reports the first-try figures).
    suspects = outside(measured)
    assert len(suspects) <= 3
    assert not outside(await measure_rtts(scenario, pairs=list(suspects))) if suspects else True


async def test_a_cut_blocks_every_datagram_and_healing_restores_traffic() -> None:
    scenario = scenario_from_mapping(
        {"nodes": [{"name": "a"}, {"name": "b"}], "defaults": {"delay_ms": 2}}
    )
    mesh = EmulatedMesh(scenario)
    a, b = await PingNode.start(mesh, "a"), await PingNode.start(mesh, "b")
    try:
        assert await a.ping("b", 1.0) is not None
        mesh.network.cut("a", "b")
        before = b.received
        lost = [await a.ping("b", 0.05) for _ in range(20)]
        assert all(x is None for x in lost) and b.received == before
        mesh.network.heal("a", "b")
        assert await a.ping("b", 1.0) is not None
    finally:
        a.close()
        b.close()


async def test_quic_nodes_run_unchanged_over_the_emulated_wan(cluster: Cluster) -> None:
    scenario = load_scenario(scenario_path("cities11")).subset(["Paris", "London"])
    scenario = dataclasses.replace(
        scenario, links={k: LinkParams(delay_s=v.delay_s) for k, v in scenario.links.items()}
    )
    mesh = EmulatedMesh(scenario)
    nodes = {}
    for name in ("Paris", "London"):
        key, cert = cluster.node_credentials()
        node = QuicTransport(key, cert, cluster.trust, settings=PINGY, wrap_udp=mesh.wrapper(name))
        mesh.register(name, await node.start())
        nodes[name] = node
    try:
        paris, london = nodes["Paris"], nodes["London"]
        await paris.connect((london.host, london.port))
        await paris.send(london.local_key, FrameType.GOSSIP, b"bonjour")
        got = await next_of(london, FrameReceived)
        assert isinstance(got, FrameReceived) and got.payload == b"bonjour"

        def sampled() -> bool:
            s = paris.rtt(london.local_key)
            return s is not None and s.samples >= 10

        await eventually(sampled, timeout_s=3.0)
        stats = paris.rtt(london.local_key)
        assert stats is not None and stats.ping_min_s is not None and stats.samples >= 10
        # Within the emulator's timer error, plus QUIC's own processing.
        assert abs(stats.ping_min_s - scenario.rtt_s("Paris", "London")) < 0.002
    finally:
        for node in nodes.values():
            await node.close()


async def test_bulk_transfer_on_a_rate_limited_link_gets_the_configured_rate() -> None:
    error_pct = await measure_rate_error_pct(4e6, 600)  # 4 Mbit/s, 0.87 MB offered at once
    assert abs(error_pct) < 10


class _Recorder(asyncio.DatagramProtocol):
    def __init__(self) -> None:
        self.seen: list[int] = []

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self.seen.append(int.from_bytes(data[:4], "little"))


async def test_a_link_that_does_not_reorder_delivers_a_long_stream_in_send_order() -> None:
    # A steady stream, sent in bursts between which earlier datagrams are released (so
    # the timer lead moves), on a rate-limited link: QUIC reads a datagram overtaken by
    # three others as lost, so an emulator that swapped them would halve its window.
    scenario = scenario_from_mapping(
        {
            "nodes": [{"name": "a"}, {"name": "b"}],
            "defaults": {"delay_ms": 30, "rate_mbps": 1000, "reorder": False},
        }
    )
    mesh = EmulatedMesh(scenario)
    loop = asyncio.get_running_loop()
    recorder = _Recorder()
    raw_b, _ = await loop.create_datagram_endpoint(lambda: recorder, local_addr=("127.0.0.1", 0))
    # Releases come in batches after a late timer: room for the whole stream, so that
    # what this test sees is the emulator's order, not the kernel's drops.
    size_buffers(raw_b.get_extra_info("socket"), 4 * 1024 * 1024)
    raw_a, _ = await loop.create_datagram_endpoint(
        asyncio.DatagramProtocol, local_addr=("127.0.0.1", 0)
    )
    mesh.register("a", raw_a.get_extra_info("sockname"))
    mesh.register("b", raw_b.get_extra_info("sockname"))
    a = mesh.wrapper("a")(raw_a)
    total = 3000
    try:
        for burst in range(total // 30):
            for i in range(30):
                a.sendto((burst * 30 + i).to_bytes(4, "little") + bytes(1200), mesh.addresses["b"])
            await asyncio.sleep(0.002)
        # Order is the subject, not loss: a loaded machine may still drop a few.
        await eventually(lambda: len(recorder.seen) >= 0.95 * total, timeout_s=20.0)
        assert recorder.seen == sorted(recorder.seen)
    finally:
        a.close()
        raw_b.close()
