from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from ciuic_p2p.core.codec.quant import (
    dequantize_int8,
    dequantize_packed,
    quantize_int8,
    quantize_packed,
    unpack,
)


@given(
    values=st.lists(
        st.floats(min_value=-1e30, max_value=1e30, allow_nan=False, width=64), max_size=300
    ),
    block=st.sampled_from([1, 3, 16, 64, 256]),
)
def test_int8_error_is_at_most_half_a_step(values: list[float], block: int) -> None:
    x = torch.tensor(values, dtype=torch.float32)
    codes, scales = quantize_int8(x, block)
    assert codes.dtype == torch.int8 and scales.numel() == -(-len(values) // block)
    assert int(codes.abs().max()) <= 127 if len(values) else True
    back = dequantize_int8(codes, scales, block)
    step = scales.repeat_interleave(block)[: len(values)]
    assert bool(((back - x).abs() <= step * 0.5001 + 1e-30).all())


def test_zero_block_has_zero_scale_and_exact_zeros() -> None:
    codes, scales = quantize_int8(torch.zeros(100), 64)
    assert not scales.any() and not codes.any()


@given(
    values=st.lists(
        st.floats(min_value=-1e30, max_value=1e30, allow_nan=False, width=64), max_size=300
    ),
    block=st.sampled_from([1, 3, 16, 64, 256]),
    bits=st.sampled_from([4, 2]),
)
def test_packed_codes_round_trip_within_half_a_step(
    values: list[float], block: int, bits: int
) -> None:
    x = torch.tensor(values, dtype=torch.float32)
    packed, scales, sent = quantize_packed(x, block, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == -(-len(values) * bits // 8)
    codes = unpack(packed, len(values), bits)
    assert (
        codes is not None and int(codes.max()) < (15 if bits == 4 else 4) if len(values) else True
    )
    assert codes is not None
    back = dequantize_packed(codes, scales, block, bits)
    assert torch.equal(back, sent)  # the sender keeps exactly what receivers decode
    step = scales.repeat_interleave(block)[: len(values)]
    # INT4: half a step; INT2's outer levels sit at 1.5 steps and its inner at 0.5,
    # so no value in [-max, max] is more than half a step from one.
    assert bool(((back - x).abs() <= step * 0.5001 + 1e-30).all())


def test_a_packed_zero_block_decodes_to_zeros() -> None:
    for bits in (4, 2):
        packed, scales, sent = quantize_packed(torch.zeros(100), 64, bits)
        assert not scales.any() and not sent.any()
        codes = unpack(packed, 100, bits)
        assert codes is not None and not dequantize_packed(codes, scales, 64, bits).any()


def test_set_padding_bits_are_refused() -> None:
    packed, _, _ = quantize_packed(torch.ones(3), 64, 2)  # 3 codes: one byte, 2 bits spare
    assert unpack(packed, 3, 2) is not None
    packed[0] |= 0b11000000
    assert unpack(packed, 3, 2) is None
