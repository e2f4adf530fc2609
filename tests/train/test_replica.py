"""The update rule (core.replica.rule) without any network: replicas hand each other
payloads directly, in any order, with duplicates and bad input."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import math
import random

import pytest
import torch

from ciuic_p2p.config import CodecSection, TrainSection
from ciuic_p2p.core.codec.bucket import BucketEncoder, BucketSpec, ChunkSource
from ciuic_p2p.core.codec.chunk import ChunkHeader, Codec, parse_chunk
from ciuic_p2p.core.codec.layout import BucketLayout
from ciuic_p2p.core.replica.messages import (
    PayloadKind,
    decode_payload,
    encode_done,
    encode_presence,
    envelope,
    run_id_of,
)
from ciuic_p2p.core.replica.rule import RefusedChunk, Replica, consensus_distance
from ciuic_p2p.lab.tasks import DigitsTask
from ciuic_p2p.train.hook import flatten_parameters
from ciuic_p2p.train.statesync import finals_of, reached_of

CODEC = CodecSection(density=0.05, dense_below_numel=0)
TRAIN = TrainSection(consensus_interval_steps=0, norm_warmup_chunks=3, influence_disagreement=0.0)
"""Without the direction weight: these tests' updates are random, uncorrelated between
replicas, where real ones agree (a running cosine of +0.2 between honest digits
replicas, bench/hostile.py); tests/hostile/test_training.py turns it on."""


def model(width: int = 64) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, width), torch.nn.ReLU(), torch.nn.Linear(width, 4)
    )


def replica(
    i: int,
    width: int = 64,
    run: str = "run",
    train: TrainSection = TRAIN,
    codec: CodecSection = CODEC,
) -> Replica:
    m = model(width)
    layout = BucketLayout.for_module(m, dense_below_numel=0)
    buckets = flatten_parameters(m, layout)
    source = ChunkSource(run_id_of(run), bytes([i + 1]) * 32, 0, layout.layout_id)
    return Replica(layout, buckets, source, f"p{i}", codec, train, seed=i)


def local_update(r: Replica, gen: torch.Generator, scale: float = 0.01) -> list[bytes]:
    """Move the parameters as an optimizer would; return the payloads if a send is due."""
    with torch.no_grad():
        for b in r.buckets:
            b.add_(torch.randn(b.shape, generator=gen) * scale)
    if r.local_step():
        return r.encode_update(r.take_update(), r.step)
    return []


def snapshot(r: Replica) -> list[torch.Tensor]:
    return [b.clone() for b in r.buckets]


def _introduce(reps: list[Replica]) -> None:
    names = [r.peer for r in reps]
    for r in reps:
        r.set_alive(names)
        for other in names:
            if other != r.peer:
                r.receive(other, encode_presence(PayloadKind.JOIN, run_id_of("run")))


def _deliver_tolerating_duplicates(
    reps: list[Replica], inbox: list[tuple[int, str, bytes]]
) -> None:
    for j, origin, p in inbox:
        try:
            reps[j].receive(origin, p)
        except RefusedChunk as exc:
            assert exc.reason == "duplicate"


def test_every_chunk_applies_exactly_once_in_any_order() -> None:
    reps = [replica(i) for i in range(3)]
    _introduce(reps)
    assert all(r.replicas == 3 for r in reps)
    gen = torch.Generator().manual_seed(1)
    rng = random.Random(2)
    sent: dict[str, int] = {}
    inbox: list[tuple[int, str, bytes]] = []
    for _ in range(40):
        for i, r in enumerate(reps):
            payloads = local_update(r, gen)
            sent[r.peer] = sent.get(r.peer, 0) + len(payloads)
            for p, j in itertools.product(payloads, range(3)):
                if j != i:
                    inbox.append((j, r.peer, p))
                    if rng.random() < 0.2:  # a duplicate, delivered again later
                        inbox.append((j, r.peer, p))
        rng.shuffle(inbox)
        _deliver_tolerating_duplicates(reps, inbox[: len(inbox) // 2])
        del inbox[: len(inbox) // 2]
    _deliver_tolerating_duplicates(reps, inbox)
    for r in reps:
        for origin, state in r.peers.items():
            assert state.applied == sent[origin]
        assert set(r.stats.refused) <= {"duplicate"}
        assert r.settle() == r.stats.chunks_sent  # every peer reached every own step
        assert not r._debts


def test_bad_chunks_are_refused_counted_and_change_nothing() -> None:
    me, peer = replica(0), replica(1)
    for r in (me, peer):
        r.set_alive(["p0", "p1"])
    gen = torch.Generator().manual_seed(3)
    for _ in range(5):  # warm the norm reference up
        local_update(me, gen)
    good = local_update(peer, gen)

    other_run = replica(2, run="another run")
    other_shape = replica(3, width=48)
    bad: dict[str, bytes] = {
        "other_run": local_update(other_run, gen)[0],
        "layout": local_update(other_shape, gen)[0],
        "malformed": envelope(PayloadKind.UPDATE) + b"\x00" * 200,
    }
    # A chunk of this layout for a bucket the model does not have.
    src = ChunkSource(run_id_of("run"), b"\x05" * 32, 0, me.layout.layout_id)
    enc = BucketEncoder(3, 100, BucketSpec(codec=Codec.SPARSE_INT8, exact=True), src)
    bad["range"] = envelope(PayloadKind.UPDATE) + enc.encode(torch.randn(100), 1)[0]
    # A faulty node's update: a hundred times this replica's own.
    loud = replica(4)
    loud.set_alive(["p0", "p4"])
    with torch.no_grad():
        loud.buckets[0].add_(torch.randn(loud.buckets[0].shape, generator=gen) * 100)
    loud.local_step()
    bad["norm"] = loud.encode_update(loud.take_update(), 1)[0]
    for reason, payload in bad.items():
        before = snapshot(me)
        with pytest.raises(RefusedChunk) as err:
            me.receive(f"bad-{reason}", payload)
        assert err.value.reason == reason, str(err.value)
        assert all(torch.equal(a, b) for a, b in zip(before, me.buckets, strict=True))
        assert me.stats.refused[reason] == 1
    me.receive("p1", encode_done(run_id_of("another run"), 5, 1))  # runs share a mesh:
    assert me.stats.other_runs == 1 and "p1" not in me.peers  # ignored
    for p in good:  # and training goes on
        me.receive("p1", p)
    assert me.peers["p1"].applied == len(good) > 0


def test_the_residual_stays_bounded_over_a_training_run() -> None:
    task = DigitsTask()
    torch.manual_seed(0)
    m = task.model()
    layout = BucketLayout.for_module(m, dense_below_numel=0)
    buckets = flatten_parameters(m, layout)
    source = ChunkSource(run_id_of("r"), b"\x01" * 32, 0, layout.layout_id)
    codec = CodecSection(density=0.01, dense_below_numel=0)
    r = Replica(layout, buckets, source, "p0", codec, TRAIN)
    opt = task.optimizer(list(m.parameters()))
    gen = torch.Generator().manual_seed(0)
    norms = []
    for _ in range(300):
        loss = task.loss(m, task.batch(0, 1, gen))
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        assert r.local_step()
        r.encode_update(r.take_update(), r.step)
        norms.append(r.stats.residual_norm)
    param_norm = float(torch.linalg.vector_norm(buckets[0]))
    assert all(torch.isfinite(torch.tensor(norms)))
    assert max(norms[200:]) <= 1.5 * max(norms[100:200])  # not growing
    assert max(norms) < 0.5 * param_norm
    assert task.evaluate(m)[1] > 0.9  # and it learnt, through the residual


def test_the_consensus_mix_pulls_drifted_replicas_together() -> None:
    train = dataclasses.replace(
        TRAIN, consensus_interval_steps=1, consensus_mix=0.5, consensus_fragments=1
    )
    a, b = replica(0, train=train), replica(1, train=train)
    for r in (a, b):
        r.set_alive(["p0", "p1"])
    with torch.no_grad():  # b lost chunks: its parameters drifted
        b.buckets[0].add_(torch.randn(b.buckets[0].shape) * 0.05)
    start = consensus_distance([a.buckets, b.buckets])
    for _ in range(3):
        pa = a.encode_params(a.snapshot_params(), a.step)
        pb = b.encode_params(b.snapshot_params(), b.step)
        for p in pb:
            a.receive("p1", p)
        for p in pa:
            b.receive("p0", p)
        a.step += 1
        b.step += 1
    end = consensus_distance([a.buckets, b.buckets])
    assert end < 0.05 * start
    assert a.stats.params_mixed == b.stats.params_mixed == 3


def test_staleness_bound_waits_for_the_slowest_live_replica() -> None:
    train = dataclasses.replace(TRAIN, staleness_bound_steps=4, max_send_interval_steps=2)
    me, slow = replica(0, train=train), replica(1, train=train)
    me.set_alive(["p0", "p1", "p2"])
    slow.set_alive(["p0", "p1"])
    me.receive("p1", encode_presence(PayloadKind.JOIN, run_id_of("run")))  # p2 trains nothing
    assert me.replicas == 2
    gen = torch.Generator().manual_seed(5)
    for _ in range(3):
        local_update(me, gen)
    assert me.blocking() == []
    local_update(me, gen)
    assert me.blocking() == ["p1"]  # step 5 would be 5 ahead of p1, which sent nothing
    for p in local_update(slow, gen):
        me.receive("p1", p)
    assert me.blocking() == []
    for _ in range(4):
        local_update(me, gen)
    assert me.blocking() == ["p1"]
    me.receive("p1", encode_done(run_id_of("run"), slow.step, slow.stats.chunks_sent))
    assert me.blocking() == []  # a finished replica holds nobody back
    me.set_alive(["p0"])
    assert me.replicas == 1 and me.weight == 1.0


def test_replicas_are_the_members_that_train_this_run() -> None:
    me = replica(0)
    me.set_alive(["p0", "p1", "p2", "p3"])
    run = run_id_of("run")
    me.receive("p1", encode_presence(PayloadKind.JOIN, run))
    me.receive("p2", encode_presence(PayloadKind.JOIN, run_id_of("another run")))  # ignored
    assert sorted(me.peers) == ["p1"] and me.replicas == 2 and me.joined == ["p1"]
    me.receive("p1", encode_presence(PayloadKind.GONE, run))  # its trainer went away
    assert me.peers == {} and me.replicas == 1
    gen = torch.Generator().manual_seed(6)
    late = replica(1)
    late.set_alive(["p0", "p1"])
    for p in local_update(late, gen):  # a chunk it sent before going: applied, and it
        me.receive("p1", p)  # does not come back as a replica
    assert me.peers == {} and me.stats.applied == 1
    me.receive("p1", encode_presence(PayloadKind.JOIN, run))  # a restarted trainer does
    me.receive("p4", encode_presence(PayloadKind.JOIN, run))  # not a live member: ignored
    assert sorted(me.peers) == ["p1"]


def test_backlog_merges_steps_and_lowers_density_then_recovers() -> None:
    r = replica(0)
    r.adapt(TRAIN.backlog_high_bytes + 1)
    r.adapt(TRAIN.backlog_high_bytes + 1)
    assert r.send_interval == 4 and r.density == pytest.approx(CODEC.density / 4)
    for _ in range(5):
        r.adapt(0)
    assert r.send_interval == 1 and r.density == CODEC.density


class _DelayedMesh:
    """Two live replicas and a joiner, c, whose chunks travel with a per-pair delay in
    steps; c hears chunks once its daemon is in, and applies them once restored."""

    def __init__(
        self,
        a: Replica,
        b: Replica,
        c: Replica,
        delay: dict[tuple[str, str], int],
        gen: torch.Generator,
    ) -> None:
        self.everyone = (a, b, c)
        self.joiner = c
        self.delay = delay
        self.gen = gen
        self.live = [a, b]
        self.pending: list[tuple[int, Replica, str, bytes]] = []
        self.joiner_in_mesh = False
        self.restored = False

    def _reaches(self, other: Replica) -> bool:
        return other in self.live or (other is self.joiner and self.joiner_in_mesh)

    def step_all(self, now: int) -> None:
        for r in self.live:
            for p in local_update(r, self.gen):
                for other in self.everyone:
                    if other is not r and self._reaches(other):
                        at = now + self.delay[(r.peer, other.peer)]
                        self.pending.append((at, other, r.peer, p))
        due = [
            x for x in self.pending if x[0] <= now and (x[1] is not self.joiner or self.restored)
        ]
        for item in due:
            self.pending.remove(item)
            item[1].receive(item[2], item[3])
        for r in self.live:
            r.settle()


def test_a_joiner_and_a_membership_change_seen_at_different_steps_leave_no_drift() -> None:
    """Replicas that applied the same chunks hold the same shared parameters, even
    when they counted a joiner at different steps and the joiner started from one of
    them mid-run (its unsent residual and unsettled chunks left out of the state)."""
    run = run_id_of("run")
    gen = torch.Generator().manual_seed(11)
    a, b, c = replica(0), replica(1), replica(2)
    with torch.no_grad():  # the joiner's own weights: all replaced by the state
        for bucket in c.buckets:
            bucket.normal_(generator=gen)
    for r in (a, b):
        r.set_alive(["p0", "p1"])
    a.receive("p1", encode_presence(PayloadKind.JOIN, run))
    b.receive("p0", encode_presence(PayloadKind.JOIN, run))
    delay = {("p0", "p1"): 2, ("p1", "p0"): 3, ("p0", "p2"): 1, ("p1", "p2"): 4,
             ("p2", "p0"): 2, ("p2", "p1"): 5}  # fmt: skip
    mesh = _DelayedMesh(a, b, c, delay, gen)
    for now in range(30):
        mesh.step_all(now)
    mesh.joiner_in_mesh = True  # its daemon is in: chunks reach it from now on
    for r in (a, b, c):
        r.set_alive(["p0", "p1", "p2"])
    mesh.pending.append((32, a, "p2", encode_presence(PayloadKind.JOIN, run)))
    mesh.pending.append((35, b, "p2", encode_presence(PayloadKind.JOIN, run)))  # b: later
    for now in range(30, 34):
        mesh.step_all(now)
    # b answers the joiner's JOIN with its own, to everyone: it reaches a before b's
    # last chunks do, and claims a step that a has not applied yet.
    a.receive("p1", encode_presence(PayloadKind.JOIN, run, step=b.step))
    assert a.peers["p1"].step == b.step > a.applied_steps()["p1"]
    # The state a hands over (with the encoder idle, as the hook does).
    for mine, donors in zip(c.buckets, a.shared_params(), strict=True):
        mine.copy_(donors)
    c.start_at(a.step, a.applied_steps())
    for origin in ("p0", "p1"):
        c.receive(origin, encode_presence(PayloadKind.JOIN, run))
    mesh.restored = True
    mesh.live.append(c)
    for now in range(34, 70):
        mesh.step_all(now)
    assert a.replicas == b.replicas == c.replicas == 3
    for _, to, origin, p in sorted(mesh.pending, key=lambda x: x[0]):
        to.receive(origin, p)
    for r in mesh.live:
        r.settle(everything=True)
    assert c.stats.before_state > 0  # its state held chunks that reached it too
    shared = [[t.clone() for t in r.shared_params()] for r in mesh.live]
    assert consensus_distance(shared) < 1e-5, [
        consensus_distance([shared[i], shared[j]]) for i, j in ((0, 1), (0, 2), (1, 2))
    ]


def test_updates_kept_while_a_joiner_restores_are_dropped_by_header_or_applied_once() -> None:
    """A joiner keeps the updates that arrive before its state is restored: those the
    state holds (up to its floor) are counted held by the state without decoding; the
    others are applied after the restore, once, and each tells the origin's step."""
    donor, joiner = replica(0), replica(1)
    for r in (donor, joiner):
        r.set_alive(["p0", "p1"])
    gen = torch.Generator().manual_seed(3)
    payloads: dict[int, list[bytes]] = {}
    for _ in range(8):
        out = local_update(donor, gen)
        if out:
            payloads[donor.step] = out
    assert sorted(payloads) == list(range(1, 9))
    for out in payloads.values():
        for p in out:
            joiner.register("p0", p)
    assert joiner.peers["p0"].step == 8  # what the restore decision reads
    # The donor's state at step 4 (its own updates up to 4 in it), as a joiner restores it.
    for b, value in zip(joiner.buckets, donor.buckets, strict=True):
        b.copy_(value)
    joiner.start_at(4, {"p0": 4})
    before = snapshot(joiner)
    held = applied = 0
    for step in sorted(payloads):
        for p in payloads[step]:
            if joiner.held_by_state("p0", p):
                assert step <= 4
                held += 1
            else:
                assert step > 4
                joiner.receive("p0", p)
                applied += 1
    joiner.settle(everything=True)
    assert held == sum(len(payloads[s]) for s in range(1, 5)) and applied > 0
    peer = joiner.peers["p0"]
    assert (peer.held_by_state, peer.applied) == (held, applied)
    assert joiner.stats.before_state == held
    assert any(not torch.equal(a, b) for a, b in zip(before, joiner.buckets, strict=True))
    # Nothing of another run, and nothing malformed, is taken for held.
    other = replica(2, run="other")
    other.set_alive(["p0", "p1", "p2"])
    assert not joiner.held_by_state("p0", local_update(other, gen)[0])
    assert not joiner.held_by_state("p0", b"garbage")


