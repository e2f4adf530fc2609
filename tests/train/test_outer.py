"""The outer-step mode (core.replica.outer) without any network: replicas hand each
other their rounds directly, early, late and out of order, and end where DiLoCo's
outer step, computed in closed form, puts them."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from ciuic_p2p.config import CodecSection, TrainSection, config_from_mapping
from ciuic_p2p.core.codec.bucket import ChunkSource
from ciuic_p2p.core.codec.layout import BucketLayout
from ciuic_p2p.core.replica.messages import PayloadKind, encode_presence, run_id_of
from ciuic_p2p.core.replica.outer import OuterStep
from ciuic_p2p.core.replica.rule import RefusedChunk, Replica
from ciuic_p2p.core.store.statefile import pack_state, unpack_state
from ciuic_p2p.errors import ConfigError
from ciuic_p2p.train.hook import flatten_parameters
from tests.train.test_replica import _introduce

H = 4
DENSE = CodecSection(dense_below_numel=1 << 30, dense_dtype="fp32")
"""Every bucket dense fp32: chunks carry the progress exactly, so replicas must agree
to float rounding."""
SPARSE = CodecSection(density=0.05, dense_below_numel=0, value_mode="int2")
NESTEROV = TrainSection(
    mode="outer",
    inner_steps=H,
    outer_optimizer="nesterov",
    outer_lr=0.7,
    outer_momentum=0.9,
    consensus_interval_steps=0,
    norm_warmup_chunks=3,
    staleness_bound_steps=4 * H,
    influence_disagreement=0.0,  # random updates: see tests/train/test_replica.py's TRAIN
)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _replica(i: int, codec: CodecSection, train: TrainSection, incarnation: int = 0) -> Replica:
    m = _model()
    layout = BucketLayout.for_module(m, dense_below_numel=codec.dense_below_numel)
    buckets = flatten_parameters(m, layout)
    source = ChunkSource(run_id_of("run"), bytes([i + 1]) * 32, incarnation, layout.layout_id)
    return Replica(layout, buckets, source, f"p{i}", codec, train, seed=i)


def _progress(i: int, step: int, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """What replica i's optimizer does at ``step``: fixed, so a closed form exists."""
    gen = torch.Generator().manual_seed(1000 * i + step)
    return [torch.randn(b.shape, generator=gen) * 0.01 for b in like]


class _Mesh:
    """Replicas stepping in lockstep; each payload waits a random number of steps,
    so rounds arrive early (a peer ahead), on time and late (after the round was
    complete at the receiver)."""

    def __init__(self, reps: list[Replica], seed: int, max_delay_steps: int) -> None:
        self.reps = reps
        self.rng = random.Random(seed)
        self.max_delay = max_delay_steps
        self.queue: list[tuple[int, int, str, bytes]] = []
        self.now = 0

    def step(self, steps: int) -> None:
        for _ in range(steps):
            self.now += 1
            for i, r in enumerate(self.reps):
                with torch.no_grad():
                    for b, d in zip(r.buckets, _progress(i, r.step + 1, r.buckets), strict=True):
                        b.add_(d)
                if r.local_step():
                    for p in r.encode_update(r.take_update()):
                        for j in range(len(self.reps)):
                            if j != i:
                                at = self.now + self.rng.randint(0, self.max_delay)
                                self.queue.append((at, j, r.peer, p))
            self.deliver(self.now)
            for r in self.reps:
                r.settle()

    def deliver(self, until: int) -> None:
        due = [q for q in self.queue if q[0] <= until]
        self.queue = [q for q in self.queue if q[0] > until]
        self.rng.shuffle(due)
        for _, j, origin, p in due:
            self.reps[j].receive(origin, p)

    def drain(self) -> None:
        self.deliver(1 << 30)
        for r in self.reps:
            r.settle(everything=True)


def _diloco(
    start: list[torch.Tensor], nodes: int, rounds: int, lr: float, mu: float
) -> list[torch.Tensor]:
    """DiLoCo's outer Nesterov step in closed form: each round r the mean progress
    D_r; m_r = mu m_{r-1} + D_r; the anchor moves by lr (D_r + mu m_r). One round late
    or not, once every round is in, this is where every replica must be."""
    anchor = [b.clone() for b in start]
    m = [torch.zeros_like(b) for b in start]
    for r in range(1, rounds + 1):
        mean = [torch.zeros_like(b) for b in start]
        for i in range(nodes):
            for step in range((r - 1) * H + 1, r * H + 1):
                for acc, d in zip(mean, _progress(i, step, start), strict=True):
                    acc.add_(d, alpha=1.0 / nodes)
        for a, mm, d in zip(anchor, m, mean, strict=True):
            mm.mul_(mu).add_(d)
            a.add_(d + mu * mm, alpha=lr)
    return anchor


