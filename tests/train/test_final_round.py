"""The run's last round (core.replica.final) without any network: replicas hand each
other their copies directly, in any order, some before the receiver's own round."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

from ciuic_p2p.config import FinishAverage
from ciuic_p2p.core.codec.chunk import Codec, build_chunk, parse_chunk
from ciuic_p2p.core.replica import final as final_module
from ciuic_p2p.core.replica.final import FINAL_DTYPES, FinalRound, copy_dtype
from ciuic_p2p.core.replica.messages import (
    PayloadKind,
    decode_payload,
    encode_done,
    envelope,
    run_id_of,
)
from ciuic_p2p.core.replica.rule import RefusedChunk, Replica, consensus_distance
from tests.train.test_replica import TRAIN, _introduce, local_update, replica, snapshot


def _trained(count: int, train: object = TRAIN) -> list[Replica]:
    """``count`` replicas 30 sparse steps in, every update delivered, each DONE heard:
    apart by their residuals, as finish() leaves them before its last round."""
    reps = [replica(i, train=train) for i in range(count)]  # type: ignore[arg-type]
    _introduce(reps)
    gen = torch.Generator().manual_seed(5)
    for _ in range(30):
        for r in reps:
            # A hundredth of the parameters' RMS a step: apart by a few % at the end.
            for p in local_update(r, gen, scale=0.001):
                for other in reps:
                    if other is not r:
                        other.receive(r.peer, p)
    for r in reps:
        for other in reps:
            if other is not r:
                other.receive(r.peer, encode_done(run_id_of("run"), r.step, r.stats.chunks_sent))
    for r in reps:
        r.settle(everything=True)
    return reps


def _start(r: Replica, members: list[str]) -> list[bytes]:
    """Start ``r``'s last round; the payloads of its copy, as it published them."""
    published: list[bytes] = []
    r.start_final(members, published.append)
    return published


def _offer(r: Replica, origin: str, payloads: list[bytes]) -> list[str]:
    """Hand ``r`` a peer's copy; the reasons of the chunks it refused."""
    refused = []
    for p in payloads:
        try:
            r.receive(origin, p)
        except RefusedChunk as exc:
            refused.append(exc.reason)
    return refused


@pytest.mark.parametrize(
    ("dtype", "codec"),
    [("fp16", Codec.DENSE_FP16), ("bf16", Codec.DENSE_BF16), ("fp32", Codec.DENSE_FP32)],
)
def test_the_last_round_ends_every_replica_at_the_mean_of_the_same_copies(
    dtype: FinishAverage, codec: Codec
) -> None:
    reps = _trained(3, dataclasses.replace(TRAIN, finish_average=dtype))
    for r in reps:
        r.fold_final()  # the base brought up to the peers' updates added
    progress = [[b - base for b, base in zip(r.buckets, r.base, strict=True)] for r in reps]
    before = consensus_distance([snapshot(r) for r in reps])
    assert before > 1e-2, before  # the residuals keep them apart
    # The first replica starts its round last: the others' copies reach it early.
    copies = {r.peer: _start(r, [o.peer for o in reps]) for r in reps[1:]}
    assert all(not r.final_complete for r in reps[1:])
    rng = random.Random(3)
    inbox = [(r, origin, p) for r in reps for origin, ps in copies.items() for p in ps]
    inbox = [item for item in inbox if item[0].peer != item[1]]
    rng.shuffle(inbox)
    for r, origin, p in inbox:
        r.receive(origin, p)
    copies[reps[0].peer] = _start(reps[0], [o.peer for o in reps])
    for r in reps[1:]:
        assert _offer(r, reps[0].peer, copies[reps[0].peer]) == []
    summaries = []
    for r in reps:
        assert r.final_complete
        summaries.append(r.end_final())
    for s in summaries:
        assert s is not None and s.complete and s.members == 3 and s.missing == []
        assert s.refused == {} and s.counted_otherwise == []
        assert 0.0 < s.distance_max < 0.2
    after = [snapshot(r) for r in reps]
    assert consensus_distance(after) < 1e-6
    # The mean of the fp16 copies as sent, each replica's own included.
    sent = [[torch.zeros_like(b) for b in reps[0].buckets] for _ in reps]
    for i, r in enumerate(reps):
        for p in copies[r.peer]:
            h, _ = parse_chunk(decode_payload(p).body)
            assert h.codec is codec and h.replicas == 3
            values = torch.frombuffer(bytearray(_values(p)), dtype=FINAL_DTYPES[dtype]).float()
            sent[i][h.bucket][h.range_start : h.range_start + h.range_len] = values
    for b, bucket in enumerate(after[0]):
        mean = torch.stack([s[b] for s in sent]).mean(0)
        assert torch.allclose(bucket, mean, rtol=0, atol=1e-6)
    # The progress not yet sent is unchanged by the round: it moved the base too.
    for r, kept in zip(reps, progress, strict=True):
        for bucket, base, diff in zip(r.buckets, r.base, kept, strict=True):
            assert torch.allclose(bucket - base, diff, rtol=0, atol=1e-6)


