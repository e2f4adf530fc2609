from __future__ import annotations

import math

import torch
from hypothesis import given
from hypothesis import strategies as st

from ciuic_p2p.core.codec import indexcode
from ciuic_p2p.errors import InconsistentChunkError


def information_bound_bits(n: int, k: int) -> float:
    return (math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)) / math.log(2) / k


@given(
    st.lists(st.integers(min_value=0, max_value=2**31 - 2), max_size=300, unique=True),
)
def test_positions_round_trip(values: list[int]) -> None:
    positions = torch.tensor(sorted(values), dtype=torch.int64)
    gaps = indexcode.gaps_from_positions(positions)
    r = indexcode.choose_rice_bits(gaps)
    rem, unary = indexcode.rice_encode(gaps, r)
    decoded = indexcode.rice_decode(rem, unary, len(values), r, 2**31 - 1)
    assert torch.equal(decoded, positions)
    assert (rem.numel() + unary.numel()) * 8 >= indexcode.rice_cost_bits(gaps, r)


def test_every_rice_parameter_round_trips() -> None:
    g = torch.Generator().manual_seed(5)
    for r in range(0, 33):
        gaps = torch.randint(0, 2 ** min(r + 2, 40), (57,), generator=g)
        positions = torch.cumsum(gaps + 1, 0) - 1
        rem, unary = indexcode.rice_encode(gaps, r)
        out = indexcode.rice_decode(rem, unary, 57, r, int(positions[-1]) + 1)
        assert torch.equal(out, positions), r


def test_uniform_positions_cost_close_to_the_information_bound() -> None:
    n = 1_000_000
    for k in (10_000, 1_000):
        g = torch.Generator().manual_seed(k)
        positions = torch.sort(torch.randperm(n, generator=g)[:k]).values
        gaps = indexcode.gaps_from_positions(positions)
        r = indexcode.choose_rice_bits(gaps)
        rem, unary = indexcode.rice_encode(gaps, r)
        bits = (rem.numel() + unary.numel()) * 8 / k
        bound = information_bound_bits(n, k)
        assert bound <= bits <= bound + 0.15, (k, bits, bound)


def test_decoder_rejects_streams_that_disagree_with_the_count() -> None:
    gaps = torch.tensor([3, 0, 5])
    rem, unary = indexcode.rice_encode(gaps, 2)
    for count in (2, 4):
        try:
            indexcode.rice_decode(rem, unary, count, 2, 100)
        except InconsistentChunkError:
            continue
        raise AssertionError(f"count {count} accepted")


def test_decoder_rejects_positions_beyond_the_range() -> None:
    gaps = torch.tensor([3, 0, 5])  # positions 3, 4, 10
    rem, unary = indexcode.rice_encode(gaps, 2)
    assert torch.equal(indexcode.rice_decode(rem, unary, 3, 2, 11), torch.tensor([3, 4, 10]))
    try:
        indexcode.rice_decode(rem, unary, 3, 2, 10)
    except InconsistentChunkError:
        return
    raise AssertionError("out-of-range position accepted")


def test_decoder_rejects_trailing_and_padding_bits() -> None:
    gaps = torch.tensor([1, 2, 3])
    rem, unary = indexcode.rice_encode(gaps, 3)
    padded = torch.cat([unary, torch.zeros(1, dtype=torch.uint8)])
    dirty_rem = rem.clone()
    dirty_rem[-1] |= 1  # 9 remainder bits in 2 bytes: the last 7 are padding
    for args in ((rem, padded), (dirty_rem, unary)):
        try:
            indexcode.rice_decode(args[0], args[1], 3, 3, 100)
        except InconsistentChunkError:
            continue
        raise AssertionError("padding accepted")
