"""Daemon-level behaviour on the in-memory transport and virtual time: membership,
dissemination, the trainer socket and the store of nodes assembled as
``ciuic-node run`` assembles them, with the link protocol (auth, credit, ping, close)
the QUIC transport runs, and no real network or clock (tests/virtualtime.py)."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import os
from pathlib import Path

import pytest

from ciuic_p2p.config import Config
from ciuic_p2p.core.mesh.members import State
from ciuic_p2p.core.mesh.messages import Gossip, Message
from ciuic_p2p.core.mesh.planners import LARGE_PIECE_BYTES
from ciuic_p2p.core.replica.messages import PayloadKind
from tests.daemon.memorymesh import MemoryMesh, until
from tests.daemon.standin import StandInTrainer
from tests.virtualtime import run_virtual

NAMES = ["a", "b", "c", "d", "e"]


def test_members_join_agree_and_see_a_crash_and_a_leave(tmp_path: Path) -> None:
    async def main() -> None:
        mesh = MemoryMesh(tmp_path, NAMES)
        try:
            await mesh.form()
            # Every member knows every other's name (signed in its ALIVE) and shows it.
            for n in NAMES:
                known = mesh.nodes[n].daemon.mesh.members()
                assert {m.name for m in known.values()} == set(NAMES) - {n}
            listed = mesh.nodes["a"].daemon.status()["members"]
            assert sorted(m["name"] for m in listed) == ["b", "c", "d", "e"]
            crashed, leaver = mesh.nodes["d"].peer_id, mesh.nodes["e"].peer_id
            await mesh.crash("d")
            survivors = ["a", "b", "c", "e"]
            took = await until(
                lambda: all(
                    mesh.nodes[n].daemon.mesh.state_of(crashed) is State.DEAD for n in survivors
                ),
                30,
            )
            assert took < 10  # probes, suspicion, death: seconds of virtual time
            assert all(crashed in mesh.records[n].down for n in survivors)
            await mesh.nodes["e"].daemon.leave()
            del mesh.nodes["e"]
            await until(
                lambda: all(
                    mesh.nodes[n].daemon.mesh.state_of(leaver) is State.LEFT
                    for n in ["a", "b", "c"]
                ),
                10,
            )
            assert mesh.agree(["a", "b", "c"])
            counters = mesh.nodes["a"].daemon.counters
            assert counters["spoofed"] == 0 and counters["decode_errors"] == 0
        finally:
            await mesh.close()

    run_virtual(main())


@pytest.mark.parametrize("declared_dead", [False, True])
def test_a_restarted_node_s_link_state_is_taken_at_once(
    tmp_path: Path, declared_dead: bool
) -> None:
    """Review: a node's link-state version starts at 0 again when its daemon restarts.
    The others kept its previous life's version, and refused its new links until its
    count passed the old one (one version per 30 s refresh when nothing moves), with
    no links to pass back once they had forgotten them. Now a node forgets a departed
    member's version with its links, and a node that hears its own links at a version
    it has not reached publishes above it: back before or after it was declared dead,
    its new links are everyone's within seconds."""

    async def main() -> None:
        mesh = MemoryMesh(tmp_path, ["a", "b", "c"])
        try:
            await mesh.form()
            await asyncio.sleep(400)  # a life long enough for a dozen refreshes
            a = mesh.nodes["a"]
            key, peer = a.key, a.peer_id
            maps = {n: mesh.nodes[n].daemon.mesh.rttmap for n in ("b", "c")}
            assert all(m.versions[peer] >= 10 for m in maps.values())
            old = maps["c"].signed[peer]
            await mesh.crash("a")
            if declared_dead:
                await until(lambda: mesh.agree(["b", "c"]), 30)
                # Its links went with it, and a late sync's copy of them (c's, as c
                # would push it before it too declared a dead) does not bring them back.
                b, c = mesh.nodes["b"].daemon.mesh, mesh.nodes["c"].daemon
                late = Message(c.peer_id, Gossip((old,)))
                b.receive_message(c.address, late, asyncio.get_running_loop().time())
                assert all(peer not in m.published and peer not in m.signed for m in maps.values())
            restarted = await mesh.start("a", key)
            await restarted.daemon.join(mesh.nodes["b"].daemon.address)
            own = restarted.daemon.mesh.rttmap

            def taken() -> bool:
                mine = own.signed.get(peer)
                return mesh.agree() and all(
                    mine is not None and m.signed.get(peer) == mine for m in maps.values()
                )

            took = await until(taken, 60)
            assert took < 10  # seconds of virtual time, not versions x 30 s
            await until(lambda: len({m.digest() for m in [own, *maps.values()]}) == 1, 10)
        finally:
            await mesh.close()

    run_virtual(main())


