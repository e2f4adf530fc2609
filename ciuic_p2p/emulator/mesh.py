"""Several nodes in one process on the real clock, their datagrams shaped by one
emulated network, and a UDP ping for measuring what the emulator does.

    mesh = EmulatedMesh(load_scenario(scenario_path("cities11")))
    node = QuicTransport(key, cert, trust, wrap_udp=mesh.wrapper("Tokyo"))
    mesh.register("Tokyo", await node.start())
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import statistics
import struct
import time
from collections.abc import Callable
from typing import Any

from ciuic_p2p.emulator.model.scenario import EmulatedNetwork, Scenario, scenario_from_mapping
from ciuic_p2p.emulator.udp import Address, EmulatedDatagramTransport, TimerLead

_PING = struct.Struct("<BQd")  # kind (0 ping, 1 pong), id, send time


class EmulatedMesh:
    """The address book and the shared network of an in-process emulated mesh."""

    def __init__(
        self,
        scenario: Scenario,
        clock: Callable[[], float] = time.monotonic,
        start: float | None = None,
    ) -> None:
        """``start``: the scenario's time zero on ``clock``; separate processes pass the
        same value (CLOCK_MONOTONIC is system-wide) so their schedules agree."""
        self.scenario = scenario
        self.network = EmulatedNetwork(scenario)
        self.clock = clock
        self.start = clock() if start is None else start
        self.lead = TimerLead()
        self.addresses: dict[str, Address] = {}
        self.book: dict[Address, str] = {}

    def register(self, node: str, address: Address) -> None:
        self.addresses[node] = address
        self.book[(address[0], address[1])] = node

    def wrapper(
        self, node: str
    ) -> Callable[[asyncio.DatagramTransport], asyncio.DatagramTransport]:
        if node not in self.scenario.node_names():
            raise KeyError(f"{node} is not in the scenario")

        def wrap(inner: asyncio.DatagramTransport) -> asyncio.DatagramTransport:
            return EmulatedDatagramTransport(
                inner, self.network, node, self.book, self.start, self.clock, lead=self.lead
            )

        return wrap

    def now(self) -> float:
        """Seconds since the mesh started (the scenario's schedule clock)."""
        return self.clock() - self.start


class PingNode(asyncio.DatagramProtocol):
    """Answers pings and times its own: the emulator's calibration instrument."""

    def __init__(self, mesh: EmulatedMesh, name: str) -> None:
        self.mesh = mesh
        self.name = name
        self.udp: asyncio.DatagramTransport | None = None
        self.waiting: dict[int, asyncio.Future[float]] = {}
        self.ids = itertools.count()
        self.received = 0
        self.first_received_at: float | None = None
        self.last_received_at: float | None = None

    @classmethod
    async def start(
        cls,
        mesh: EmulatedMesh,
        name: str,
        address: Address = ("127.0.0.1", 0),
        shape: bool = True,
    ) -> PingNode:
        """``shape=False``: send unshaped (the kernel's netem shapes instead)."""
        node = cls(mesh, name)
        loop = asyncio.get_running_loop()
        raw, _ = await loop.create_datagram_endpoint(lambda: node, local_addr=address)
        node.udp = mesh.wrapper(name)(raw) if shape else raw
        mesh.register(name, raw.get_extra_info("sockname"))
        return node

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self.received += 1
        self.last_received_at = time.perf_counter()
        if self.first_received_at is None:
            self.first_received_at = self.last_received_at
        if len(data) < _PING.size or self.udp is None:
            return
        kind, ident, sent_at = _PING.unpack_from(data)
        if kind == 0:
            self.udp.sendto(_PING.pack(1, ident, sent_at) + data[_PING.size :], addr)
        elif (fut := self.waiting.pop(ident, None)) is not None and not fut.done():
            fut.set_result(time.perf_counter() - sent_at)

    async def ping(self, peer: str, timeout: float, size: int = 64) -> float | None:
        """One round trip to ``peer`` in seconds, or None if it was lost."""
        assert self.udp is not None
        ident = next(self.ids)
        fut = asyncio.get_running_loop().create_future()
        self.waiting[ident] = fut
        payload = _PING.pack(0, ident, time.perf_counter())
        self.udp.sendto(payload + bytes(max(0, size - len(payload))), self.mesh.addresses[peer])
        try:
            return await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            self.waiting.pop(ident, None)
            return None

    def close(self) -> None:
        if self.udp is not None:
            self.udp.close()


async def measure_rtts(
    scenario: Scenario,
    pings: int = 7,
    spacing_s: float = 0.02,
    pairs: list[tuple[str, str]] | None = None,
) -> dict[tuple[str, str], float]:
    """Median measured RTT of every unordered pair (or of ``pairs``), all at once."""
    mesh = EmulatedMesh(scenario)
    nodes = {n: await PingNode.start(mesh, n) for n in scenario.node_names()}

    async def pair(a: str, b: str) -> tuple[tuple[str, str], float]:
        timeout = 2 * scenario.rtt_s(a, b) + 1.0
        samples = []
        for _ in range(pings):
            rtt = await nodes[a].ping(b, timeout)
            if rtt is not None:
                samples.append(rtt)
            await asyncio.sleep(spacing_s)
        return (a, b), statistics.median(samples) if samples else float("nan")

    names = scenario.node_names()
    # A garbage-collection pause in the middle would be measured as link delay.
    gc.collect()
    gc.disable()
    try:
        wanted = pairs if pairs is not None else list(itertools.combinations(names, 2))
        results = await asyncio.gather(*(pair(a, b) for a, b in wanted))
    finally:
        gc.enable()
        for node in nodes.values():
            node.close()
    return dict(results)


async def measure_rate_error_pct(rate_bps: float, count: int, size: int = 1452) -> float:
    """A bulk transfer of ``count`` datagrams, offered faster than a link of
    ``rate_bps`` carries; the rate achieved at the receiver, in percent off the
    configured rate."""
    scenario = scenario_from_mapping(
        {
            "nodes": [{"name": "a"}, {"name": "b"}],
            "links": [
                {
                    "src": "a",
                    "dst": "b",
                    "delay_ms": 5,
                    "rate_mbps": rate_bps / 1e6,
                    "queue_bytes": 100_000_000,
                }
            ],
        }
    )
    mesh = EmulatedMesh(scenario)
    a, b = await PingNode.start(mesh, "a"), await PingNode.start(mesh, "b")
    assert a.udp is not None
    for _ in range(count):
        a.udp.sendto(b"\x02" + bytes(size - 1), mesh.addresses["b"])
    expected_s = count * size * 8 / rate_bps
    deadline = time.perf_counter() + expected_s * 2 + 2
    while b.received < count and time.perf_counter() < deadline:
        await asyncio.sleep(0.01)
    a.close()
    b.close()
    first, last = b.first_received_at, b.last_received_at
    if b.received < 2 or first is None or last is None or last <= first:
        raise RuntimeError(f"only {b.received} of {count} datagrams arrived")
    achieved = (b.received - 1) * size * 8 / (last - first)
    return (achieved - rate_bps) / rate_bps * 100
