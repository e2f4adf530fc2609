"""Meshes of pure MeshNodes on virtual time: what the tests and the membership
benchmarks drive.

    sim = SimMesh(load_scenario(scenario_path("cities11")).subset(names), MeshSection())
    sim.start_all(join_through=names[0])
    sim.run_for(10.0)
    assert sim.agree()

:class:`RegionNetwork` is a network model for hundreds or thousands of members:
members are spread over the cities of an RTT matrix and every pair gets its cities'
one-way delay (plus a small intra-city delay), with optional jitter and loss; links
are created on first use, so 1000 members do not cost a million link objects.

:class:`SimAuthority` stands in for the cluster CA: every simulated member has a real
Ed25519 key and a credential the authority signed, and the nodes check signatures
exactly as daemons do (core.mesh.identities); only the credential's format differs (no
X.509, which a thousand simulated members would spend most of their time parsing).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import random
import zlib
from collections.abc import Iterable, Mapping

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ciuic_p2p.config import MeshSection
from ciuic_p2p.core.mesh.broadcast import Delivery, Resumed
from ciuic_p2p.core.mesh.identities import Identities
from ciuic_p2p.core.mesh.members import MemberEvent, State
from ciuic_p2p.core.mesh.messages import Alive, signed_bytes
from ciuic_p2p.core.mesh.node import Delivered, MeshNode
from ciuic_p2p.emulator.model.netem import LinkModel, LinkParams
from ciuic_p2p.emulator.model.scenario import EmulatedNetwork, Scenario
from ciuic_p2p.emulator.model.simulator import VirtualNetwork
from ciuic_p2p.errors import AdmissionError
from ciuic_p2p.identity import NodeKey, verify_signature


class RegionNetwork:
    """Synthetic links between many members placed in a few cities."""

    def __init__(
        self,
        city_of: Mapping[str, str],
        city_rtt_s: Mapping[tuple[str, str], float],
        *,
        intra_city_rtt_s: float = 0.001,
        jitter_s: float = 0.0,
        loss: float = 0.0,
        seed: int = 0,
    ) -> None:
        self.city_of = dict(city_of)
        self.city_rtt_s = dict(city_rtt_s)
        self.intra_city_rtt_s = intra_city_rtt_s
        self.jitter_s, self.loss, self.seed = jitter_s, loss, seed
        self.links: dict[tuple[str, str], LinkModel] = {}
        self.down: set[str] = set()

    def _rtt(self, a: str, b: str) -> float:
        ca, cb = self.city_of[a], self.city_of[b]
        if ca == cb:
            return self.intra_city_rtt_s
        return self.city_rtt_s.get((ca, cb), self.city_rtt_s.get((cb, ca), 0.2))

    def transmit(self, src: str, dst: str, now: float, size: int) -> list[float]:
        if src in self.down or dst in self.down:
            return []
        link = self.links.get((src, dst))
        if link is None:
            params = LinkParams(
                delay_s=self._rtt(src, dst) / 2,
                jitter_s=self.jitter_s,
                jitter_dist="normal",
                reorder=False,
                loss=self.loss,
            )
            link = LinkModel(params, zlib.crc32(f"{self.seed}/{src}/{dst}".encode()))
            self.links[(src, dst)] = link
        return link.transmit(now, size)

    def next_change_at(self) -> float | None:
        return None

    def advance(self, now: float) -> None:
        return None


class SimAuthority:
    """The simulation's cluster authority (see the module docstring). Keys derive
    from ``seed`` and the name, so runs repeat; a credential is the member's raw public
    key and the authority's signature over the name and that key."""

    _DOMAIN = b"ciuic-sim-credential-v1\0"

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self.key = self._derive("authority")
        self._keys: dict[str, NodeKey] = {}
        self._checked: dict[tuple[str, bytes], bytes] = {}

    def _derive(self, name: str) -> NodeKey:
        secret = hashlib.blake2b(f"{self.seed}/{name}".encode(), digest_size=32).digest()
        return NodeKey(Ed25519PrivateKey.from_private_bytes(secret))

    def key_of(self, name: str) -> NodeKey:
        key = self._keys.get(name)
        if key is None:
            key = self._keys[name] = self._derive("member/" + name)
        return key

    def credential(self, name: str) -> bytes:
        public = self.key_of(name).public_key
        return public + self.key.sign(self._DOMAIN, name.encode(), public)

    def check(self, name: str, credential: bytes) -> bytes:
        """The member's public key, or AdmissionError. Memoized: every simulated node
        checks the same credentials, and the answer is a function of the bytes."""
        known = self._checked.get((name, credential))
        if known is not None:
            return known
        public, signature = credential[:32], credential[32:]
        if len(credential) != 96 or not verify_signature(
            self.key.public_key, signature, self._DOMAIN, name.encode(), public
        ):
            raise AdmissionError(f"credential of {name[:40]!r} not signed by the authority")
        self._checked[(name, credential)] = public
        return public

    def identities(self, name: str) -> Identities:
        return Identities(name, self.credential(name), self.key_of(name).sign, self.check)

    def signed_alive(self, name: str, incarnation: int = 0, address: str | None = None) -> Alive:
        unsigned = Alive(name, incarnation, name if address is None else address)
        signature = self.key_of(name).sign(signed_bytes(unsigned))
        return dataclasses.replace(unsigned, signature=signature)