def test_every_broadcast_reaches_every_member_exactly_once(tmp_path: Path) -> None:
    async def main() -> None:
        mesh = MemoryMesh(tmp_path, NAMES)
        try:
            await mesh.form()
            await asyncio.sleep(15)  # link state measured and spread: the trees agree
            sent = set()
            for name in NAMES:
                daemon = mesh.nodes[name].daemon
                for i in range(5):
                    sent.add((daemon.peer_id, daemon.broadcast(os.urandom(2000 + i))))

            def all_in() -> bool:
                return all(
                    {(d.origin, d.seq) for d in mesh.records[n].delivered}
                    >= {s for s in sent if s[0] != mesh.nodes[n].peer_id}
                    for n in NAMES
                )

            await until(all_in, 30)
            await asyncio.sleep(5)  # time for any duplicate to show
            for n in NAMES:
                seen = collections.Counter((d.origin, d.seq) for d in mesh.records[n].delivered)
                assert max(seen.values()) == 1
                assert len(seen) == 4 * 5
                assert mesh.records[n].traffic["received"] == 4 * 5
        finally:
            await mesh.close()

    run_virtual(main())


@pytest.mark.parametrize(
    ("strategy", "piece_bytes"), [("ring", 3000), ("hierarchical", 3000), ("ring", 100_000)]
)
def test_a_rounds_pieces_go_by_its_strategy_and_reach_every_member_once(
    tmp_path: Path, strategy: str, piece_bytes: int
) -> None:
    """Round pieces travel as ROUTED_CHUNK frames through real daemons (their kind
    checked against the frame's lane) and every relay follows the named strategy;
    large pieces as PLANNED_CHUNK frames, each relay following its origin's plan."""

    async def main() -> None:
        config = Config.lan()
        config = dataclasses.replace(
            config,
            mesh=dataclasses.replace(config.mesh, strategy=strategy),  # type: ignore[arg-type]
        )
        mesh = MemoryMesh(tmp_path, NAMES, config)
        try:
            await mesh.form()
            await asyncio.sleep(15)
            sent = set()
            for r in range(2):
                for name in NAMES:
                    d = mesh.nodes[name].daemon
                    for _ in range(2):
                        seq = d.broadcast(
                            os.urandom(piece_bytes), round_id=r, round_bytes=2 * piece_bytes
                        )
                        sent.add((d.peer_id, seq))

            def all_in() -> bool:
                return all(
                    {(d.origin, d.seq) for d in mesh.records[n].delivered}
                    >= {s for s in sent if s[0] != mesh.nodes[n].peer_id}
                    for n in NAMES
                )

            await until(all_in, 30)
            await asyncio.sleep(5)
            for n in NAMES:
                seen = collections.Counter((d.origin, d.seq) for d in mesh.records[n].delivered)
                assert max(seen.values()) == 1 and len(seen) == 4 * 4
                daemon = mesh.nodes[n].daemon
                assert daemon.counters["spoofed"] == 0
                assert daemon.status()["strategy"]["strategy"] == strategy
                kind = "PLANNED_CHUNK" if piece_bytes > LARGE_PIECE_BYTES else "ROUTED_CHUNK"
                assert daemon.mesh_bytes_sent[kind] > 0 or n == NAMES[-1]
                assert daemon.mesh.dissemination.plans_refused == 0
            hops = max(d.hops for n in NAMES for d in mesh.records[n].delivered)
            assert hops == (len(NAMES) - 2 if strategy == "ring" else hops)
        finally:
            await mesh.close()

    run_virtual(main())


