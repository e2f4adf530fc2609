"""A rank's pieces of the flat parameter space (core.codec.pieces): a chunk's range
and positions split into exactly the parts that fall on each rank's shard."""

from __future__ import annotations

import random

import pytest
import torch

from ciuic_p2p.core.codec.layout import BucketLayout
from ciuic_p2p.core.codec.pieces import Piece, PieceMap, RowEnds

SHAPES = [("embed", (33, 8)), ("norm", (8,)), ("mlp.w", (64, 16)), ("mlp.b", (3,)), ("out", (5, 7))]


def _layout() -> BucketLayout:
    return BucketLayout.build(SHAPES, dense_below_numel=100, max_bucket_numel=1500)


def _fsdp_rows(ranks: int) -> list[dict[str, tuple[int, int]]]:
    """Each rank's rows of each tensor as FSDP2's Shard(0) cuts them: ceil(dim0 /
    ranks) a rank, the last ranks with fewer (or none)."""
    out: list[dict[str, tuple[int, int]]] = [{} for _ in range(ranks)]
    for name, shape in SHAPES:
        each = -(-shape[0] // ranks)
        for r in range(ranks):
            first = min(shape[0], r * each)
            out[r][name] = (first, min(shape[0], first + each) - first)
    return out


def test_an_unsharded_replica_is_one_piece_per_bucket() -> None:
    layout = _layout()
    whole = PieceMap.whole(layout)
    assert whole.numel == layout.numel
    for b in layout.buckets:
        (part,) = whole.split(b.index, 3, 10)
        assert (part.piece, part.piece_offset, part.range_offset, part.length) == (
            b.index,
            3,
            0,
            10,
        )


@pytest.mark.parametrize("ranks", [1, 2, 3, 8])
def test_every_element_of_a_range_falls_on_exactly_one_rank(ranks: int) -> None:
    layout = _layout()
    maps = [PieceMap.of_rows(layout, rows) for rows in _fsdp_rows(ranks)]
    assert sum(m.numel for m in maps) == layout.numel
    rng = random.Random(ranks)
    for _ in range(200):
        b = rng.randrange(len(layout.buckets))
        n = layout.buckets[b].numel
        start = rng.randrange(n)
        length = rng.randrange(1, n - start + 1)
        covered = torch.zeros(length, dtype=torch.int64)
        for m in maps:
            for part in m.split(b, start, length):
                piece = m.pieces[part.piece]
                assert piece.bucket == b
                # The part's place in the bucket, seen from the piece and from the range.
                assert piece.start + part.piece_offset == start + part.range_offset
                covered[part.range_offset : part.range_offset + part.length] += 1
        assert bool((covered == 1).all())


@pytest.mark.parametrize("ranks", [2, 3])
def test_a_sparse_chunks_positions_go_each_to_one_rank_with_their_values(ranks: int) -> None:
    layout = _layout()
    maps = [PieceMap.of_rows(layout, rows) for rows in _fsdp_rows(ranks)]
    gen = torch.Generator().manual_seed(4)
    for b in range(len(layout.buckets)):
        n = layout.buckets[b].numel
        start, length = 5, n - 5
        positions = torch.randperm(length, generator=gen)[: length // 7].sort().values
        values = torch.randn(positions.numel(), generator=gen)
        seen = torch.zeros(n)
        for m in maps:
            for part in m.split_sparse(b, start, length, positions):
                assert part.positions is not None
                piece = m.pieces[part.piece]
                assert int(part.positions.min()) >= 0 and int(part.positions.max()) < piece.numel
                seen[piece.start + part.positions] += values[part.first : part.last]
        expected = torch.zeros(n)
        expected[start + positions] = values
        assert torch.equal(seen, expected)


def test_pieces_outside_their_bucket_or_overlapping_are_refused() -> None:
    layout = _layout()
    n = layout.buckets[0].numel
    with pytest.raises(ValueError, match="outside"):
        PieceMap(layout, [Piece(0, n - 2, 5)])
    with pytest.raises(ValueError, match="overlaps"):
        PieceMap(layout, [Piece(0, 0, 10), Piece(0, 5, 10)])
    with pytest.raises(ValueError, match="not in the layout"):
        PieceMap(layout, [Piece(len(layout.buckets), 0, 1)])
    with pytest.raises(ValueError, match="rows"):
        PieceMap.of_rows(layout, {"embed": (30, 4)})
    assert PieceMap(layout, []).split(0, 0, n) == []


@pytest.mark.parametrize("ranks", [2, 3])
def test_a_chunk_restricted_to_a_rank_keeps_exactly_its_elements(ranks: int) -> None:
    """What a rank takes of a peer's chunk (dense or sparse), still in the chunk's
    coordinates: the elements on its pieces, every rank's together the chunk's."""
    layout = _layout()
    maps = [PieceMap.of_rows(layout, rows) for rows in _fsdp_rows(ranks)]
    gen = torch.Generator().manual_seed(1)
    for b, info in enumerate(layout.buckets):
        start, length = info.numel // 5, info.numel - info.numel // 5
        values = torch.randn(length, generator=gen)
        positions = torch.sort(torch.randperm(length, generator=gen)[: length // 3]).values
        for pos, vals in ((None, values), (positions, values[: positions.numel()])):
            taken = torch.zeros(length)
            for m in maps:
                got = m.restrict(b, start, length, pos, vals)
                if got is None:
                    continue
                p, v = got
                index = torch.arange(length) if p is None else p
                assert p is None or bool((p[1:] > p[:-1]).all())
                taken[index] += v
                # Every position kept lies on one of this rank's pieces.
                for q in index.tolist():
                    assert m.split(b, start + q, 1)
            expected = torch.zeros(length)
            expected[torch.arange(length) if pos is None else pos] = vals
            assert torch.equal(taken, expected)


def test_rows_end_where_a_tensors_rows_do() -> None:
    layout = _layout()
    ends = RowEnds(layout)
    for slot in layout.slots:
        row = 1 if len(slot.shape) == 1 else slot.shape[1]
        assert ends.at(slot.bucket, slot.offset + row)
        assert ends.at(slot.bucket, slot.offset + slot.numel)
        if row > 1:
            assert not ends.at(slot.bucket, slot.offset + row - 1)
    assert not ends.at(0, 0) and not ends.at(len(layout.buckets), 8)