def test_a_join_that_comes_before_the_member_is_known_alive_is_taken_when_it_is() -> None:
    """The daemon tells its trainer who is alive on a timer, so a new member's JOIN can
    come first; it used to be dropped, and a replica that had attached said no more
    (a three-way attach then waited out its timeout)."""
    r = replica(0)
    r.set_alive(["p0"])
    r.receive("p1", encode_presence(PayloadKind.JOIN, run_id_of("run"), 7, True))
    assert r.replicas == 1 and "p1" not in r.peers
    r.set_alive(["p0", "p1"])
    assert r.replicas == 2
    assert r.peers["p1"].reported and r.peers["p1"].step == 7 and r.joined == ["p1"]
    assert r.early_joins == {}


def test_what_an_origin_sends_while_not_listed_alive_still_adds_up_to_its_done() -> None:
    """A restarted daemon's first member list holds only itself, and gossip can lag the
    chunks it delivers: an origin's chunks applied meanwhile were left out of its
    account, so finish() compared a short count with its DONE and returned False (1
    run in 4 of tests/train/test_daemon_restart.py), though every chunk was applied."""
    me, peer = replica(0), replica(1)
    me.set_alive(["p0", "p1"])
    peer.set_alive(["p0", "p1"])
    gen = torch.Generator().manual_seed(11)
    sent = 0

    def deliver(rounds: int) -> None:
        nonlocal sent
        for _ in range(rounds):
            for payload in local_update(peer, gen):
                me.receive("p1", payload)
                sent += 1

    deliver(3)
    me.set_alive(["p0"])  # the new daemon's first list: p1 not (yet) alive here
    deliver(3)
    me.receive("p1", encode_done(run_id_of("run"), peer.step, peer.stats.chunks_sent))
    me.set_alive(["p0", "p1"])  # gossip catches up
    deliver(3)
    p1 = me.peers["p1"]
    assert sent == peer.stats.chunks_sent > 0 and me.stats.applied_from["p1"] == sent
    assert p1.applied == sent, "chunks applied while p1 was not listed were not accounted"
    assert p1.done_at is not None and p1.chunks_sent > 0


