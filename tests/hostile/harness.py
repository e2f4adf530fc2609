"""The hostile-member harness: honest daemons (real QUIC, real membership and
dissemination) in this process on loopback, and a member of their cluster that lies
(tests/hostile/attack.py's :class:`Liar`). Bounded: every wait has a deadline, and each
test ends every daemon and link it started.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import datetime as dt
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType

from ciuic_p2p.admission import ClusterCA, Trust
from ciuic_p2p.config import Config
from ciuic_p2p.core.mesh.broadcast import Delivery
from ciuic_p2p.daemon.assembly import NodeAssembly
from ciuic_p2p.daemon.node import ChunkRecorder, MeshDaemon
from ciuic_p2p.identity import NodeKey
from tests.hostile.attack import Liar

NOW = dt.datetime.now(dt.UTC)


def fast_config() -> Config:
    """The LAN preset's timers on loopback ports chosen by the system."""
    config = Config.lan()
    return dataclasses.replace(config, node=dataclasses.replace(config.node, listen_port=0))


class HonestMesh:
    """Nodes ``names`` assembled as ``ciuic-node run`` does (daemon, store, trainer
    server), joined through the first; each delivery recorded by name."""

    def __init__(self, root: Path, names: Sequence[str], config: Config | None = None) -> None:
        self.root = root
        self.names = list(names)
        self.config = config or fast_config()
        self.ca = ClusterCA.create("hostile-test", NOW)
        self.trust = Trust(self.ca.certificate)
        self.nodes: dict[str, NodeAssembly] = {}
        self.daemons: dict[str, MeshDaemon] = {}
        self.delivered: dict[str, list[Delivery]] = collections.defaultdict(list)

    async def start(self, name: str) -> MeshDaemon:
        key = NodeKey.generate()
        node = dataclasses.replace(self.config.node, name=name)
        assembled = NodeAssembly(
            dataclasses.replace(self.config, node=node),
            key,
            self.ca.issue(key.public_key, NOW),
            self.trust,
            state_dir=self.root / name,
            observer=ChunkRecorder(self.delivered[name].append),
        )
        await assembled.start()
        self.nodes[name] = assembled
        self.daemons[name] = assembled.daemon
        return assembled.daemon

    async def form(self, timeout_s: float = 20.0) -> None:
        for name in self.names:
            await self.start(name)
        seed = self.daemons[self.names[0]].address
        await asyncio.gather(*(self.daemons[n].join(seed) for n in self.names[1:]))
        await until(self.agree, timeout_s, "the honest views agree")

    def agree(self, extra: Sequence[str] = ()) -> bool:
        want = sorted([d.peer_id for d in self.daemons.values()] + list(extra))
        return all(d.mesh.view() == want for d in self.daemons.values())

    def peer(self, name: str) -> str:
        return self.daemons[name].peer_id

    def liar(self) -> Liar:
        """A member of this mesh's cluster that lies (tests/hostile/attack.py)."""
        return Liar(self.ca, lambda name: self.daemons[name].address)

    def origins_delivered(self, name: str) -> list[tuple[str, int]]:
        return [(d.origin, d.seq) for d in self.delivered[name]]

    async def close(self) -> None:
        for node in self.nodes.values():
            await node.close()

    async def __aenter__(self) -> HonestMesh:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


async def until(condition: Callable[[], object], timeout_s: float, what: str) -> float:
    """Wait until ``condition()`` holds (checked every 10 ms) for at most ``timeout_s``."""
    t0 = time.monotonic()
    while not condition():
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        await asyncio.sleep(0.01)
    return time.monotonic() - t0


async def holds(condition: Callable[[], object], duration_s: float, what: str) -> None:
    """``condition()`` stays true for ``duration_s`` (checked every 10 ms)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < duration_s:
        assert condition(), what
        await asyncio.sleep(0.01)


def rss_bytes() -> int:
    """This process's resident set (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")