def test_a_trainers_update_reaches_the_other_trainers_signed_and_once(tmp_path: Path) -> None:
    async def main() -> None:
        mesh = MemoryMesh(tmp_path, ["a", "b", "c"])
        trainers: dict[str, StandInTrainer] = {}
        try:
            await mesh.form()
            for n in ("a", "b", "c"):
                server = mesh.nodes[n].trainers
                assert server is not None
                trainers[n] = StandInTrainer(server)
                await trainers[n].attach()
            for step in (1, 2, 3):
                trainers["a"].publish(step)
            origin = mesh.nodes["a"].peer_id

            def updates(n: str) -> list[str]:
                return [p for p, kind, _ in trainers[n].delivered if kind is PayloadKind.UPDATE]

            await until(lambda: len(updates("b")) == 3 and len(updates("c")) == 3, 30)
            assert updates("b") == updates("c") == [origin] * 3
            assert updates("a") == []  # its own updates are not delivered back
            progress = mesh.nodes["b"].trainers.progress  # type: ignore[union-attr]
            assert progress.origins[origin].step == 3
        finally:
            for t in trainers.values():
                await t.close()
            await mesh.close()

    run_virtual(main())


def test_an_object_put_on_one_node_is_fetched_whole_by_another(tmp_path: Path) -> None:
    async def main() -> None:
        mesh = MemoryMesh(tmp_path, ["a", "b", "c"])
        try:
            await mesh.form()
            data = os.urandom(3 * 1024 * 1024 + 7)  # many pieces, over several windows
            manifest, held = await mesh.nodes["a"].store.put("shared/blob", data)
            assert manifest.version == 1 and len(held) >= 1  # replicated to a neighbour
            assert set(held) <= {mesh.nodes["b"].peer_id, mesh.nodes["c"].peer_id}
            got, fetch = await mesh.nodes["c"].store.get("shared/blob")
            assert got == data and fetch.version == 1
        finally:
            await mesh.close()

    run_virtual(main())


def test_a_trainer_gets_only_its_own_runs_chunks_never_an_ended_runs(tmp_path: Path) -> None:
    """Chunks held while b has no trainer go to the next trainer only if it trains
    their run; while attached, other runs' chunks are not delivered at all."""

    async def main() -> None:
        mesh = MemoryMesh(tmp_path, ["a", "b"])
        trainers: list[StandInTrainer] = []
        try:
            await mesh.form()
            a, b = (mesh.nodes[n].trainers for n in ("a", "b"))
            assert a is not None and b is not None
            old = StandInTrainer(a, run="ended-run")
            trainers.append(old)
            await old.attach()
            for step in (1, 2):  # b's trainer is not there: b holds them
                old.publish(step)
            counters = mesh.nodes["b"].daemon.counters
            await until(lambda: mesh.nodes["b"].daemon.counters["chunks_delivered"] >= 2, 30)
            new = StandInTrainer(b, run="new-run")
            trainers.append(new)
            await new.attach()
            other = StandInTrainer(a, run="new-run")  # a's trainer of the new run
            trainers.append(other)
            await old.close()
            await other.attach()
            other.publish(1)
            await until(lambda: len(new.delivered) >= 1, 30)
            assert [kind for _, kind, _ in new.delivered] == [PayloadKind.UPDATE]
            assert counters["deliveries_other_run"] >= 2  # the ended run's two chunks
        finally:
            for t in trainers:
                await t.close()
            await mesh.close()

    run_virtual(main())