def test_a_replica_whose_daemon_restarts_keeps_counting_the_replicas_it_had() -> None:
    """Its new daemon's first member list holds itself alone: N fell to 1, and the
    chunks that claimed it were kept at weight 1 by their origin and taken at 1/2 by
    the others (they count the replicas heard within the bound), apart for good. The
    replicas it had count until each is heard again, or twice the bound after."""
    me, a, b = replica(0), replica(1), replica(2)
    _introduce([me, a, b])
    assert me.replicas == 3
    me.daemon_lost()
    me.step = 100
    me.daemon_back()
    me.set_alive(["p0"])  # the new daemon's first list
    assert me.replicas == 3 and me.take_update().replicas == 3
    me.set_alive(["p0", "p1", "p2"])
    me.receive("p1", encode_presence(PayloadKind.JOIN, run_id_of("run"), 100))
    me.local_step()
    assert me.replicas == 3  # p1 registered again, p2 still cut off
    me.set_alive(["p0", "p1"])  # p2 died meanwhile: it counts until the grace ends
    assert me.replicas == 3
    for _ in range(2 * TRAIN.staleness_bound_steps):
        me.local_step()
    assert me.replicas == 2


def test_an_own_chunk_is_settled_at_the_weight_its_receivers_give_it() -> None:
    """A chunk claims the N its origin counted; every receiver takes it at 1 over
    that, or over one less than the replicas it heard around its step if more. The
    origin read that count when it sent the chunk; it now reads it when it settles,
    once the others' chunks of those steps have come (a replica back from a restart
    had heard none, and kept its claim-of-1 chunks at 1 where the others took 1/2)."""
    me, a, b = replica(0), replica(1), replica(2)
    for r in (me, a, b):
        r.set_alive(["p0", "p1", "p2"])
    gen = torch.Generator().manual_seed(4)
    me.set_alive(["p0"])  # me counts itself alone when it takes its update
    mine = local_update(me, gen)
    assert mine
    (step, claimed, *_), *_ = me._debts
    assert claimed == 1 and me._own_weight(step, claimed) == 1.0  # heard no one yet
    a_sent = local_update(a, gen)
    for payload in a_sent:
        me.receive("p1", payload)  # a and b were there all along
    for payload in local_update(b, gen):
        me.receive("p2", payload)
        a.receive("p2", payload)
    for payload in mine:
        a.receive("p0", payload)
    assert a.chunk_weight(_header(mine[0])) == 0.5  # a counts p1 (itself), p2, p0
    assert me._own_weight(step, claimed) == 0.5  # and so does me, when it settles
    before = snapshot(me)
    owed = 0.5 * sum(float(d[6].abs().sum()) for d in me._debts)
    owed_chunks = len(me._debts)
    assert me.settle(everything=True) == owed_chunks
    moved = sum(float((x - y).abs().sum()) for x, y in zip(me.buckets, before, strict=True))
    assert moved == pytest.approx(owed, rel=1e-4) and not me._debts  # 1 - 1/2 taken back


