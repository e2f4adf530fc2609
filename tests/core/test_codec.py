from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ciuic_p2p.config import CodecSection
from ciuic_p2p.core.codec.bucket import BucketSpec, apply_chunk, decode_chunk
from ciuic_p2p.core.codec.chunk import MAX_PAYLOAD_BYTES, Codec, parse_chunk
from ciuic_p2p.core.codec.select import ApproxTopK, exact_topk
from ciuic_p2p.errors import ChunkMismatchError, NonFiniteUpdateError
from tests.conftest import devices
from tests.core.helpers import SOURCE, encoder, heavy_tailed

ALL_CODECS = list(Codec)


def sent_by(chunks: list[bytearray], n: int, device: str = "cpu") -> torch.Tensor:
    dense = torch.zeros(n, device=device)
    for c in chunks:
        apply_chunk(c, dense)
    return dense


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("codec", ALL_CODECS)
@given(
    n=st.integers(min_value=1, max_value=5000),
    density=st.sampled_from([1.0, 0.5, 0.1, 0.01, 0.001]),
    seed=st.integers(min_value=0, max_value=2**16),
)
def test_what_was_sent_plus_the_residual_is_the_input(
    device: str, codec: Codec, n: int, density: float, seed: int
) -> None:
    enc = encoder(n, codec, device=device, density=density, exact=bool(seed % 2))
    update = heavy_tailed(n, seed, device)
    sent = sent_by(enc.encode(update, step=1), n, device)
    residual = enc.residual if enc.residual is not None else torch.zeros_like(update)
    torch.testing.assert_close(sent + residual, update, rtol=1e-6, atol=1e-6)
    if codec.is_sparse:
        k = enc.spec.k_for(n)
        assert enc.stats.selected == min(k, int((update != 0).sum()))
    else:
        assert enc.stats.selected == n


@pytest.mark.parametrize(
    "codec",
    [Codec.SPARSE_INT8, Codec.SPARSE_FP16, Codec.SPARSE_INT4, Codec.SPARSE_INT2, Codec.DENSE_INT8],
)
def test_error_feedback_loses_nothing_over_many_steps(codec: Codec) -> None:
    n, steps = 20_000, 200
    enc = encoder(n, codec, density=0.01, sample_size=4096)
    total_in = torch.zeros(n, dtype=torch.float64)
    total_sent = torch.zeros(n)
    for step in range(steps):
        update = heavy_tailed(n, step)
        total_in += update.double()
        for c in enc.encode(update, step):
            apply_chunk(c, total_sent)
    assert enc.residual is not None
    torch.testing.assert_close((total_sent + enc.residual).double(), total_in, rtol=1e-4, atol=1e-3)


def test_residual_stays_bounded_over_many_steps() -> None:
    n = 20_000
    enc = encoder(n, density=0.01, sample_size=4096)
    norms = []
    for step in range(300):
        update = heavy_tailed(n, step)
        enc.encode(update, step)
        assert enc.residual is not None
        norms.append(float(enc.residual.norm() / update.norm()))
    # Error feedback with a contractive compressor converges to a plateau: the last
    # third does not grow beyond the middle third's maximum, and it stays far below
    # the worst case 2/density.
    assert max(norms[200:]) <= 1.1 * max(norms[100:200])
    assert max(norms) < 2 / 0.01


def test_residual_bound_scales_the_residual_down() -> None:
    n = 10_000
    enc = encoder(n, density=0.01, exact=True, residual_max_ratio=2.0)
    for step in range(50):
        enc.encode(heavy_tailed(n, step), step)
        assert enc.residual is not None
        assert float(enc.residual.norm()) <= 2.0 * enc.state_dict()["update_norm_ema"] * 1.0001
    assert enc.stats.residual_scaled


def test_residual_state_round_trips_through_state_dict() -> None:
    n = 30_000
    a = encoder(n, density=0.01)
    for step in range(3):
        a.encode(heavy_tailed(n, step), step)
    b = encoder(n, density=0.01)
    b.load_state_dict(a.state_dict())
    update = heavy_tailed(n, 99)
    a_chunks = [bytes(c) for c in a.encode(update, 3)]
    b_chunks = [bytes(c) for c in b.encode(update, 3)]
    assert a_chunks == b_chunks


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_update_is_refused_and_changes_nothing(bad: float) -> None:
    n = 1000
    enc = encoder(n, density=0.1)
    enc.encode(heavy_tailed(n, 1), 1)
    assert enc.residual is not None
    before = enc.residual.clone()
    update = heavy_tailed(n, 2)
    update[17] = bad
    with pytest.raises(NonFiniteUpdateError):
        enc.encode(update, 2)
    assert torch.equal(enc.residual, before)


