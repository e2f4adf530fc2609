"""A rank's pieces of the flat parameter space, in the model's own coordinates.

Chunks address a model's parameters as (bucket, offset range) of its layout
(core.codec.layout), which every replica of the run computes alike from the global
shapes: that is the model's own coordinate system, whatever a node does with it. A
rank of a node that shards the model (FSDP2's ``fully_shard`` splits each tensor by
rows) holds, of each tensor, one contiguous range of rows: one contiguous range of
its bucket, a *piece*. An unsharded replica's pieces are its whole buckets.

:class:`PieceMap` says where a rank's pieces lie, and splits a chunk's range (and a
sparse chunk's sorted positions) into the parts that fall on them, so that a rank
applies exactly the part of a peer's chunk that overlaps its shard, whoever sent it
and however that node sharded.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ciuic_p2p.core.codec.layout import BucketLayout

__all__ = ["Part", "Piece", "PieceMap", "RowEnds"]


@dataclass(frozen=True, slots=True)
class Piece:
    """A contiguous range of one bucket that a rank holds."""

    bucket: int
    start: int
    numel: int

    @property
    def end(self) -> int:
        return self.start + self.numel


@dataclass(frozen=True, slots=True)
class Part:
    """The part of a chunk's range ``[start, start + length)`` that falls on a piece:
    ``length`` elements from ``piece_offset`` in the piece, ``range_offset`` in the
    chunk's range. For a sparse chunk, ``positions`` (relative to the piece) and the
    slice ``[first, last)`` of the chunk's values they take."""

    piece: int
    piece_offset: int
    range_offset: int
    length: int
    positions: torch.Tensor | None = None
    first: int = 0
    last: int = 0