def _header(payload: bytes) -> ChunkHeader:
    return parse_chunk(decode_payload(payload).body)[0]


def test_the_consensus_bound_holds_parameters_against_parameters() -> None:
    """Near convergence a replica's own updates are tiny; a peer's parameters that
    drifted by a little of their scale are still mixed, garbage is not."""
    train = dataclasses.replace(
        TRAIN, consensus_interval_steps=1, consensus_fragments=1, norm_warmup_chunks=1
    )
    a, b = replica(0, train=train), replica(1, train=train)
    for r in (a, b):
        r.set_alive(["p0", "p1"])
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):  # converged: updates of 1e-6, so 50x the own updates is 5e-5
        local_update(a, gen, scale=1e-6)
    rms = float(torch.linalg.vector_norm(a.buckets[0])) / math.sqrt(a.buckets[0].numel())
    with torch.no_grad():  # b drifted by 2% of the parameters' scale (lost chunks)
        b.buckets[0].add_(torch.randn(b.buckets[0].shape, generator=gen) * 0.02 * rms)
    a.encode_params(a.snapshot_params(), a.step)  # a's own fragment of this step
    for p in b.encode_params(b.snapshot_params(), a.step):
        a.receive("p1", p)
    assert a.stats.params_mixed == 1 and not a.stats.refused

    for garbage in (3.0, 0.0):  # a faulty node: blown-up parameters, or zeros
        a.step += 1
        a.encode_params(a.snapshot_params(), a.step)
        with torch.no_grad():
            b.buckets[0].copy_(a.buckets[0] * garbage)
        with pytest.raises(RefusedChunk, match="RMS away"):
            for p in b.encode_params(b.snapshot_params(), a.step):
                a.receive("p1", p)
    assert a.stats.refused["norm"] == 2 and a.stats.params_mixed == 1

    # Where this replica's parameters are all zero and no floor exists yet, a peer
    # cannot move them at all (a zero-initialised bias is no licence for 1e18).
    fresh = dataclasses.replace(train, norm_warmup_chunks=100)
    c, d = replica(2, train=fresh), replica(3, train=fresh)
    for r in (c, d):
        r.set_alive(["p2", "p3"])
        with torch.no_grad():
            r.buckets[0].zero_()
    c.encode_params(c.snapshot_params(), c.step)
    with torch.no_grad():
        d.buckets[0].fill_(1e18)
    with pytest.raises(RefusedChunk, match="RMS away"):
        for p in d.encode_params(d.snapshot_params(), c.step):
            c.receive("p3", p)
    assert float(c.buckets[0].abs().max()) == 0.0


