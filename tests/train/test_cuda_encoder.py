"""The encoder thread on CUDA: its own stream, ordered against the training stream by
events (train/encoder.py). Skipped where there is no CUDA device."""

from __future__ import annotations

import pytest
import torch

from ciuic_p2p.config import CodecSection, TrainSection
from ciuic_p2p.core.codec.bucket import apply_chunk
from ciuic_p2p.core.codec.chunk import parse_chunk
from ciuic_p2p.core.codec.layout import BucketLayout
from ciuic_p2p.core.replica.messages import decode_payload, run_id_of
from ciuic_p2p.core.replica.parameters import Range
from ciuic_p2p.core.replica.rule import Replica, TakenUpdate
from ciuic_p2p.train.encoder import Encoder, ThreadGate, flatten_parameters
from tests.core.helpers import SOURCE

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_side_stream_encoding_loses_nothing_while_training_and_peers_write() -> None:
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1000, 1000), torch.nn.Linear(1000, 1000)).to(device)
    layout = BucketLayout.for_module(model, dense_below_numel=4096)
    buckets = flatten_parameters(model, layout)
    source = SOURCE.__class__(run_id_of("run"), bytes(32), 0, layout.layout_id)
    r = Replica(
        layout,
        buckets,
        source,
        "me",
        CodecSection(density=0.01),
        TrainSection(consensus_interval_steps=0),
        gate=ThreadGate(device),
    )
    start = [b.clone() for b in buckets]
    encoder = Encoder(device)
    sent_total = [torch.zeros_like(b) for b in buckets]
    peers_total = [torch.zeros_like(b) for b in buckets]
    published: list[bytes] = []
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(64, 1000, device=device)
    for step in range(1, 41):
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        r.step = step
        taken = r.take_update()
        encoder.idle.wait(30)

        def job(t: TakenUpdate = taken) -> None:
            published.extend(r.encode_update(t))

        encoder.submit(job, encoder.mark())
        # A peer's chunk lands while the encoder may be reading: it must not count as
        # this replica's progress.
        pos = torch.unique(torch.randint(0, buckets[0].numel(), (500,), device=device))
        vals = torch.randn(pos.numel(), device=device) * 1e-3
        r.parameters.add(Range(0, 0, buckets[0].numel()), pos, vals, 0.5)
        peers_total[0].index_add_(0, pos, vals, alpha=0.5)
        r.flush()
    assert encoder.idle.wait(60)
    encoder.check()
    r.flush(wait=True)
    r.parameters.settle_base()
    for payload in published:
        body = decode_payload(payload).body
        h, _ = parse_chunk(body)
        apply_chunk(body, sent_total[h.bucket])
    for b, s0, sent, peer, base in zip(
        buckets, start, sent_total, peers_total, r.base, strict=True
    ):
        own = b - s0 - peer  # what the optimizer did
        torch.testing.assert_close(sent + (b - base), own, rtol=1e-4, atol=1e-4)
    encoder.close()