class PieceMap:
    """Where a rank's pieces lie in a layout's buckets (sorted, disjoint)."""

    def __init__(self, layout: BucketLayout, pieces: Sequence[Piece]) -> None:
        self.layout = layout
        self.pieces = tuple(pieces)
        self._starts: dict[int, list[int]] = {}
        self._index: dict[int, list[int]] = {}
        order = sorted(range(len(self.pieces)), key=lambda i: _key(self.pieces[i]))
        for i in order:
            p = self.pieces[i]
            if not 0 <= p.bucket < len(layout.buckets):
                raise ValueError(f"piece {i} names bucket {p.bucket}, not in the layout")
            if p.numel < 1 or p.start < 0 or p.end > layout.buckets[p.bucket].numel:
                raise ValueError(f"piece {i} [{p.start}, {p.end}) lies outside its bucket")
            starts = self._starts.setdefault(p.bucket, [])
            index = self._index.setdefault(p.bucket, [])
            if index and self.pieces[index[-1]].end > p.start:
                raise ValueError(f"piece {i} overlaps piece {index[-1]}")
            starts.append(p.start)
            index.append(i)

    @classmethod
    def whole(cls, layout: BucketLayout) -> PieceMap:
        """An unsharded replica's: each bucket one piece."""
        return cls(layout, [Piece(b.index, 0, b.numel) for b in layout.buckets])

    @classmethod
    def of_rows(cls, layout: BucketLayout, rows: Mapping[str, tuple[int, int]]) -> PieceMap:
        """A rank holding, of each tensor named in ``rows``, the rows ``[first, first +
        count)`` of its first dimension (FSDP2's ``Shard(0)``), and of every other
        tensor all of it. A tensor of which it holds no row has no piece."""
        pieces = []
        for slot in layout.slots:
            if slot.name not in rows:
                pieces.append(Piece(slot.bucket, slot.offset, slot.numel))
                continue
            first, count = rows[slot.name]
            dim0 = slot.shape[0] if slot.shape else 1
            if first < 0 or count < 0 or first + count > dim0:
                raise ValueError(f"{slot.name}: rows [{first}, {first + count}) of {dim0}")
            row = math.prod(slot.shape[1:]) if slot.shape else 1
            if count:
                pieces.append(Piece(slot.bucket, slot.offset + first * row, count * row))
        return cls(layout, pieces)

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.pieces)

    @property
    def is_whole(self) -> bool:
        """Each bucket is piece of the same index, whole (an unsharded replica's):
        a chunk's range then falls on its bucket's piece as it is."""
        buckets = self.layout.buckets
        return len(self.pieces) == len(buckets) and all(
            p.bucket == b.index and p.start == 0 and p.numel == b.numel
            for p, b in zip(self.pieces, buckets, strict=True)
        )

    def restrict(
        self,
        bucket: int,
        start: int,
        length: int,
        positions: torch.Tensor | None,
        values: torch.Tensor,
    ) -> tuple[torch.Tensor | None, torch.Tensor] | None:
        """The part of a chunk of ``bucket``'s ``[start, start + length)`` that falls
        on this rank's pieces, still relative to ``start``: (positions, values), with
        positions None when the chunk is dense and falls on one piece whole; None when
        none of it does. ``positions`` (sorted, relative to ``start``) and ``values``
        are the chunk's as decoded (a dense chunk's: ``length`` values)."""
        if positions is None:
            parts = self.split(bucket, start, length)
            if not parts:
                return None
            if len(parts) == 1 and parts[0].length == length:
                return None, values
            index = torch.cat(
                [
                    torch.arange(p.range_offset, p.range_offset + p.length, device=values.device)
                    for p in parts
                ]
            )
            return index, values[index]
        parts = self.split_sparse(bucket, start, length, positions)
        if not parts:
            return None
        if len(parts) == 1 and parts[0].first == 0 and parts[0].last == positions.numel():
            return positions, values
        keep = torch.cat([torch.arange(p.first, p.last, device=positions.device) for p in parts])
        return positions[keep], values[keep]

    def split(self, bucket: int, start: int, length: int) -> list[Part]:
        """The parts of ``bucket``'s ``[start, start + length)`` on this rank's
        pieces, in order (none where the range misses them all)."""
        parts: list[Part] = []
        for i in self._overlapping(bucket, start, start + length):
            p = self.pieces[i]
            lo, hi = max(start, p.start), min(start + length, p.end)
            parts.append(Part(i, lo - p.start, lo - start, hi - lo))
        return parts

    def split_sparse(
        self, bucket: int, start: int, length: int, positions: torch.Tensor
    ) -> list[Part]:
        """:meth:`split` for a sparse chunk whose sorted ``positions`` are relative to
        ``start``: each part's positions (relative to its piece) and the slice of the
        chunk's values they take; parts with no position are left out."""
        parts: list[Part] = []
        for part in self.split(bucket, start, length):
            lo = part.range_offset
            hi = lo + part.length
            bounds = torch.tensor([lo, hi], dtype=positions.dtype, device=positions.device)
            first, last = (int(x) for x in torch.searchsorted(positions, bounds))
            if first == last:
                continue
            local = positions[first:last] - lo + part.piece_offset
            parts.append(
                Part(
                    part.piece,
                    part.piece_offset,
                    lo,
                    part.length,
                    positions=local,
                    first=first,
                    last=last,
                )
            )
        return parts

    def _overlapping(self, bucket: int, lo: int, hi: int) -> list[int]:
        starts = self._starts.get(bucket)
        if not starts or hi <= lo:
            return []
        index = self._index[bucket]
        at = max(0, bisect.bisect_right(starts, lo) - 1)
        found = []
        while at < len(starts) and starts[at] < hi:
            if self.pieces[index[at]].end > lo:
                found.append(index[at])
            at += 1
        return found


def _key(p: Piece) -> tuple[int, int]:
    return p.bucket, p.start


class RowEnds:
    """Where rows end in a layout's buckets: a sharded rank's piece ends at one (it
    holds whole rows of a tensor), so its last chunk may be short there."""

    def __init__(self, layout: BucketLayout) -> None:
        self._slots: dict[int, list[tuple[int, int, int]]] = {}
        for slot in layout.slots:
            row = math.prod(slot.shape[1:]) if slot.shape else 1
            self._slots.setdefault(slot.bucket, []).append((slot.offset, slot.numel, row))
        for slots in self._slots.values():
            slots.sort()
        self._starts = {b: [s[0] for s in slots] for b, slots in self._slots.items()}

    def at(self, bucket: int, offset: int) -> bool:
        """Whether ``offset`` of ``bucket`` is where a row of a tensor ends (a
        tensor's end included)."""
        starts = self._starts.get(bucket)
        if not starts or offset <= 0:
            return False
        i = bisect.bisect_left(starts, offset) - 1  # the slot holding offset - 1
        if i < 0:
            return False
        start, numel, row = self._slots[bucket][i]
        return offset <= start + numel and (offset - start) % max(1, row) == 0