def test_a_fragment_of_a_step_this_replica_kept_none_of_is_not_mixed_nor_refused() -> None:
    """A peer's consensus fragment of a step whose own fragment this replica no longer
    holds (it joined since, or the peer's is older than the two it keeps) has nothing
    to be compared with: it is counted unmatched and leaves the parameters alone. It
    used to be held against the parameters of now, which refused an honest replica's
    late fragment (CI: outer mode, 'norm' refusals beside a late joiner)."""
    train = dataclasses.replace(TRAIN, consensus_interval_steps=1, consensus_fragments=1)
    a, b = replica(0, train=train), replica(1, train=train)
    for r in (a, b):
        r.set_alive(["p0", "p1"])
    late = b.encode_params(b.snapshot_params(), 0)  # b's fragment of step 0, sent late
    with torch.no_grad():  # a trained on, far from where both were at step 0
        a.buckets[0].mul_(-3.0)
    for step in (5, 6):  # a keeps its fragments of its last two rounds only
        a.step = step
        a.encode_params(a.snapshot_params(), step)
    before = [t.clone() for t in a.buckets]
    for p in late:
        a.receive("p1", p)
    assert a.stats.params_unmatched == len(late) and not a.stats.refused
    assert a.stats.params_mixed == 0
    assert all(torch.equal(x, y) for x, y in zip(before, a.buckets, strict=True))
    # The same fragment held against a's own of its step is still refused when far.
    a.step = 7
    a.encode_params(a.snapshot_params(), 7)
    with pytest.raises(RefusedChunk, match="RMS away"):
        for p in b.encode_params(b.snapshot_params(), 7):
            a.receive("p1", p)