def test_all_zero_update_sends_no_values() -> None:
    enc = encoder(1000, density=0.1)
    chunks = enc.encode(torch.zeros(1000), 0)
    assert len(chunks) == 1 and parse_chunk(chunks[0])[0].count == 0
    assert enc.stats.selected == 0 and torch.equal(sent_by(chunks, 1000), torch.zeros(1000))


def test_k_at_least_n_sends_every_non_zero_entry() -> None:
    update = heavy_tailed(64, 3)
    enc = encoder(64, density=1.0)
    sent = sent_by(enc.encode(update, 0), 64)
    assert enc.stats.selected == 64
    # INT8 rounding: at most half a step of the block's scale (max |v| / 127).
    half_step = float(update.abs().max()) / 127 / 2
    assert float((sent - update).abs().max()) <= half_step * 1.0001


def test_one_element_bucket() -> None:
    enc = encoder(1, density=0.01)
    sent = sent_by(enc.encode(torch.tensor([-2.5]), 0), 1)
    assert torch.equal(sent, torch.tensor([-2.5]))


def test_selectors_handle_k_zero() -> None:
    x = heavy_tailed(100_000, 1)
    selector = ApproxTopK(x.numel(), x.device, 4096, torch.Generator().manual_seed(0))
    assert selector.select(x, 0).numel() == 0 and exact_topk(x, 0).numel() == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_updates_of_other_float_dtypes_are_encoded(dtype: torch.dtype) -> None:
    update = heavy_tailed(5000, 4).to(dtype)
    enc = encoder(5000, density=0.05)
    sent = sent_by(enc.encode(update, 0), 5000)
    assert enc.residual is not None
    torch.testing.assert_close(sent + enc.residual, update.float(), rtol=1e-5, atol=1e-5)


def test_integer_updates_are_refused() -> None:
    with pytest.raises(ValueError, match="floating-point"):
        encoder(10).encode(torch.arange(10), 0)


@pytest.mark.parametrize("density", [0.01, 0.001])
def test_approximate_selection_equals_exact_selection(density: float) -> None:
    n = 1_000_000
    x = heavy_tailed(n, 7)
    k = int(n * density)
    selector = ApproxTopK(n, x.device, 65_536, torch.Generator().manual_seed(1))
    approx = selector.select(x, k)
    assert torch.equal(approx, exact_topk(x, k))
    assert selector.fallbacks == 0 and selector.last_candidates >= k


def test_approximate_selection_recovers_from_a_bad_sample() -> None:
    # A spike region the sample almost surely misses makes the first threshold too
    # high; the selector must still return the exact top k.
    n = 200_000
    x = torch.randn(n) * 1e-3
    x[1000:1500] = torch.linspace(5, 10, 500)
    selector = ApproxTopK(n, x.device, 1024, torch.Generator().manual_seed(3))
    assert torch.equal(selector.select(x, 2000), exact_topk(x, 2000))


def test_chunks_respect_the_payload_bound_and_tile_the_bucket() -> None:
    n = 300_000
    enc = encoder(n, density=0.05, chunk_payload_bytes=4096)
    update = heavy_tailed(n, 5)
    chunks = enc.encode(update, 0)
    assert len(chunks) > 5
    headers = [parse_chunk(c)[0] for c in chunks]
    assert all(h.payload_len <= 4096 for h in headers)
    assert headers[0].range_start == 0
    for a, b in itertools.pairwise(headers):
        assert a.range_start + a.range_len == b.range_start
    assert headers[-1].range_start + headers[-1].range_len == n
    assert sum(h.count for h in headers) == enc.stats.selected


def test_far_apart_positions_cannot_blow_up_a_chunk() -> None:
    n = 2_000_000
    update = torch.zeros(n)
    update[:5000] = torch.rand(5000) + 1  # dense cluster: Rice parameter 0
    update[-3:] = 5.0  # then a gap that would cost ~2e6 unary bits
    enc = encoder(n, density=5003 / n, exact=True)
    chunks = enc.encode(update, 0)
    assert all(parse_chunk(c)[0].payload_len <= MAX_PAYLOAD_BYTES for c in chunks)
    assert sum(len(c) for c in chunks) < 20_000
    torch.testing.assert_close(sent_by(chunks, n)[-3:], torch.full((3,), 5.0))


