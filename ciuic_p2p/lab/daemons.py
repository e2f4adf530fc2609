"""Real daemons (QUIC, membership, routing, forwarding) in one process on the
emulated WAN: what the dissemination benchmark and the daemon tests run.

    async with DaemonMesh(scenario, names, config) as mesh:
        await mesh.form()               # all join through the first, views agree
        mesh.daemons["Tokyo"].broadcast(b"...")
        mesh.nodes["Tokyo"].trainers    # each node assembled as `ciuic-node run` does

Each daemon binds its own UDP socket on loopback; its datagrams are shaped by the
scenario's links (emulator.udp). Credentials come from a throwaway cluster CA.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType

from ciuic_p2p.admission import ClusterCA, Trust
from ciuic_p2p.config import Config
from ciuic_p2p.daemon.assembly import NodeAssembly
from ciuic_p2p.daemon.node import MeshDaemon, MeshListener
from ciuic_p2p.emulator.mesh import EmulatedMesh
from ciuic_p2p.emulator.model.scenario import Scenario
from ciuic_p2p.identity import NodeKey


class DaemonMesh:
    def __init__(
        self,
        scenario: Scenario,
        names: Sequence[str],
        config: Config,
        *,
        observer: Callable[[str], MeshListener | None] = lambda name: None,
        trainers: bool = True,
    ) -> None:
        """``observer(name)``: what else hears node ``name``'s daemon (a recorder).
        ``trainers``: each node serves a trainer socket pair (``nodes[n].trainers``)."""
        self.scenario = scenario.subset(names)
        self.names = list(names)
        self.config = config
        self.emulated = EmulatedMesh(self.scenario)
        self.ca = ClusterCA.create("bench", dt.datetime.now(dt.UTC))
        self.trust = Trust(self.ca.certificate)
        self.keys = {n: NodeKey.generate() for n in self.names}
        self.observer = observer
        self.trainers = trainers
        self.nodes: dict[str, NodeAssembly] = {}
        self.daemons: dict[str, MeshDaemon] = {}
        self.name_of: dict[str, str] = {}
        self._tmp = tempfile.TemporaryDirectory(prefix="ciuic-mesh-")

    async def start(self, name: str) -> MeshDaemon:
        key = self.keys[name]
        cert = self.ca.issue(key.public_key, dt.datetime.now(dt.UTC))
        node = dataclasses.replace(self.config.node, name=name, listen_port=0)
        assembled = NodeAssembly(
            dataclasses.replace(self.config, node=node),
            key,
            cert,
            self.trust,
            state_dir=Path(self._tmp.name) / name,
            wrap_udp=self.emulated.wrapper(name),
            observer=self.observer(name),
            trainers=self.trainers,
        )
        daemon = assembled.daemon
        address = await assembled.start()
        self.nodes[name] = assembled
        host, port = address.rsplit(":", 1)
        self.emulated.register(name, (host, int(port)))
        self.daemons[name] = daemon
        self.name_of[daemon.peer_id] = name
        return daemon

    async def form(self, timeout_s: float = 60.0) -> float:
        """Start every node, join all through the first; seconds until views agree."""
        t0 = time.monotonic()
        for name in self.names:
            await self.start(name)
        seed = self.daemons[self.names[0]].address
        await asyncio.gather(*(self.daemons[n].join(seed) for n in self.names[1:]))
        await self.until(self.agree, timeout_s)
        return time.monotonic() - t0

    def agree(self) -> bool:
        want = sorted(d.peer_id for d in self.daemons.values())
        return all(d.mesh.view() == want for d in self.daemons.values())

    async def until(self, condition: object, timeout_s: float) -> float:
        assert callable(condition)
        t0 = time.monotonic()
        while not condition():
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"condition not met within {timeout_s} s")
            await asyncio.sleep(0.01)
        return time.monotonic() - t0

    async def close(self) -> None:
        for node in self.nodes.values():
            await node.close()
        self._tmp.cleanup()

    async def __aenter__(self) -> DaemonMesh:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()