@pytest.mark.parametrize("dense", [True, False])
def test_the_last_update_dense_leaves_the_replicas_equal_but_for_rounding(dense: bool) -> None:
    """The run's last update carries what error feedback held back, dense INT8: the
    replicas' parameters (live, residuals included) end equal up to its rounding.
    Sparse like every other, each replica keeps its own residual apart."""
    reps = [replica(i) for i in range(3)]
    _introduce(reps)
    gen = torch.Generator().manual_seed(5)

    def deliver(payloads: list[bytes], origin: Replica) -> None:
        for r in reps:
            if r is not origin:
                for p in payloads:
                    r.receive(origin.peer, p)

    for _ in range(30):
        for r in reps:
            deliver(local_update(r, gen), r)
    # Sparse, the last step's send was the last (as finish() did before).
    finals = [(r, r.encode_update(r.take_final(), dense=True)) for r in reps if dense]
    for r, payloads in finals:
        deliver(payloads, r)
        # Stamped past the last send, as covering the steps it holds.
        assert {parse_chunk(decode_payload(p).body)[0].step for p in payloads} == {r.step + 16}
    for r in reps:
        r.settle(everything=True)
        assert not r._debts
        assert r.stats.refused == {}
    distance = consensus_distance([snapshot(r) for r in reps])
    if dense:
        assert distance < 2e-3, distance  # INT8 rounding of the residuals
    else:
        assert distance > 2e-2, distance  # the residuals: 10x and more


