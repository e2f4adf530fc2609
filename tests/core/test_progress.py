"""The progress path (BucketEncoder.encode_progress, core.replica.parameters): the
update is ``params - base`` read once from the model, never stored on CPU; the base
moves by what is sent; peers' chunks go into the model and the base alike, and never
while the encoder reads."""

from __future__ import annotations

import threading

import pytest
import torch

from ciuic_p2p.config import CodecSection, TrainSection
from ciuic_p2p.core.codec.bucket import BucketEncoder, BucketSpec, apply_chunk
from ciuic_p2p.core.codec.chunk import Codec
from ciuic_p2p.core.codec.layout import BucketLayout
from ciuic_p2p.core.codec.select import ApproxTopK
from ciuic_p2p.core.replica.messages import run_id_of
from ciuic_p2p.core.replica.parameters import Parameters, Range
from ciuic_p2p.core.replica.rule import Replica
from ciuic_p2p.errors import NonFiniteUpdateError
from ciuic_p2p.train.encoder import ThreadGate, flatten_parameters
from tests.conftest import devices
from tests.core.helpers import SOURCE, heavy_tailed

SPARSE = [Codec.SPARSE_INT8, Codec.SPARSE_FP16, Codec.SPARSE_INT4, Codec.SPARSE_INT2]


def progress_encoder(
    n: int, codec: Codec, device: str = "cpu", numpy_scan: bool | None = None, **spec: object
) -> BucketEncoder:
    return BucketEncoder(
        0,
        n,
        BucketSpec(codec=codec, **spec),  # type: ignore[arg-type]
        SOURCE,
        device=device,
        keep_residual=False,
        numpy_scan=numpy_scan,
    )


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("numpy_scan", [None, False])
@pytest.mark.parametrize("codec", [*SPARSE, Codec.DENSE_INT8, Codec.DENSE_FP16, Codec.DENSE_FP32])
def test_what_was_sent_plus_params_minus_base_is_all_the_progress(
    device: str, numpy_scan: bool | None, codec: Codec
) -> None:
    n, steps = 300_000, 12
    enc = progress_encoder(n, codec, device, numpy_scan, density=0.01, sample_size=4096)
    params = torch.zeros(n, device=device)
    base = params.clone()
    total_sent = torch.zeros(n, device=device)
    for step in range(steps):
        params += heavy_tailed(n, step, device)
        for chunk in enc.encode_progress(params, base, step):
            apply_chunk(chunk, total_sent)
        if codec.is_sparse:
            assert enc.stats.selected == enc.spec.k_for(n)
    # Error feedback loses nothing: what went out plus what is left is all of it.
    torch.testing.assert_close(total_sent + (params - base), params, rtol=1e-5, atol=1e-4)
    left = float((params - base).norm())
    assert enc.residual_norm == pytest.approx(left, rel=1e-3, abs=1e-3)
    if numpy_scan is None and device == "cpu" and codec.is_sparse:
        assert enc.held_bytes() < 4 * 1024 * 1024  # fixed scan blocks, nothing of size n
    elif codec.is_sparse:  # difference (4 B), mask (1 B), one magnitude block
        assert enc.held_bytes() <= 5 * n + 4 * n


@pytest.mark.parametrize("codec", SPARSE)
def test_the_sent_records_are_what_receivers_decode(codec: Codec) -> None:
    n = 200_000 * 8 // min(8, codec.value_bits)  # several 4 KiB chunks on every codec
    enc = progress_encoder(n, codec, density=0.01, chunk_payload_bytes=4096)
    params = heavy_tailed(n, 1)
    base = torch.zeros(n)
    chunks = enc.encode_progress(params, base, 3)
    assert len(chunks) > 1 and len(enc.last_sent) == len(chunks)
    from_records = torch.zeros(n)
    from_bytes = torch.zeros(n)
    for sent, chunk in zip(enc.last_sent, chunks, strict=True):
        assert sent.payload is chunk
        h = sent.header
        assert sent.positions is not None
        from_records.index_add_(0, sent.positions + h.range_start, sent.values)
        apply_chunk(chunk, from_bytes)
    assert torch.equal(from_records, from_bytes)


def test_the_numpy_scan_and_the_torch_path_select_the_same() -> None:
    n, k = 1_000_000, 10_000
    p = heavy_tailed(n, 5)
    base = heavy_tailed(n, 6) * 0.1
    picks = []
    for numpy_scan in (True, False):
        gen = torch.Generator().manual_seed(1)
        sel = ApproxTopK(n, torch.device("cpu"), 32_768, gen, numpy_scan=numpy_scan)
        picks.append(sel.select_difference(p, base, k))
    a, b = picks
    assert torch.equal(a.positions, b.positions)
    torch.testing.assert_close(a.values, b.values)
    assert a.sumsq == pytest.approx(b.sumsq, rel=1e-4)
    exact = torch.topk((p - base).abs(), k).indices.sort().values
    assert torch.equal(a.positions, exact)