@pytest.mark.parametrize("device", devices())
def test_decoding_happens_on_the_target_device(device: str) -> None:
    enc = encoder(10_000, density=0.01, device=device)
    chunk = enc.encode(heavy_tailed(10_000, 1, device), 0)[0]
    decoded = decode_chunk(chunk, device)
    assert decoded.values.device.type == device and decoded.positions is not None
    assert decoded.positions.device.type == device


def test_chunk_of_another_run_layout_or_size_is_refused_and_changes_nothing() -> None:
    enc = encoder(1000, density=0.1)
    chunk = enc.encode(heavy_tailed(1000, 1), 0)[0]
    target = torch.zeros(1000)
    with pytest.raises(ChunkMismatchError, match="run"):
        apply_chunk(chunk, target, run_id=b"x" * 16)
    with pytest.raises(ChunkMismatchError, match="layout"):
        apply_chunk(chunk, target, layout_id=SOURCE.layout_id + 1)
    with pytest.raises(ChunkMismatchError, match="outside"):
        apply_chunk(chunk, torch.zeros(999))
    assert not target.any()
    apply_chunk(chunk, target, run_id=SOURCE.run_id, layout_id=SOURCE.layout_id, weight=0.5)
    assert target.any()


def test_spec_from_config_chooses_mode_by_size() -> None:
    section = CodecSection(value_mode="fp16", dense_dtype="bf16", exact_below_numel=1000)
    assert BucketSpec.from_config(section, 500, sparse=True).exact
    assert BucketSpec.from_config(section, 5000, sparse=True).codec is Codec.SPARSE_FP16
    assert BucketSpec.from_config(section, 5000, sparse=False).codec is Codec.DENSE_BF16


def test_fp16_values_beyond_range_stay_in_the_residual() -> None:
    update = torch.tensor([1e6, 1.0, 0.0, 0.0])
    enc = encoder(4, Codec.SPARSE_FP16, density=0.25)
    sent = sent_by(enc.encode(update, 0), 4)
    assert enc.residual is not None
    assert float(sent[0]) == 65504.0 and float(enc.residual[0]) == pytest.approx(1e6 - 65504.0)


@pytest.mark.parametrize(
    ("codec", "first", "mask"),
    [
        (Codec.SPARSE_INT4, True, 0x0F),  # the first code becomes 15
        (Codec.SPARSE_INT4, False, 0xF0),  # the spare half of the last byte
        (Codec.SPARSE_INT2, False, 0xC0),  # the spare quarter of the last byte
    ],
)
def test_packed_codes_off_the_grid_or_in_the_padding_are_refused(
    codec: Codec, first: bool, mask: int
) -> None:
    """A 4-bit code of 15 has no level, and bits past the last code must be zero: a
    chunk carrying either (with a valid checksum) is refused, nothing applied."""
    from ciuic_p2p.core.codec.chunk import _checksum, fixed_sections, parse_chunk  # noqa: PLC0415
    from ciuic_p2p.errors import InconsistentChunkError  # noqa: PLC0415

    enc = encoder(1000, codec, density=0.003, exact=True)  # 3 values: a spare code slot
    (chunk,) = enc.encode(heavy_tailed(1000, 4), step=1)
    header, payload = parse_chunk(chunk)
    scale_len, value_len = fixed_sections(header)
    values_at = len(chunk) - len(payload) + scale_len
    chunk[values_at if first else values_at + value_len - 1] |= mask
    chunk[116:120] = _checksum(memoryview(chunk)).to_bytes(4, "little")
    target = torch.zeros(1000)
    with pytest.raises(InconsistentChunkError, match="outside the grid, or padding set"):
        apply_chunk(chunk, target)
    assert not target.any()


@pytest.mark.parametrize("codec", [Codec.SPARSE_INT8, Codec.SPARSE_INT4, Codec.SPARSE_INT2])
def test_the_largest_finite_values_decode_as_sent(codec: Codec) -> None:
    """Each grid's scale bound fits its own largest code: a block whose largest value
    is near FLT_MAX is applied, as its sender recorded it."""
    update = torch.zeros(1000)
    update[10], update[500] = 3e38, -1e37
    enc = encoder(1000, codec, density=0.002, exact=True)
    target = torch.zeros(1000)
    for chunk in enc.encode(update, step=1):
        apply_chunk(chunk, target)
    assert bool(torch.isfinite(target).all()) and target[10] > 1e38
    assert enc.residual is not None
    torch.testing.assert_close(target + enc.residual, update)
