"""A member that attracts traffic and drops it, on the simulator (issue 44, point 5).

:class:`LyingRelay` is a member with a valid credential: its node runs the protocol as
any other (it probes and answers probes honestly, so the others measure their true RTT
to it), but it signs its link state with every RTT at ``rtt_scale`` of what it measured,
and it sends no copy of another origin's chunk (neither tree copies nor repair answers).
:func:`relay_run` plays the 11-city matrix with it, honest or attacking, and reports what
the honest nodes got: the delivery lags of honest origins' chunks at honest nodes and in
how many honest origins' trees the member relays. The test and the benchmark share it.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass, field

from ciuic_p2p.config import MeshSection
from ciuic_p2p.core.mesh.messages import (
    Ack,
    Chunk,
    Gossip,
    Links,
    Message,
    Ping,
    Sync,
    Update,
    encode_message,
    signed_bytes,
)
from ciuic_p2p.core.mesh.node import MeshNode
from ciuic_p2p.data import scenario_path
from ciuic_p2p.emulator.meshsim import SimMesh
from ciuic_p2p.emulator.scenarios import load_scenario
from ciuic_p2p.identity import NodeKey

LIAR = "Chicago"
"""A relay in a few honest trees when it tells the truth (central on the matrix)."""


class LyingRelay:
    """The simulator's endpoint for a hostile member (see the module docstring)."""

    def __init__(self, node: MeshNode, key: NodeKey, rtt_scale: float = 0.01) -> None:
        self.node, self.key, self.rtt_scale = node, key, rtt_scale
        self.dropped = 0
        """Copies of others' chunks it did not send."""
        self.lies = 0
        """Versions of its link state it signed with the RTTs scaled down."""
        self._forged: dict[tuple[int, bytes], Links] = {}

    def receive_datagram(self, src: str, data: bytes, now: float) -> None:
        self.node.receive_datagram(src, data, now)

    def get_timer(self) -> float | None:
        return self.node.get_timer()

    def handle_timer(self, now: float) -> None:
        self.node.handle_timer(now)

    def datagrams_to_send(self, now: float) -> list[tuple[str, bytes]]:
        out = []
        for address, msg in self.node.messages_to_send():
            body = msg.body
            if isinstance(body, Chunk) and body.origin != self.node.node:
                self.dropped += 1
                continue
            if isinstance(body, Ping | Ack | Gossip | Sync):
                forged = tuple(self._forge(u) for u in body.updates)
                body = dataclasses.replace(body, updates=forged)
            out.append((address, encode_message(Message(msg.sender, body))))
        return out

    def _forge(self, u: Update) -> Update:
        if not isinstance(u, Links) or u.origin != self.node.node:
            return u
        key = (u.version, u.signature)
        forged = self._forged.get(key)
        if forged is None:
            entries = tuple(
                dataclasses.replace(e, rtt_us=max(1, round(e.rtt_us * self.rtt_scale)))
                for e in u.entries
            )
            unsigned = dataclasses.replace(u, entries=entries, signature=b"")
            forged = dataclasses.replace(unsigned, signature=self.key.sign(signed_bytes(unsigned)))
            self._forged[key] = forged
            self.lies += 1
        return forged


@dataclass
class RelayRun:
    lags_s: list[float] = field(default_factory=list)
    """From an honest origin's broadcast to each honest node's delivery, per chunk."""
    liar_relays: int = 0
    """Honest origins whose tree (as the origin plans it) gives the member children."""
    honest_origins: int = 0
    undelivered: int = 0
    """Honest chunks an honest node had not delivered at the end."""
    dropped: int = 0
    lies: int = 0
    refused_claims: int = 0
    """Link claims of the member an honest node's map does not take (summed)."""
    distrusted_honest: int = 0
    """Honest relays an honest node stopped counting on (false alarms)."""

    def p(self, q: float) -> float:
        return statistics.quantiles(self.lags_s, n=100, method="inclusive")[round(q * 100) - 1]

    def summary(self) -> dict[str, float | int]:
        return {
            "delivery_p50_ms": round(self.p(0.5) * 1000, 1),
            "delivery_p90_ms": round(self.p(0.9) * 1000, 1),
            "liar_relay_trees": self.liar_relays,
            "honest_trees": self.honest_origins,
            "undelivered": self.undelivered,
            "copies_dropped": self.dropped,
            "refused_claims": self.refused_claims,
            "honest_relays_distrusted": self.distrusted_honest,
        }


def relay_run(
    attack: bool,
    *,
    liar: str = LIAR,
    seed: int = 5,
    learn_s: float = 20.0,
    measure_s: float = 20.0,
    interval_s: float = 0.5,
    settings: MeshSection | None = None,
) -> RelayRun:
    """The 11-city matrix with ``liar`` honest (``attack`` False) or lying and dropping:
    formed and measured for 15 s, then every honest origin broadcasts a 1 KiB chunk
    every ``interval_s``, for ``learn_s`` (not counted) and then ``measure_s`` (the lags
    counted); what is still missing 10 s later counts as undelivered."""
    scenario = load_scenario(scenario_path("cities11"))
    sim = SimMesh(scenario, settings or MeshSection(), seed=seed)
    sim.start_all(join_through="Tokyo")
    relay: LyingRelay | None = None
    if attack:
        relay = LyingRelay(sim.nodes[liar], sim.authority.key_of(liar))
        sim.net.add(liar, relay)
    sim.run_until_true(sim.agree, limit_s=20)
    sim.run_for(15.0)
    honest = [n for n in sim.names if n != liar]
    sent: dict[tuple[str, int], float] = {}
    run = RelayRun(honest_origins=len(honest))
    step = interval_s / len(honest)
    rounds = round((learn_s + measure_s) / interval_s)
    start = sim.now
    for r in range(rounds):
        for i, origin in enumerate(honest):
            sim.run_for(max(0.0, start + r * interval_s + i * step - sim.now))
            seq = sim.broadcast(origin, bytes([r % 251, i]) * 512)
            if r * interval_s >= learn_s:
                sent[(origin, seq)] = sim.now
    sim.run_for(10.0)
    got: set[tuple[str, str, int]] = set()
    for name in honest:
        for d in sim.take_deliveries(name):
            published = sent.get((d.origin, d.seq))
            if published is not None:
                run.lags_s.append(d.at - published)
                got.add((name, d.origin, d.seq))
    run.undelivered = sum(
        1 for (o, q) in sent for name in honest if name != o and (name, o, q) not in got
    )
    run.liar_relays = sum(1 for o in honest if sim.nodes[o].tree(o).get(liar))
    run.refused_claims = sum(sim.nodes[n].refused_claims(liar) for n in honest)
    run.distrusted_honest = sum(
        1 for n in honest for r in sim.nodes[n].distrusted_relays() if r != liar
    )
    if relay is not None:
        run.dropped, run.lies = relay.dropped, relay.lies
    return run