def _values(payload: bytes) -> bytes:
    _, body = parse_chunk(decode_payload(payload).body)
    return bytes(body)


def test_a_member_moves_a_replica_only_within_the_bound() -> None:
    """A member's copy far from this replica's is refused, chunk by chunk; one just
    inside the bound moves it at most the bound over the number of copies."""
    ratio = 0.2
    train = dataclasses.replace(TRAIN, finish_average_distance_max_ratio=ratio)
    a, b, liar = _trained(3, train)
    names = [a.peer, b.peer, liar.peer]
    with torch.no_grad():
        for bucket in liar.buckets:  # three times its parameters: 2 RMS away
            bucket.mul_(3.0)
    far = _start(liar, names)
    copy_a, copy_b = _start(a, names), _start(b, names)
    copies = {a.peer: snapshot(a), b.peer: snapshot(b)}  # each its own copy, as sent
    for r, other, copy in ((a, b, copy_b), (b, a, copy_a)):
        assert set(_offer(r, liar.peer, far)) == {"norm"}
        assert _offer(r, other.peer, copy) == []
        summary = r.end_final()
        assert summary is not None and not summary.complete and summary.missing == [liar.peer]
        assert summary.refused == {"norm": len(far)}
    # Both end at the mean of the two copies they took, not short of it.
    for r in (a, b):
        for bucket, mine, theirs in zip(r.buckets, copies[a.peer], copies[b.peer], strict=True):
            assert torch.allclose(bucket, (mine + theirs) / 2, rtol=0, atol=1e-6)

    # Just inside: the copy pushed along a direction to 0.95 of the bound.
    a, b, liar = _trained(3, train)
    gen = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for bucket, mine in zip(liar.buckets, a.buckets, strict=True):
            push = torch.randn(bucket.shape, generator=gen)
            rms = float(mine.norm()) / math.sqrt(mine.numel())
            bucket.copy_(
                mine + push * (0.95 * ratio * rms / float(push.norm()) * mine.numel() ** 0.5)
            )
    own = snapshot(a)
    _start(a, names)
    assert _offer(a, liar.peer, _start(liar, names)) == []
    assert _offer(a, b.peer, _start(b, names)) == []
    for before, after in zip(own, snapshot(a), strict=True):
        rms = float(before.norm()) / math.sqrt(before.numel())
        moved = float((after - before).norm()) / math.sqrt(before.numel())
        # The liar's share (a third of 0.95 of the bound) plus b's honest one.
        assert moved < ratio * rms / 3 + 0.05 * rms


def test_copies_that_do_not_belong_to_the_round_are_refused() -> None:
    a, b, c = _trained(3)
    stranger = replica(7)
    early = _start(stranger, [a.peer])
    # Before a's round: not a replica of this run, so not held.
    assert set(_offer(a, stranger.peer, early[:1])) == {"final_member"}
    copy_b = _start(b, [a.peer, b.peer, c.peer])
    _start(a, [a.peer, b.peer])  # c's DONE not heard here: a member count of 2
    assert _offer(a, b.peer, copy_b) == []
    assert set(_offer(a, b.peer, copy_b[:2])) == {"duplicate"}  # a range taken twice
    assert set(_offer(a, c.peer, _start(c, [a.peer, b.peer, c.peer])[:1])) == {"final_member"}
    summary = a.end_final()
    assert summary is not None and summary.complete
    assert summary.counted_otherwise == [b.peer]  # b averages three copies, a two
    assert set(_offer(a, b.peer, copy_b[:1])) == {"late"}
    # A copy is dense: a sparse chunk as FINAL is malformed.
    for _ in range(4):
        sparse = local_update(c, torch.Generator().manual_seed(1))
    fake = envelope(PayloadKind.FINAL) + bytes(decode_payload(sparse[0]).body)
    assert _offer(b, c.peer, [fake]) == ["malformed"]


def test_early_copies_are_held_to_one_model_per_replica() -> None:
    a, b = _trained(2)
    copy_b = _start(b, [a.peer, b.peer])
    assert _offer(a, b.peer, copy_b) == []  # held: a has not started its round
    assert set(_offer(a, b.peer, copy_b[:1])) == {"duplicate"}  # the same chunk again
    bucket = next(i for i, x in enumerate(a.buckets) if x.numel() >= 2048)
    tail = a.buckets[bucket].numel() - 1  # another chunking of a bucket's tail
    more = _copy_chunk(b, bucket, 1, tail, envelope(PayloadKind.FINAL))
    assert _offer(a, b.peer, [more]) == ["range"]  # past one model's worth
    _start(a, [a.peer, b.peer])
    assert a.final_complete