class SimMesh:
    """MeshNodes named after the network's nodes, addressed by name."""

    def __init__(
        self,
        scenario: Scenario | None,
        settings: MeshSection,
        *,
        network: RegionNetwork | None = None,
        names: Iterable[str] | None = None,
        seed: int = 0,
    ) -> None:
        self.net = VirtualNetwork(scenario, network=network)
        self.names = (
            list(names)
            if names is not None
            else (scenario.node_names() if scenario is not None else [])
        )
        self.settings = settings
        self.seed = seed
        self.nodes: dict[str, MeshNode] = {}
        self.member_events: dict[str, list[MemberEvent]] = collections.defaultdict(list)
        """What each node said of its members (core.mesh.node's MemberEvent), in order."""
        self._deliveries: dict[str, list[Delivery]] = collections.defaultdict(list)
        self.authority = SimAuthority(seed)
        self.incarnations: dict[str, int] = {}
        self.regions = {n.name: n.region for n in scenario.nodes} if scenario is not None else {}

    @property
    def now(self) -> float:
        return self.net.now

    @property
    def emulated(self) -> EmulatedNetwork:
        assert isinstance(self.net.network, EmulatedNetwork)
        return self.net.network

    def start(
        self,
        name: str,
        join_through: str | None = None,
        resume: Mapping[str, Resumed] | None = None,
    ) -> MeshNode:
        """Start (or restart, with a fresh state and a higher incarnation) a node;
        ``resume``: what its previous life delivered (core.mesh.broadcast)."""
        incarnation = self.incarnations.get(name, -1) + 1
        self.incarnations[name] = incarnation
        node = MeshNode(
            name,
            name,
            self.settings,
            self.now,
            identities=self.authority.identities(name),
            region=self.regions.get(name, ""),
            incarnation=incarnation,
            seed=zlib.crc32(f"{self.seed}/{name}/{incarnation}".encode()),
            resume=resume,
        )
        self.nodes[name] = node
        self.member_events[name] = []
        self._deliveries[name] = []
        self.net.add(name, node)
        if join_through is not None and join_through != name:
            node.join(join_through, self.now)
            self.net.poke(name)
        return node

    def start_all(self, join_through: str | None = None) -> None:
        for name in self.names:
            self.start(name, join_through)

    def start_formed(self) -> None:
        """Every node up and already knowing every other (large simulations)."""
        for name in self.names:
            self.start(name)
        alive = [self.authority.signed_alive(n) for n in self.names]
        credentials = [(n, self.authority.credential(n)) for n in self.names]
        for node in self.nodes.values():
            for name, credential in credentials:
                node.learn_identity(name, credential)
            node.bootstrap(alive, self.now)
        self._drain()

    def kill(self, name: str) -> None:
        """Crash: the node stops at once, sending nothing more."""
        self.net.remove(name)
        self.nodes.pop(name, None)

    def run_for(self, seconds: float) -> None:
        self.net.run_until(self.now + seconds)
        self._drain()

    def _drain(self) -> None:
        """Read every node's events (the driver's job, as the daemon does)."""
        for name, node in self.nodes.items():
            while (event := node.next_event()) is not None:
                if isinstance(event, MemberEvent):
                    self.member_events[name].append(event)
                elif isinstance(event, Delivered):
                    self._deliveries[name].append(event.delivery)

    def take_deliveries(self, name: str) -> list[Delivery]:
        """The chunks ``name`` delivered since the last call, in order."""
        self._drain()
        out, self._deliveries[name] = self._deliveries[name], []
        return out

    def run_until_true(self, condition: object, limit_s: float, step_s: float = 0.05) -> float:
        """Advance in steps until ``condition()`` holds; the virtual time it took.
        Raises AssertionError past ``limit_s``."""
        assert callable(condition)
        start = self.now
        while not condition():
            if self.now - start > limit_s:
                raise AssertionError(f"condition not met within {limit_s} s of virtual time")
            self.run_for(step_s)
        return self.now - start

    def broadcast(
        self, origin: str, payload: bytes, round_id: object = None, round_bytes: int | None = None
    ) -> int:
        seq = self.nodes[origin].broadcast(payload, self.now, round_id, round_bytes)
        self.net.poke(origin)
        self._drain()
        return seq

    # -- what the nodes believe ------------------------------------------------------------

    def views(self) -> dict[str, list[str]]:
        return {n: node.view() for n, node in self.nodes.items()}

    def agree(self, expected: Iterable[str] | None = None) -> bool:
        """Every running node sees exactly the running nodes (or ``expected``) alive."""
        want = sorted(expected if expected is not None else self.nodes)
        return all(node.view() == want for node in self.nodes.values())

    def all_mark(self, victim: str, states: tuple[State, ...] = (State.DEAD,)) -> bool:
        return all(node.state_of(victim) in states for n, node in self.nodes.items() if n != victim)


def random_names(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [f"n{i:04d}-{rng.randrange(1 << 16):04x}" for i in range(count)]
