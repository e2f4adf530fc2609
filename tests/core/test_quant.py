from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from ciuic_p2p.core.codec.quant import dequantize_int8, quantize_int8


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