def test_a_run_resumed_after_its_last_dense_update_takes_every_later_update() -> None:
    """The last update is stamped past the last step: a state handed after it names
    both, so a run resumed from it takes its peers' updates of the steps up to the
    stamp (the stamps as floors dropped 16 steps of them) and still drops the last
    update itself when it comes again."""
    reps = [replica(i) for i in range(2)]
    _introduce(reps)
    gen = torch.Generator().manual_seed(5)
    run = run_id_of("run")
    finals: dict[str, list[bytes]] = {}
    for _ in range(30):
        for r in reps:
            for p in local_update(r, gen):
                reps[1 - reps.index(r)].receive(r.peer, p)
    for i, r in enumerate(reps):
        finals[r.peer] = r.encode_update(r.take_final(), dense=True)
        other = reps[1 - i]
        for p in finals[r.peer]:
            other.receive(r.peer, p)
        other.receive(r.peer, encode_done(run, r.step, r.stats.chunks_sent))
    for r in reps:
        r.settle(everything=True)
    metas = [json.loads(json.dumps(r.state_meta())) for r in reps]  # as it travels
    assert metas[0]["finals"] == {"p0": [30, 46], "p1": [30, 46]}
    resumed = [replica(i) for i in range(2)]
    for r, old, meta in zip(resumed, reps, metas, strict=True):
        r.start_at(old.step, meta["applied"], None, finals_of(meta["finals"], 64))
    _introduce(resumed)
    a, b = resumed
    for p in finals["p1"]:  # the old last update, delivered again (a repair)
        a.receive("p1", p)
    assert a.stats.before_state == len(finals["p1"])
    sent = []
    for _ in range(20):
        sent += local_update(b, gen)
    for p in sent:
        a.receive("p1", p)
    assert a.stats.applied == len(sent)  # steps 31 to 50: none held by the state
    assert a.stats.before_state == len(finals["p1"])


