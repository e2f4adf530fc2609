"""Top-k selection by magnitude: exact, and a fast sampled-threshold variant.

``torch.topk`` on 10M fp32 values costs about 150-250 ms on a 2-core CPU, far more
than the rest of a step's encoding. The approximate selector does what Deep Gradient
Compression (Lin et al., 2018, §3) does, plus a correction so the count comes out
right:

1. Estimate the k-th largest magnitude from a random sample of ``s`` entries. The
   estimate is taken a few standard deviations *below* the true k-th magnitude: at
   sample rank ``r = s·p + 4·sqrt(s·p) + 4`` (``p = k/n``), so that the mask in step
   2 keeps at least k entries with overwhelming probability.
2. Mask ``|x| >= threshold`` in one pass and collect the candidates' positions
   (sorted, since they come from a scan).
3. Trim the candidates (about ``k·r/(s·p)`` of them) to exactly k with a k-th value
   search over the candidates only; filtering keeps the positions sorted.
4. If the estimate was too high (fewer than k candidates), retry from a sample rank
   4 times higher, then fall back to exact selection. Exact zeros are never
   selected: when fewer than k entries are non-zero, all non-zero ones are.

Positions are returned sorted ascending (int64), which is what the index coder and
the residual update want. On CPU the mask and the scan use numpy on the same memory
(measured 2-3x faster than torch's ``ge``/``nonzero`` here); elsewhere, torch ops.
"""

from __future__ import annotations

import math

import numpy as np
import torch


def exact_topk(x: torch.Tensor, k: int) -> torch.Tensor:
    """Sorted positions of the k largest magnitudes, exact (ties broken by torch)."""
    n = x.numel()
    if k <= 0:
        return torch.empty(0, dtype=torch.int64, device=x.device)
    if k >= n:
        return torch.nonzero(x != 0).squeeze(1)
    magnitudes = x.abs()
    idx = torch.topk(magnitudes, k, sorted=False).indices
    idx = idx[magnitudes[idx] > 0]
    return torch.sort(idx).values


class ApproxTopK:
    """Sampled-threshold selector for one bucket, holding its reusable buffers.

    Buffers the size of the bucket are allocated once: a fresh CPU buffer of tens of
    MB costs several times its work in page faults."""

    def __init__(
        self, numel: int, device: torch.device, sample_size: int, generator: torch.Generator
    ) -> None:
        self.numel = numel
        self.device = device
        self.sample_size = min(sample_size, numel)
        self.generator = generator
        self._magnitudes = torch.empty(numel, dtype=torch.float32, device=device)
        self._mask = torch.empty(numel, dtype=torch.bool, device=device)
        self.last_candidates = 0
        self.fallbacks = 0

    def select(self, x: torch.Tensor, k: int) -> torch.Tensor:
        """Sorted int64 positions of (about, see the module docstring) the k largest
        magnitudes of ``x``; exactly k unless fewer are non-zero or magnitudes tie."""
        n = self.numel
        if x.numel() != n:
            raise ValueError(f"expected {n} elements, got {x.numel()}")
        if k <= 0:
            return torch.empty(0, dtype=torch.int64, device=x.device)
        if k >= n:
            return exact_topk(x, k)
        s = self.sample_size
        picks = torch.randint(0, n, (s,), generator=self.generator, device=self.generator.device)
        sample = x[picks.to(x.device)].abs_()
        torch.abs(x, out=self._magnitudes)
        expected = s * k / n
        rank = expected + 4.0 * math.sqrt(expected) + 4.0
        for _attempt in range(3):
            r = min(s, math.ceil(rank))
            threshold = float(torch.kthvalue(sample, s - r + 1).values)
            candidates = self._scan(threshold)
            self.last_candidates = candidates.numel()
            if candidates.numel() >= k or threshold <= 0.0:
                return self._trim(candidates, k)
            rank *= 4.0
        self.fallbacks += 1
        return exact_topk(x, k)

    def _scan(self, threshold: float) -> torch.Tensor:
        """Sorted positions whose magnitude is >= threshold (> 0 when threshold is 0)."""
        if self.device.type == "cpu":
            mags = self._magnitudes.numpy()
            mask = self._mask.numpy()
            if threshold > 0.0:
                np.greater_equal(mags, threshold, out=mask)
            else:
                np.greater(mags, 0.0, out=mask)
            return torch.from_numpy(np.flatnonzero(mask))
        if threshold > 0.0:
            torch.ge(self._magnitudes, threshold, out=self._mask)
        else:
            torch.gt(self._magnitudes, 0.0, out=self._mask)
        return torch.nonzero(self._mask).squeeze(1)

    def _trim(self, candidates: torch.Tensor, k: int) -> torch.Tensor:
        c = candidates.numel()
        if c <= k:
            return candidates
        if self.device.type == "cpu":
            mags_np = self._magnitudes.numpy()[candidates.numpy()]
            kth_np = np.partition(mags_np, c - k)[c - k]
            kept = torch.from_numpy(candidates.numpy()[mags_np >= kth_np])
            mags = torch.from_numpy(mags_np)
        else:
            mags = self._magnitudes[candidates]
            kth = torch.kthvalue(mags, c - k + 1).values
            kept = candidates[mags >= kth]
        if kept.numel() > k:  # ties at the k-th magnitude: cut exactly, keep order
            order = torch.topk(mags, k, sorted=False).indices
            kept = torch.sort(candidates[order]).values
        return kept
