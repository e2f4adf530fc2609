"""A joiner's checks on a run's state (core.store.runstate, train.statesync's
sampling): issue 44, point 3, the arithmetic alone."""

from __future__ import annotations

import random

import pytest
import torch

from ciuic_p2p.core.store.runstate import agreement_refusal
from ciuic_p2p.core.store.statefile import pack_state, read_header
from ciuic_p2p.train.statesync import sample_spans, span_distance


def test_a_state_needs_one_agreeing_sample_and_no_majority_against_it() -> None:
    tol = 0.5
    assert agreement_refusal({"b": 0.05, "c": 0.07}, tol) is None
    # One hostile voucher cannot veto when honest ones outvote it (or tie it).
    assert agreement_refusal({"b": 0.05, "m": 1.4}, tol) is None
    assert agreement_refusal({"b": 0.05, "c": 0.06, "m": 1.4}, tol) is None
    # A forged state: every honest sample disagrees; one colluder does not carry it.
    assert agreement_refusal({"a": 1.3, "b": 1.4}, tol) is not None
    assert agreement_refusal({"a": 1.3, "b": 1.4, "m2": 0.0}, tol) is not None
    # Nobody answered: nothing vouches for it.
    assert agreement_refusal({"a": None, "b": None}, tol) is not None
    assert agreement_refusal({}, tol) is not None
    assert agreement_refusal({"a": None, "b": 0.1}, tol) is None


def _state(buckets: list[torch.Tensor]) -> bytearray:
    return pack_state(7, buckets, None, {"applied": {}})[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sampled_distance_tells_a_near_replica_from_noise(dtype: torch.dtype) -> None:
    """Spans fall inside the parameter buckets, on whole values; the sampled relative
    distance of a replica a little apart is small, of noise or NaN large."""
    gen = torch.Generator().manual_seed(0)
    base = [
        torch.randn(50_000, generator=gen).to(dtype),
        torch.randn(3_000, generator=gen).to(dtype),
    ]
    near = [(b.float() + 0.02 * torch.randn(b.shape, generator=gen)).to(dtype) for b in base]
    noise = [torch.randn(b.shape, generator=gen).mul(3).to(dtype) for b in base]
    nan = [b.clone() for b in base]
    nan[0].fill_(float("nan"))
    state = _state(base)
    header, start = read_header(state)
    spans = sample_spans(header, start, random.Random(1), 4, 8192)
    assert len(spans) == 4
    entries = {start + e[3]: e[4] for e in header["tensors"]}
    size = torch.empty((), dtype=dtype).element_size()
    for at, n, got_dtype in spans:
        assert got_dtype == dtype and n % size == 0 and 0 < n <= 8192
        assert any(o <= at and at + n <= o + nb for o, nb in entries.items())

    def sample(buckets: list[torch.Tensor]) -> bytes:
        other = _state(buckets)
        return b"".join(bytes(other[at : at + n]) for at, n, _ in spans)

    assert span_distance(state, sample(base), spans) == 0.0
    assert span_distance(state, sample(near), spans) < 0.05
    assert span_distance(state, sample(noise), spans) > 1.0
    assert span_distance(state, sample(nan), spans) == 2.0
    assert span_distance(state, b"short", spans) == 2.0
