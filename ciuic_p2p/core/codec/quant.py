"""Value quantization: symmetric INT8 with one fp32 scale per block, and fp16.

INT8: a block of ``block_size`` consecutive values shares ``scale = max|v| / 127``;
each value is sent as ``round(v / scale)`` in [-127, 127] (symmetric, so zero is
exact and -128 is never produced). The scale is fp32: fp16 would flush the scale
of small gradients (below about 1e-5) to zero and round it, so the largest value
of a block could overflow the grid; at 64 values per block an fp32 scale costs
0.5 bits per value. Whatever quantization loses goes back into the error-feedback
residual (core.codec.bucket), so it is delayed, not dropped.

fp16: values beyond ±65504 are clamped (the excess, again, stays in the residual).
"""

from __future__ import annotations

import torch

INT8_LEVELS = 127
FP16_MAX = 65504.0


def quantize_int8(values: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 values (1-D) → (int8 codes, fp32 scales of ``ceil(k / block_size)`` blocks)."""
    k = values.numel()
    nblocks = -(-k // block_size)
    padded = values
    if nblocks * block_size != k:
        padded = torch.nn.functional.pad(values, (0, nblocks * block_size - k))
    blocks = padded.view(nblocks, block_size)
    absmax = blocks.abs().amax(dim=1)
    scales = absmax / INT8_LEVELS
    inverse = torch.where(absmax > 0, INT8_LEVELS / absmax, torch.zeros_like(absmax))
    codes = torch.round(blocks * inverse.unsqueeze(1)).clamp_(-INT8_LEVELS, INT8_LEVELS)
    return codes.to(torch.int8).view(-1)[:k], scales


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
