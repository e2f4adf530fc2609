"""Nodes assembled as ``ciuic-node run`` assembles them (daemon, store, trainer
server), on the in-memory transport and one virtual clock: what the daemon-level tests
run when they need no real QUIC (tests/virtualtime.py moves the clock)."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import datetime as dt
from collections.abc import Callable, Sequence
from pathlib import Path

from ciuic_p2p.admission import ClusterCA, Trust
from ciuic_p2p.config import Config
from ciuic_p2p.core.mesh.broadcast import Delivery
from ciuic_p2p.daemon.assembly import NodeAssembly
from ciuic_p2p.daemon.node import Direction, MeshDaemon, NoListener
from ciuic_p2p.identity import NodeKey
from ciuic_p2p.transport.memory import MemoryNetwork, MemoryTransport

UTC = dt.datetime(2026, 12, 1, tzinfo=dt.UTC)


class Recorder(NoListener):
    """What one daemon told the parts above it."""

    def __init__(self) -> None:
        self.delivered: list[Delivery] = []
        self.down: list[str] = []
        self.traffic: collections.Counter[Direction] = collections.Counter()

    def chunk_delivered(self, delivery: Delivery) -> None:
        self.delivered.append(delivery)

    def member_down(self, peer: str) -> None:
        self.down.append(peer)

    def chunk_traffic(self, direction: Direction, origin: str, nbytes: int) -> None:
        self.traffic[direction] += 1


class MemoryMesh:
    def __init__(
        self,
        root: Path,
        names: Sequence[str],
        config: Config | None = None,
        latency_s: float = 0.01,
    ) -> None:
        self.root = root
        self.names = list(names)
        self.config = config or Config.lan()
        self.network = MemoryNetwork(latency_s=latency_s)
        self.ca = ClusterCA.create("memory-mesh", UTC - dt.timedelta(days=1))
        self.trust = Trust(self.ca.certificate)
        self.nodes: dict[str, NodeAssembly] = {}
        self.records: dict[str, Recorder] = {}

    @property
    def daemons(self) -> dict[str, MeshDaemon]:
        return {n: node.daemon for n, node in self.nodes.items()}

    async def start(self, name: str, key: NodeKey | None = None) -> NodeAssembly:
        """Node ``name`` (``key``: its key from before, as a restarted daemon has it
        from its state directory; a new one by default)."""
        clock = asyncio.get_running_loop().time  # the virtual clock: one for every part
        key = key or NodeKey.generate()
        cert = self.ca.issue(key.public_key, UTC - dt.timedelta(days=1))
        config = dataclasses.replace(
            self.config, node=dataclasses.replace(self.config.node, name=name)
        )
        transport = MemoryTransport(
            self.network,
            key,
            cert,
            self.trust,
            config.transport,
            clock=clock,
            wallclock=lambda: UTC,
        )
        record = self.records[name] = Recorder()
        node = NodeAssembly(
            config,
            key,
            cert,
            self.trust,
            state_dir=self.root / name,
            transport=transport,
            clock=clock,
            observer=record,
        )
        await node.start()
        self.nodes[name] = node
        return node

    async def form(self, timeout_s: float = 60.0) -> None:
        for name in self.names:
            await self.start(name)
        seed = self.nodes[self.names[0]].daemon.address
        await asyncio.gather(*(self.nodes[n].daemon.join(seed) for n in self.names[1:]))
        await until(self.agree, timeout_s)

    def agree(self, among: Sequence[str] | None = None) -> bool:
        names = list(among) if among is not None else list(self.nodes)
        want = sorted(self.nodes[n].peer_id for n in names)
        return all(self.nodes[n].daemon.mesh.view() == want for n in names)

    async def crash(self, name: str) -> None:
        """The node stops without a word (its links drop; no leave is announced)."""
        node = self.nodes.pop(name)
        await node.close()

    async def close(self) -> None:
        for node in self.nodes.values():
            await node.close()


async def until(condition: Callable[[], object], timeout_s: float) -> float:
    """Wait (virtual time, checked every 10 ms) until ``condition()`` holds."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    while not condition():
        if loop.time() - t0 > timeout_s:
            raise AssertionError(f"not within {timeout_s} s of virtual time")
        await asyncio.sleep(0.01)
    return loop.time() - t0