def test_the_copy_dtype_keeps_what_fp16_cannot_hold() -> None:
    assert copy_dtype(torch.ones(4), torch.float16) == torch.float16
    assert copy_dtype(torch.full((4,), 7e4), torch.float16) == torch.bfloat16
    assert copy_dtype(torch.ones(4, dtype=torch.bfloat16), torch.float16) == torch.bfloat16
    assert copy_dtype(torch.ones(4, dtype=torch.float16), torch.float32) == torch.float16
    assert copy_dtype(torch.ones(4), torch.float32) == torch.float32


def test_a_round_counts_its_members_once() -> None:
    own = [torch.zeros(8, dtype=torch.float16)]
    final = FinalRound(own, ["p1", "p2", "p1"], 0.2)
    assert final.count == 3 and not final.complete
    assert final.missing() == ["p1", "p2"]


def test_a_sharded_ranks_parts_of_a_chunk_are_held_as_one_range_and_taken_together() -> None:
    """A sharded rank's pieces of one bucket: a big one of weights and a small one of
    biases. A peer's chunk over both is held against the own copy as one range: its
    bias part alone is 50% away (its weights part 1%), the chunk 5%: taken. A chunk of
    which one part overlaps a range taken is refused whole, nothing recorded."""
    weights = torch.ones(1000, dtype=torch.float16)
    biases = torch.ones(10, dtype=torch.float16)
    final = FinalRound([weights, biases], ["p"], 0.2, buckets=[0, 0])
    theirs = [(0, 0, torch.full((500,), 1.01)), (1, 0, torch.full((5,), 1.5))]
    diffs = final.take_parts("p", theirs)
    assert [d.numel() for d in diffs] == [500, 5] and final.distance_max < 0.2
    again = [(0, 500, torch.full((500,), 1.01)), (1, 4, torch.full((6,), 1.0))]
    with pytest.raises(final_module.FinalRefusal) as refused:
        final.take_parts("p", again)  # biases [4, 5) taken already
    assert refused.value.reason == "duplicate" and final.received["p"] == 505
    final.take_parts("p", [(0, 500, torch.full((500,), 1.0)), (1, 5, torch.full((5,), 1.0))])
    assert final.complete
    # Part by part, the bias part would have been refused: 50% of its own RMS.
    alone = FinalRound([biases], ["p"], 0.2)
    with pytest.raises(final_module.FinalRefusal):
        alone.take("p", 0, 0, torch.full((10,), 1.5))


def _copy_chunk(r: Replica, bucket: int, start: int, length: int, base: bytes) -> bytes:
    """A FINAL payload of ``r``'s copy of ``bucket[start : start + length]`` (a
    member's own chunking), its header built like an honest one's."""
    enc = r.encoders[bucket]
    values = r.buckets[bucket][start : start + length].detach().to(torch.float16)
    header = enc._header(Codec.DENSE_FP16, r.step, start, length, length)
    return base + bytes(build_chunk(header, [values.numpy().tobytes()]))


def test_a_member_cannot_make_a_replica_hold_or_track_tiny_pieces(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Copies in pieces no honest replica sends are refused, held early or not; a
    piece delivered twice before the round does not take its member's place; a
    member's disjoint pieces are tracked up to a bound."""
    a, b = _trained(2)
    env = envelope(PayloadKind.FINAL)
    bucket = next(i for i, x in enumerate(a.buckets) if x.numel() >= 2048)
    assert _offer(a, b.peer, [_copy_chunk(b, bucket, 0, 0, env)]) == ["malformed"]
    assert _offer(a, b.peer, [_copy_chunk(b, bucket, 0, 10, env)]) == ["malformed"]
    copy = _start(b, [a.peer, b.peer])
    assert _offer(a, b.peer, copy) == []  # held early
    assert set(_offer(a, b.peer, copy)) == {"duplicate"}  # the mesh again: not counted
    _start(a, [a.peer, b.peer])
    assert a.final_complete
    # Tracking: disjoint pieces beyond MAX_PIECES per bucket are refused.
    monkeypatch.setattr(final_module, "MIN_CHUNK_ELEMENTS", 1)
    monkeypatch.setattr(final_module, "MAX_PIECES", 2)
    c, d = _trained(2)
    _start(c, [c.peer, d.peer])
    pieces = [_copy_chunk(d, bucket, s, 10, env) for s in (0, 20, 40)]
    assert _offer(c, d.peer, pieces) == ["range"]
    assert _offer(c, d.peer, [_copy_chunk(d, bucket, 10, 10, env)]) == []  # joins two


def test_updates_are_refused_once_the_last_round_began() -> None:
    """An update taken during the round would move this replica alone, and the
    round's rescaling would amplify it."""
    a, b = _trained(2)
    gen = torch.Generator().manual_seed(11)
    late: list[bytes] = []
    while not late:
        late = local_update(b, gen, scale=0.001)
    _start(a, [a.peer, b.peer])
    assert set(_offer(a, b.peer, late)) == {"late"}