@pytest.mark.parametrize("numpy_scan", [None, False])
def test_non_finite_progress_sends_nothing_and_leaves_the_base(numpy_scan: bool | None) -> None:
    n = 100_000
    enc = progress_encoder(n, Codec.SPARSE_INT8, numpy_scan=numpy_scan, density=0.01)
    params = heavy_tailed(n, 2)
    params[777] = float("nan")
    base = torch.zeros(n)
    with pytest.raises(NonFiniteUpdateError):
        enc.encode_progress(params, base, 1)
    assert torch.equal(base, torch.zeros(n))


def test_a_bounded_residual_moves_the_base_toward_the_model() -> None:
    n = 100_000
    enc = progress_encoder(n, Codec.SPARSE_INT8, density=0.001, residual_max_ratio=2.0)
    params = torch.zeros(n)
    base = torch.zeros(n)
    for step in range(30):
        params += heavy_tailed(n, step)
        enc.encode_progress(params, base, step)
        assert float((params - base).norm()) <= 2.0 * enc._sent_norm_ema * 1.001
    assert enc.stats.residual_scaled


def test_peers_chunks_go_into_model_and_base_and_wait_while_the_encoder_reads() -> None:
    p = torch.zeros(1000)
    gate = ThreadGate(torch.device("cpu"))
    params = Parameters([p], gate)
    params.add(Range(0, 10, 100), torch.tensor([0, 5]), torch.tensor([1.0, 2.0]), 0.5)
    reading = threading.Event()
    release = threading.Event()

    def encoder_reads() -> None:
        with params.reading():
            reading.set()
            release.wait(5)

    t = threading.Thread(target=encoder_reads)
    t.start()
    assert reading.wait(5)
    assert params.flush() is False  # the encoder holds the gate: no wait, kept queued
    assert float(p.abs().sum()) == 0.0 and params.queued()
    release.set()
    t.join(5)
    assert params.flush() is True
    assert p[10] == 0.5 and p[15] == 1.0
    assert float(params.base[0].abs().sum()) == 0.0  # the encoder adds it, before reading
    with params.reading():
        pass
    assert torch.equal(params.base[0], p)  # not this replica's progress: p - base is 0


def replica(numel_per_layer: int = 100_000, train: TrainSection | None = None) -> Replica:
    model = torch.nn.Sequential(
        torch.nn.Linear(numel_per_layer // 100, 100), torch.nn.Linear(100, numel_per_layer // 100)
    )
    layout = BucketLayout.for_module(model, dense_below_numel=1024)
    buckets = flatten_parameters(model, layout)
    source = SOURCE.__class__(run_id_of("run"), bytes(32), 0, layout.layout_id)
    return Replica(
        layout,
        buckets,
        source,
        "me",
        CodecSection(density=0.01),
        train or TrainSection(consensus_interval_steps=8, consensus_fragments=64),
    )


def test_the_rule_holds_under_12_bytes_and_5_passes_per_parameter() -> None:
    """What the issue asks of the hook, counted from the tensors and the code paths
    (bench/datapath.py reports the same on a real run)."""
    r = replica(1_000_000)
    r.set_alive(["me"])  # alone: every own chunk settles at once
    n = r.parameters.numel()
    gen = torch.Generator().manual_seed(0)
    sends = 0
    for _ in range(40):
        with torch.no_grad():
            for b in r.buckets:
                b.add_(torch.randn(b.shape, generator=gen) * 1e-3)
        if r.local_step():
            before = r.traffic_bytes()
            r.encode_update(r.take_update())
            sends += 1
            assert (r.traffic_bytes() - before) / (4 * n) <= 5.0
        if r.step % 8 == 0:
            r.encode_params(r.snapshot_params())
        r.settle()
    assert sends == 40
    assert r.held_bytes() / n <= 12.0
    # The base is the only bucket-sized buffer the rule keeps: 4 bytes per parameter,
    # plus the consensus fragments, the unsettled own chunks and fixed scan blocks.
    scan_blocks = sum(e.held_bytes() for e in r.encoders)
    assert scan_blocks < 8 * 1024 * 1024
    assert (r.held_bytes() - scan_blocks) / n < 4.2
