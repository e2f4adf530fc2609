"""Value quantization: symmetric INT8 with one fp32 scale per block, and fp16.

INT8: a block of ``block_size`` consecutive values shares ``scale = max|v| / 127``;
each value is sent as ``round(v / scale)`` in [-127, 127] (symmetric, so zero is
exact and -128 is never produced). The scale is fp32: fp16 would flush the scale
of small gradients (below about 1e-5) to zero and round it, so the largest value
of a block could overflow the grid; at 64 values per block an fp32 scale costs
0.5 bits per value. Whatever quantization loses goes back into the error-feedback
residual (core.codec.bucket), so it is delayed, not dropped.

fp16: values beyond ±65504 are clamped (the excess, again, stays in the residual).

INT4 and INT2 (selected values only), packed low bits first, ``8 / bits`` values a
byte, with one fp32 scale per block as INT8:

- INT4 is INT8's symmetric grid with 7 levels each side: codes -7..7 are sent as
  0..14 (15 is never produced, and refused on input).
- INT2 is a mid-rise grid of four levels, ``(u - 1.5) * scale`` for u in 0..3 with
  ``scale = max|v| / 1.5``: top-k values are the largest of their bucket, so a level
  at zero (a mid-tread grid: three levels, 1.58 bits of four) would be wasted on
  values that are never small.

A block of zeros has scale 0 and decodes to zeros on every grid.
"""

from __future__ import annotations

import torch

INT8_LEVELS = 127
FP16_MAX = 65504.0
LOW_BITS = (4, 2)
"""The packed widths offered (core.codec.chunk's SPARSE_INT4 and SPARSE_INT2)."""
_INT4_LEVELS = 7
_INT2_HALF_RANGE = 1.5


def quantize_int8(values: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 values (1-D) → (int8 codes, fp32 scales of ``ceil(k / block_size)`` blocks)."""
    k = values.numel()
    blocks = _blocks(values, block_size)
    absmax = blocks.abs().amax(dim=1)
    scales = absmax / INT8_LEVELS
    inverse = torch.where(absmax > 0, INT8_LEVELS / absmax, torch.zeros_like(absmax))
    codes = torch.round(blocks * inverse.unsqueeze(1)).clamp_(-INT8_LEVELS, INT8_LEVELS)
    return codes.to(torch.int8).view(-1)[:k], scales


def _blocks(values: torch.Tensor, block_size: int) -> torch.Tensor:
    k = values.numel()
    nblocks = -(-k // block_size)
    padded = values
    if nblocks * block_size != k:
        padded = torch.nn.functional.pad(values, (0, nblocks * block_size - k))
    return padded.view(nblocks, block_size)


def _grid(bits: int) -> tuple[float, float]:
    """(levels of max|v| on the grid's top code, code offset) of a packed width."""
    if bits == 4:
        return float(_INT4_LEVELS), float(_INT4_LEVELS)
    if bits == 2:
        return _INT2_HALF_RANGE, _INT2_HALF_RANGE
    raise ValueError(f"packed values are 4 or 2 bits, not {bits}")


def max_code(bits: int) -> float:
    """The largest level of a packed grid, in steps (INT4: 7; INT2: 1.5)."""
    return _grid(bits)[0]


def quantize_packed(
    values: torch.Tensor, block_size: int, bits: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 values (1-D) → (packed uint8 codes of ``ceil(k * bits / 8)`` bytes, fp32
    scales of ``ceil(k / block_size)`` blocks, the values as receivers decode them)."""
    k = values.numel()
    top, offset = _grid(bits)
    blocks = _blocks(values, block_size)
    absmax = blocks.abs().amax(dim=1)
    scales = absmax / top
    inverse = top / absmax
    # A zero block, and one so small that top / absmax overflows, send zeros.
    inverse = torch.where(torch.isfinite(inverse), inverse, torch.zeros_like(inverse))
    scaled = blocks * inverse.unsqueeze(1)
    if bits == 4:
        codes = torch.round(scaled).clamp_(-top, top).add_(offset)
    else:  # the nearest of the four mid-rise levels
        codes = torch.floor(scaled.add_(offset + 0.5)).clamp_(0, 2 * offset)
    sent = ((codes - offset) * scales.unsqueeze(1)).view(-1)[:k]
    return pack(codes.to(torch.uint8).view(-1)[:k], bits), scales, sent


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes below ``2**bits`` → bytes, ``8 // bits`` codes each, the first in
    the low bits; the last byte's unused bits are zero."""
    per_byte = 8 // bits
    k = codes.numel()
    nbytes = -(-k // per_byte)
    padded = codes
    if nbytes * per_byte != k:
        padded = torch.nn.functional.pad(codes, (0, nbytes * per_byte - k))
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)
    # The shifted codes occupy disjoint bits, so their sum is their bitwise or.
    return (padded.view(nbytes, per_byte) << shifts).sum(dim=1, dtype=torch.uint8)


def unpack(packed: torch.Tensor, count: int, bits: int) -> torch.Tensor | None:
    """The first ``count`` codes of ``packed`` as uint8; None when a bit past them is
    set (a well-formed chunk leaves them zero)."""
    per_byte = 8 // bits
    # uint8 throughout: a hostile chunk's codes cost one byte each here, not four.
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    codes = ((packed.unsqueeze(1) >> shifts) & ((1 << bits) - 1)).view(-1)
    if codes.numel() != -(-count // per_byte) * per_byte or bool((codes[count:] != 0).any()):
        return None
    return codes[:count]


def dequantize_packed(
    codes: torch.Tensor, scales: torch.Tensor, block_size: int, bits: int
) -> torch.Tensor:
    """Unpacked codes and per-block scales → fp32 values."""
    _, offset = _grid(bits)
    per_value = scales.repeat_interleave(block_size)[: codes.numel()]
    return (codes.to(torch.float32) - offset) * per_value


def dequantize_int8(
    codes: torch.Tensor, scales: torch.Tensor, block_size: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """int8 codes and per-block scales → fp32 values (written to ``out`` if given)."""
    k = codes.numel()
    nblocks = scales.numel()
    full = min(k // block_size, nblocks)
    result = out if out is not None else torch.empty(k, dtype=torch.float32, device=codes.device)
    if full:
        head = result[: full * block_size].view(full, block_size)
        torch.mul(codes[: full * block_size].view(full, block_size), scales[:full, None], out=head)
    if k > full * block_size:
        torch.mul(codes[full * block_size :], scales[full], out=result[full * block_size :])
    return result


def to_fp16(values: torch.Tensor) -> torch.Tensor:
    """fp32 → fp16, clamped to the finite fp16 range."""
    return values.clamp(-FP16_MAX, FP16_MAX).to(torch.float16)
