"""A node's other local ranks replay what its first rank added to its parameters
(core.replica.mirror): bit-identical, in about the bytes of the chunks it received."""

from __future__ import annotations

import dataclasses
import struct

import pytest
import torch

from ciuic_p2p.core.codec.bucket import ChunkSource
from ciuic_p2p.core.codec.layout import BucketLayout
from ciuic_p2p.core.replica.messages import decode_payload, run_id_of
from ciuic_p2p.core.replica.mirror import MirrorError, MirrorLog, MirrorReplay
from ciuic_p2p.core.replica.rule import Replica
from ciuic_p2p.train.hook import flatten_parameters
from tests.train.test_replica import CODEC, TRAIN, _introduce, model


def _replica(i: int, sink: MirrorLog | None = None) -> Replica:
    m = model()
    layout = BucketLayout.for_module(m, dense_below_numel=0)
    buckets = flatten_parameters(m, layout)
    source = ChunkSource(run_id_of("run"), bytes([i + 1]) * 32, 0, layout.layout_id)
    train = dataclasses.replace(TRAIN, consensus_interval_steps=4, consensus_fragments=8)
    return Replica(layout, buckets, source, f"p{i}", CODEC, train, seed=i, sink=sink)


def _step(r: Replica, delta: list[torch.Tensor], also: list[torch.Tensor] | None) -> list[bytes]:
    """The optimizer's step, the same on every local rank (DDP), then the hook's."""
    with torch.no_grad():
        for b, d in zip(r.buckets, delta, strict=True):
            b.add_(d)
        if also is not None:
            for b, d in zip(also, delta, strict=True):
                b.add_(d)
    payloads = []
    if r.local_step():
        payloads += r.encode_update(r.take_update(), r.step)
    if r.wants_params():
        payloads += r.encode_params(r.snapshot_params())
    return payloads


@pytest.mark.parametrize("peers", [1, 2])
def test_a_follower_rank_replays_the_first_ranks_adds_bit_for_bit(peers: int) -> None:
    log = MirrorLog()
    lead = _replica(0, log)
    others = [_replica(i + 1) for i in range(peers)]
    reps = [lead, *others]
    _introduce(reps)
    follower = [b.clone() for b in lead.buckets]
    replay = MirrorReplay(follower)
    log.take()  # what attach did is broadcast whole
    gen = torch.Generator().manual_seed(3)
    received = 0
    for _ in range(40):
        for r in reps:
            delta = [torch.randn(b.shape, generator=gen) * 0.001 for b in r.buckets]
            sent = _step(r, delta, follower if r is lead else None)
            for other in reps:
                if other is not r:
                    for p in sent:
                        other.receive(r.peer, p)
        for r in reps:
            r.settle()
        received = lead.stats.chunk_bytes_received
        replay.apply(log.take())
        for mine, theirs in zip(lead.buckets, follower, strict=True):
            assert torch.equal(mine, theirs)
    assert lead.stats.params_mixed > 0  # pulls were replayed against snapshots
    assert lead.stats.sends > 10
    # A follower receives the peers' chunks and this node's own, at settlement: about
    # the chunks received plus one replica's share.
    ratio = log.bytes_taken / received
    print("ratio", peers, ratio, log.bytes_taken, received)
    assert ratio <= 1.0 + 1.0 / peers + 0.05, ratio


def test_a_bad_log_is_refused_with_a_typed_error() -> None:
    replay = MirrorReplay([torch.zeros(16)])
    for bad in (b"", b"\x09", b"\x01\x07", b"\x01\x01\x00", b"\x01\x04" + b"\x00" * 8):
        with pytest.raises(MirrorError):
            replay.apply(bad)
    with pytest.raises(MirrorError, match="snapshot"):
        replay.apply(b"\x01\x03" + (5).to_bytes(8, "little") + (9).to_bytes(4, "little") * 2)


def test_a_pull_that_does_not_fit_its_snapshot_is_a_typed_error() -> None:
    """A sparse chunk logged as a pull, after a one-fragment snapshot: its values do
    not fit the range (before: a RuntimeError of torch)."""
    log = MirrorLog()
    lead = _replica(0, log)
    gen = torch.Generator().manual_seed(2)
    sent: list[bytes] = []
    while not sent:
        sent = _step(lead, [torch.randn(b.shape, generator=gen) for b in lead.buckets], None)
    body = bytes(decode_payload(sent[0]).body)
    h_step = lead.step
    replay = MirrorReplay([b.clone() for b in lead.buckets])
    snapshot = b"\x03" + h_step.to_bytes(8, "little") + (0).to_bytes(4, "little")
    snapshot += (1).to_bytes(4, "little")
    pull = b"\x02" + struct.pack("<dI", 0.5, len(body)) + body
    with pytest.raises(MirrorError):
        replay.apply(b"\x01" + snapshot + pull)