def test_the_norm_bound_holds_a_chunk_against_the_replicas_not_only_this_ones() -> None:
    """A replica whose own updates ran small (here a hundredth of the others') held
    an honest peer's chunk against its own RMS alone and refused it; the bound is the
    lower median of the replicas' running RMS when that is more. A member's loud
    chunks do not raise it: the median stays an honest replica's."""
    quiet, b, c, liar = replica(0), replica(1), replica(2), replica(3)
    names = ["p0", "p1", "p2", "p3"]
    for r in (quiet, b, c, liar):
        r.set_alive(names)
    gen = torch.Generator().manual_seed(7)
    for _ in range(12):  # past the warm-up
        local_update(quiet, gen, scale=0.0001)
    # The peers' chunks as the quiet replica hears them: refused while their running
    # RMS warms up (as every chunk was before), taken from then on.
    for r, name in ((b, "p1"), (c, "p2")):
        for _ in range(6):
            for p in local_update(r, gen):
                with contextlib.suppress(RefusedChunk):
                    quiet.receive(name, p)
    warming = quiet.stats.refused.get("norm", 0)
    applied = quiet.stats.applied
    for _ in range(10):
        for r, name in ((b, "p1"), (c, "p2")):
            for p in local_update(r, gen):
                quiet.receive(name, p)
    assert quiet.stats.applied > applied and quiet.stats.refused.get("norm", 0) == warming
    own = quiet.norms.rms[0]
    honest = quiet.intake.influence.origins["p1"].chunk_rms[0][0]
    assert honest > 50 * own  # held against its own alone, every one was refused
    # A member whose chunks are a hundred times an honest peer's: still refused.
    with torch.no_grad():
        for bucket in liar.buckets:
            bucket.add_(torch.randn(bucket.shape, generator=gen) * 100)
    liar.local_step()
    for p in liar.encode_update(liar.take_update(), 1):
        with pytest.raises(RefusedChunk) as err:
            quiet.receive("p3", p)
        assert err.value.reason == "norm"
    assert quiet.intake.rms_reference(0) == pytest.approx(
        sorted(
            [own] + [quiet.intake.influence.origins[n].chunk_rms[0][0] for n in ("p1", "p2", "p3")]
        )[1]
    )


def test_the_last_update_of_a_replica_the_bound_ahead_is_taken() -> None:
    """A replica the staleness bound ahead of the others ends its run: its last update
    (what error feedback held back) is stamped within the slowest replica's window, and
    taken there, not refused as past the run's window (one in a few runs of
    tests/train/test_training.py refused it: step 166 past a window up to 162). A step
    far past the window still is."""
    slow, mid, fast = reps = [replica(i) for i in range(3)]
    _introduce(reps)
    gen = torch.Generator().manual_seed(9)
    for r in (slow, mid):
        local_update(r, gen)
    bound = TRAIN.staleness_bound_steps
    sent = []
    for _ in range(bound):
        sent += local_update(fast, gen)
    sent += fast.encode_update(fast.take_final(), dense=True)
    # Stamped past its last send, within the slowest's window (step 0 as it knows it).
    assert bound < _header(sent[-1]).step <= bound + 1
    for p in sent:
        slow.receive(fast.peer, p)
    assert not slow.stats.refused and slow.stats.applied_from[fast.peer] == len(sent)
    local_update(fast, gen)
    far = fast.encode_update(fast.take_update(), step=4 * bound)
    with pytest.raises(RefusedChunk) as refused:
        slow.receive(fast.peer, far[0])
    assert refused.value.reason == "pace"


def test_a_replica_restored_under_a_daemon_that_stayed_counts_what_its_state_holds() -> None:
    """A trainer restarted under a daemon that stayed never gets again the chunks that
    daemon delivered to its earlier life: counted on arrival, an origin's chunks in the
    state fell short of its DONE, and finish() returned False for good. The state says
    how many of each origin's chunks it holds, and how many of its newest step (the
    writer had 1 of that step's chunks: the others, arriving later, are counted)."""
    codec = dataclasses.replace(CODEC, chunk_payload_bytes=4096, density=0.5)
    writer, me, origin = (replica(i, width=1024, codec=codec) for i in range(3))
    _introduce([writer, me, origin])
    gen = torch.Generator().manual_seed(5)
    sends = [local_update(origin, gen) for _ in range(6)]
    assert all(len(s) >= 2 for s in sends)  # several chunks a step: a step can be partial
    for payloads in sends[:5]:
        for payload in payloads:
            writer.receive("p2", payload)
    writer.receive("p2", sends[5][0])
    meta = json.loads(json.dumps(writer.state_meta()))  # as a state carries it
    assert meta["reached"]["p2"] == [sum(map(len, sends[:5])) + 1, 1]
    me.start_at(
        writer.step, meta["applied"], None, finals_of(meta["finals"], 64),
        reached_of(meta["reached"]),
    )  # fmt: skip
    for payloads in sends[3:]:  # what came after its earlier life: steps 4 to 6
        for payload in payloads:
            me.receive("p2", payload)
    for _ in range(3):
        for payload in local_update(origin, gen):
            me.receive("p2", payload)
    me.receive("p2", encode_done(run_id_of("run"), origin.step, origin.stats.chunks_sent))
    p2 = me.peers["p2"]
    assert p2.applied + p2.held_by_state == origin.stats.chunks_sent
    assert p2.held_by_state == sum(map(len, sends[:6]))