@pytest.mark.parametrize("delay", [0, 3, 2 * H])
def test_nesterov_rounds_in_any_arrival_order_end_where_diloco_does(delay: int) -> None:
    reps = [_replica(i, DENSE, NESTEROV) for i in range(3)]
    _introduce(reps)
    start = [b.clone() for b in reps[0].buckets]
    mesh = _Mesh(reps, seed=delay, max_delay_steps=delay)
    mesh.step(6 * H)
    mesh.drain()
    want = _diloco(start, 3, 6, lr=0.7, mu=0.9)
    for r in reps:
        r.flush(wait=True)
        assert r.outer is not None and r.outer.rounds_completed == 6
        for got, exp in zip(r.buckets, want, strict=True):
            torch.testing.assert_close(got, exp, rtol=1e-4, atol=1e-5)


def test_averaging_at_lr_one_is_the_step_rule_sent_every_h_steps() -> None:
    outer = dataclasses.replace(NESTEROV, outer_optimizer="average", outer_lr=1.0)
    step = dataclasses.replace(outer, mode="step", send_interval_steps=H)
    ends = []
    for train in (outer, step):
        reps = [_replica(i, SPARSE, train) for i in range(3)]
        _introduce(reps)
        mesh = _Mesh(reps, seed=5, max_delay_steps=3)
        mesh.step(5 * H)
        mesh.drain()
        for r in reps:
            r.flush(wait=True)
        ends.append([b.clone() for b in reps[1].buckets])
    for a, b in zip(*ends, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_sparse_low_bit_rounds_keep_replicas_together() -> None:
    """Top-k at 5% and 2-bit values: the replicas differ only by their residuals.
    Without the influence clip's default ratio: these random rounds' norms swing past
    twice their median, and a round clipped at one receiver and not another leaves
    them apart until the consensus step (off here) brings them back together."""
    train = dataclasses.replace(NESTEROV, influence_clip_ratio=8.0)
    reps = [_replica(i, SPARSE, train) for i in range(3)]
    _introduce(reps)
    mesh = _Mesh(reps, seed=9, max_delay_steps=H)
    mesh.step(8 * H)
    mesh.drain()
    shared = []
    for r in reps:
        r.flush(wait=True)
        shared.append(torch.cat([b.flatten() for b in r.shared_params()]))
    scale = float(shared[0].norm())
    for other in shared[1:]:
        assert float((other - shared[0]).norm()) < 1e-4 * scale
    assert all(r.stats.refused.total() == 0 for r in reps)


def test_a_replica_restarted_from_a_peers_state_rejoins_the_outer_step() -> None:
    """Checkpoints and state sync carry the momentum: a replica that restarts from
    another's packed state ends where the others do."""
    reps = [_replica(i, DENSE, NESTEROV) for i in range(3)]
    _introduce(reps)
    start = [b.clone() for b in reps[0].buckets]
    mesh = _Mesh(reps, seed=1, max_delay_steps=0)
    mesh.step(3 * H)
    mesh.drain()
    donor = reps[0]
    fresh = _restored_from(donor, 2, NESTEROV)
    reps[2] = fresh
    _introduce(reps)
    mesh.step(3 * H)
    mesh.drain()
    want = _diloco(start, 3, 6, lr=0.7, mu=0.9)
    for r in reps:
        r.flush(wait=True)
        for got, exp in zip(r.buckets, want, strict=True):
            torch.testing.assert_close(got, exp, rtol=1e-4, atol=1e-5)


def _restored_from(donor: Replica, i: int, train: TrainSection) -> Replica:
    """Replica ``i`` in a new life, started from ``donor``'s packed state (tensors and
    meta, through the state file as a joiner gets it)."""
    donor.flush(wait=True)
    blob, _ = pack_state(
        donor.layout.layout_id,
        donor.shared_params(),
        meta=donor.state_meta(),
        momentum=donor.shared_momentum(),
    )
    fresh = _replica(i, DENSE, train, incarnation=1)
    assert fresh.outer is not None
    meta = unpack_state(blob, fresh.layout.layout_id, fresh.buckets, momentum=fresh.outer.buffers)
    fresh.start_at(donor.step, meta["applied"], meta.get("next_round"))
    return fresh


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("extra_steps", [0, 2])
def test_a_joiner_from_a_state_packed_mid_round_ends_beside_the_others(
    seed: int, extra_steps: int
) -> None:
    """The donor's rounds are not all complete when it packs its state (its peers'
    last rounds are still on the way): the joiner takes the donor's round count with
    the state, gets every chunk the donor had not applied yet, and ends where the
    others do (dense chunks: to float rounding)."""
    reps = [_replica(i, DENSE, NESTEROV) for i in range(3)]
    _introduce(reps)
    mesh = _Mesh(reps, seed=seed, max_delay_steps=H)
    mesh.step(3 * H + extra_steps)
    donor = reps[0]
    assert donor.outer is not None
    assert extra_steps or donor.outer.next_round <= 3  # round 3 is on the way
    joiner = _restored_from(donor, 3, NESTEROV)
    mesh.queue += [(at, 3, o, p) for at, j, o, p in mesh.queue if j == 0]
    reps.append(joiner)
    _introduce(reps)
    for r in reps[:3]:
        r.receive(joiner.peer, encode_presence(PayloadKind.JOIN, run_id_of("run"), step=donor.step))
    mesh.step(4 * H - extra_steps)
    mesh.drain()
    shared = []
    for r in reps:
        r.flush(wait=True)
        shared.append(torch.cat([b.flatten() for b in r.shared_params()]))
    scale = float(shared[0].norm())
    for other in shared[1:]:
        assert float((other - shared[0]).norm()) < 1e-5 * scale


def test_a_peer_rounds_ahead_moves_the_parameters_by_its_own_weight_only() -> None:
    """One replica is silent for six rounds (its trainer still restoring), so no round
    completes at the others: each chunk from a peer rounds ahead moves a replica by
    ``lr (1 + mu) w`` of it and no more (its momentum part waits for its round), and
    once the silent replica's rounds arrive every replica is at DiLoCo's anchor."""
    train = dataclasses.replace(NESTEROV, outer_momentum=0.5, staleness_bound_steps=8 * H)
    reps = [_replica(i, DENSE, train) for i in range(3)]
    _introduce(reps)
    start = [b.clone() for b in reps[0].buckets]
    a, b, silent = reps
    sent: list[bytes] = []
    lr, mu = train.outer_lr, train.outer_momentum
    for _ in range(6 * H):
        for i, r in ((0, a), (1, b)):
            with torch.no_grad():
                for t, d in zip(r.buckets, _progress(i, r.step + 1, r.buckets), strict=True):
                    t.add_(d)
        due = a.local_step()
        assert b.local_step() == due
        own = [t.clone() for t in a.buckets]
        if due:
            a_out = a.encode_update(a.take_update())
            for p in b.encode_update(b.take_update()):
                a.receive(b.peer, p)
            sent += a_out
            a.settle()
            a.flush(wait=True)
            # B's whole round in full: lr (1 + mu) / N of it, nothing else moved.
            moved = torch.cat([(x - y).flatten() for x, y in zip(a.buckets, own, strict=True)])
            round_b = torch.cat(
                [
                    sum(
                        (_progress(1, s, start)[k] for s in range(a.step - H + 1, a.step + 1)),
                        torch.zeros_like(start[k]),
                    ).flatten()
                    for k in range(len(start))
                ]
            )
            torch.testing.assert_close(moved, round_b * lr * (1 + mu) / 3, rtol=1e-4, atol=1e-6)
    assert a.outer is not None and a.outer.next_round == 1 and len(a.outer.deferred) > 0
    # The silent replica catches up: its six rounds, and A's and B's, reach everyone.
    for _ in range(6 * H):
        with torch.no_grad():
            for t, d in zip(silent.buckets, _progress(2, silent.step + 1, start), strict=True):
                t.add_(d)
        if silent.local_step():
            for p in silent.encode_update(silent.take_update()):
                a.receive(silent.peer, p)
                b.receive(silent.peer, p)
    for p in sent:
        silent.receive(a.peer, p)
    for r in reps:
        r.settle(everything=True)
        r.flush(wait=True)
    want = _diloco(start, 3, 6, lr=lr, mu=mu)
    for got, exp in zip(a.buckets, want, strict=True):
        torch.testing.assert_close(got, exp, rtol=1e-4, atol=1e-5)


def test_a_silent_replica_restored_from_a_peer_rounds_ahead_ends_beside_it() -> None:
    """The silent replica of the test above restores instead (as a trainer that
    attached late does): the donor's state is packed while B's rounds wait in its
    momentum list and its own rounds are unsettled; the three end together."""
    train = dataclasses.replace(NESTEROV, outer_momentum=0.5, staleness_bound_steps=8 * H)
    reps = [_replica(i, DENSE, train) for i in range(3)]
    _introduce(reps)
    a, b, _ = reps
    mesh = _Mesh(reps[:2], seed=3, max_delay_steps=1)
    mesh.step(6 * H + 1)
    assert a.outer is not None and a.outer.next_round == 1 and a.outer.deferred
    joiner = _restored_from(a, 2, train)
    mesh.queue += [(at, 2, o, p) for at, j, o, p in mesh.queue if j == 0]
    mesh.reps = reps = [a, b, joiner]
    _introduce(reps)
    for r in (a, b):
        r.receive(joiner.peer, encode_presence(PayloadKind.JOIN, run_id_of("run"), step=a.step))
    mesh.step(3 * H - 1)
    mesh.drain()
    shared = []
    for r in reps:
        r.flush(wait=True)
        shared.append(torch.cat([t.flatten() for t in r.shared_params()]))
    scale = float(shared[0].norm())
    for other in shared[1:]:
        assert float((other - shared[0]).norm()) < 1e-5 * scale


def test_coefficients_give_every_chunk_the_same_total_weight() -> None:
    """A chunk of round s added when round n is next: its immediate coefficient plus
    the kicks it then gets sum to DiLoCo's total weight for round s, whatever n (the
    kick of the last round completed is held for the next round, which never comes)."""
    lr, mu, rounds = 0.7, 0.9, 12
    train = dataclasses.replace(NESTEROV, outer_lr=lr, outer_momentum=mu)
    s = 5
    want = lr * (1 + mu) + lr * mu * mu * sum(mu ** (r - s) for r in range(s, rounds))
    for n in range(1, rounds + 1):
        o = OuterStep([torch.zeros(1)], train)
        o.next_round = n
        total = o.coefficient(s * H)
        o.record(0, 0, None, torch.ones(1), 1.0, s * H)
        for kick in o.complete_through(rounds * H):
            total += float(kick.values[0])
        assert total == pytest.approx(want, rel=1e-6)  # fp32 buffers


def test_outer_mode_config_rules() -> None:
    cfg = config_from_mapping({"train": {"mode": "outer", "inner_steps": 30}})
    assert cfg.train.mode == "outer" and cfg.train.staleness_bound_steps >= 60
    for bad in (
        {"mode": "outer", "inner_steps": 40},  # bound 64 < 2 x 40
        {"mode": "rounds"},
        {"outer_momentum": 1.0},
        {"outer_lr": 0.0},
        {"inner_steps": 0},
    ):
        with pytest.raises(ConfigError):
            config_from_mapping({"train": bad})


def test_backlog_lowers_the_density_but_never_changes_the_round_length() -> None:
    r = _replica(0, SPARSE, NESTEROV)
    high, _ = r.backlog_marks()
    r.adapt(int(high) + 1)
    assert r.send_interval == H and r.density == SPARSE.density / 2
    r.adapt(0)
    assert r.send_interval == H and r.density == SPARSE.density


def test_a_chunk_claiming_a_far_future_round_is_refused_before_anything_changes() -> None:
    """A member's claimed step is range-checked: the outer coefficients raise the
    momentum to the power of the rounds ahead, and no live peer can be further ahead
    than the staleness bound."""
    me, peer = _replica(0, DENSE, NESTEROV), _replica(1, DENSE, NESTEROV)
    _introduce([me, peer])
    with torch.no_grad():
        for b in peer.buckets:
            b.add_(0.01)
    far = peer.encode_update(peer.take_update(), step=1 << 40)
    before = [b.clone() for b in me.buckets]
    assert me.outer is not None
    momentum = [m.clone() for m in me.outer.buffers]
    for p in far:
        with pytest.raises(RefusedChunk) as exc:
            me.receive("p1", p)
        assert exc.value.reason == "range"
    me.flush(wait=True)
    assert all(torch.equal(a, b) for a, b in zip(me.buckets, before, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(me.outer.buffers, momentum, strict=True))
    assert me.stats.refused["range"] == len(far)


def test_a_states_round_count_past_the_staleness_bound_is_not_followed() -> None:
    """A donor's ``next_round`` is range-checked: no live replica's rounds stay open
    further back than the staleness bound and a round."""
    r = _replica(0, DENSE, NESTEROV)
    assert r.outer is not None
    latest = 100 // H + 1
    r.start_at(100, {}, next_round=latest - 2)
    assert r.outer.next_round == latest - 2
    for bad in (1, 0, -5, latest + 1):
        r.start_at(100, {}, next_round=bad)
        assert r.outer.next_round == latest
