"""A replica's parameters: the model's flat buckets ``p`` and the base, the
parameters without this replica's unsent progress, so that ``p - base`` is exactly
what error feedback holds back plus the progress since the last send (the residual
and the anchor of the textbook form, ``base = anchor - residual``, in one buffer).

What peers (and this replica's settlement and consensus mix) add to the model is not
this replica's progress: it goes into ``p`` and into ``base`` alike. ``flush`` adds
the queued chunks to ``p`` on the training thread (two adds at positions (``add_at``) per bucket and
weight however many chunks arrived) and hands the same values to the base, which the
encoder adds just before it reads ``p - base``. The two never run at once: the
encoder holds the :class:`AccessGate` while it reads, and a flush that finds it held
leaves the chunks queued for the next step rather than wait.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ciuic_p2p.core.codec.chunk import ChunkHeader
from ciuic_p2p.core.codec.pieces import Part, PieceMap


@dataclass(frozen=True, slots=True)
class Range:
    """The part of a chunk header that says where its values go."""

    bucket: int
    range_start: int
    range_len: int


@dataclass(frozen=True, slots=True)
class Fragment:
    """This replica's parameters of one consensus fragment at one step: for each
    bucket, the values of ``[start, start + len)``."""

    index: int
    step: int
    starts: tuple[int, ...]
    values: tuple[torch.Tensor, ...]

    def piece_slice(self, piece: int, part: Part) -> torch.Tensor | None:
        """A sharded rank's (``starts`` and ``values`` per piece, in the piece's own
        coordinates): our values of a part of a peer's chunk on ``piece``, when this
        fragment holds all of it."""
        if not 0 <= piece < len(self.starts):
            return None
        lo = part.piece_offset - self.starts[piece]
        vals = self.values[piece]
        if lo < 0 or lo + part.length > vals.numel():
            return None
        return vals[lo : lo + part.length]

    def slice_of(self, bucket: int, start: int, length: int) -> torch.Tensor | None:
        """Our values of that range, when this fragment holds all of it."""
        if not 0 <= bucket < len(self.starts):
            return None
        lo = start - self.starts[bucket]
        vals = self.values[bucket]
        if lo < 0 or lo + length > vals.numel():
            return None
        return vals[lo : lo + length]


def add_at(
    target: torch.Tensor, positions: torch.Tensor, values: torch.Tensor, alpha: float
) -> None:
    """``target[positions] += alpha * values``. ``scatter_add_`` rather than
    ``index_add_``: on a CPU it took 5.2 ms where ``index_add_`` took 8.9 for 1M values
    into 100M (one thread, 46 chunks, with the product by ``alpha`` of a copy of the
    values); this is the training thread's largest cost per step."""
    if positions.dtype != torch.int64:
        positions = positions.long()
    target.scatter_add_(0, positions, values if alpha == 1.0 else values.mul(alpha))


def fragment_range(numel: int, index: int, fragments: int) -> tuple[int, int]:
    """Start and length of fragment ``index`` of ``fragments`` of a bucket."""
    start = numel * index // fragments
    return start, numel * (index + 1) // fragments - start


class AccessGate(Protocol):
    """Keeps the encoder's read of ``p - base`` and the training thread's adds to ``p``
    apart (a lock, and on CUDA the stream events that order the two streams)."""

    def enter_write(self, wait: bool) -> bool:
        """Before adding to ``p`` (training thread); False, without waiting, when the
        encoder holds the gate and ``wait`` is False."""
        ...

    def exit_write(self) -> None: ...

    def enter_read(self) -> None:
        """Before the encoder reads ``p`` (waits for a write in progress)."""
        ...

    def exit_read(self) -> None: ...


class OneThread:
    """The gate when the encoder runs on the caller's thread (tests, benches)."""

    def enter_write(self, wait: bool) -> bool:
        return True

    def exit_write(self) -> None:
        return None

    def enter_read(self) -> None:
        return None

    def exit_read(self) -> None:
        return None


_Sparse = tuple[torch.Tensor, torch.Tensor, object]
"""positions, values, where they came from (the sink's)."""
_Pending = tuple[int, torch.Tensor | None, int, torch.Tensor, float]
"""bucket, positions (None: a dense slice), slice start, values, weight."""


class AddSink(Protocol):
    """Told of every add to ``p`` as it is made, in order (core.replica.mirror: the
    other local ranks of a node replay them). ``source``: what the values came from,
    as the caller of :meth:`Parameters.add` said (None: nothing but themselves)."""

    def snapshot(self, index: int, step: int, fragments: int) -> None:
        """Consensus fragment ``index`` of ``fragments`` was taken at ``step`` here."""

    def applied(
        self,
        bucket: int,
        positions: torch.Tensor | None,
        start: int,
        values: torch.Tensor,
        w: float,
        source: Any,
    ) -> None: ...


class Parameters:
    """``buckets``: the flat tensors this replica holds, one per piece of ``pieces``
    (core.codec.pieces; None: the layout's whole buckets, an unsharded replica's).
    :meth:`add` and :meth:`add_slice` take the model's own coordinates (a layout's
    bucket and offset), as chunks say them, and add what falls on the pieces;
    :meth:`add_piece` takes a piece's own."""

    def __init__(
        self,
        buckets: Sequence[torch.Tensor],
        gate: AccessGate | None = None,
        sink: AddSink | None = None,
        pieces: PieceMap | None = None,
    ) -> None:
        self.buckets = list(buckets)
        self.pieces = None if pieces is None or pieces.is_whole else pieces
        if self.pieces is not None:
            if sink is not None:
                raise ValueError("a sharded replica's adds have no local ranks to mirror")
            sizes = [p.numel for p in self.pieces.pieces]
            if sizes != [b.numel() for b in self.buckets]:
                raise ValueError(f"the buckets must be the pieces' sizes, {sizes}")
        self.sink = sink
        self.base = [b.detach().clone() for b in self.buckets]
        self.gate: AccessGate = gate or OneThread()
        self._queued: dict[tuple[int, float], list[_Sparse]] = {}
        self._queued_dense: list[tuple[_Pending, object]] = []
        self._base_pending: list[_Pending] = []
        """In ``p`` already, not yet in the base (the encoder adds them)."""
        self.traffic_bytes = 0
        """Bytes of bucket memory the adds read and wrote (O(k) per chunk)."""

    @property
    def device(self) -> torch.device:
        return self.buckets[0].device if self.buckets else torch.device("cpu")

    def numel(self) -> int:
        return sum(b.numel() for b in self.buckets)

    def add(
        self,
        h: ChunkHeader | Range,
        positions: torch.Tensor | None,
        values: torch.Tensor,
        w: float,
        source: object = None,
    ) -> None:
        """Queue ``w * values`` for the model and the base (``source``: for the sink);
        ``positions`` relative to ``h.range_start``, None for a dense range."""
        pieces = self.pieces
        if pieces is None:
            if positions is None:
                self._queued_dense.append(((h.bucket, None, h.range_start, values, w), source))
                return
            if h.range_start:
                positions = positions + h.range_start
            self._queued.setdefault((h.bucket, w), []).append((positions, values, source))
            return
        if positions is None:
            for part in pieces.split(h.bucket, h.range_start, h.range_len):
                at = part.range_offset
                vals = values[at : at + part.length]
                self._queued_dense.append(((part.piece, None, part.piece_offset, vals, w), None))
            return
        for part in pieces.split_sparse(h.bucket, h.range_start, h.range_len, positions):
            assert part.positions is not None
            parts = self._queued.setdefault((part.piece, w), [])
            parts.append((part.positions, values[part.first : part.last], None))

    def add_slice(self, bucket: int, start: int, diff: torch.Tensor, source: object = None) -> None:
        """Queue ``diff`` for a slice of a bucket and of the base (the consensus mix)."""
        if self.pieces is None:
            self._queued_dense.append(((bucket, None, start, diff, 1.0), source))
            return
        self.add(Range(bucket, start, diff.numel()), None, diff, 1.0)

    def add_piece(self, piece: int, start: int, diff: torch.Tensor) -> None:
        """Queue ``diff`` for ``buckets[piece][start : start + len(diff)]`` and the
        base's (in the piece's own coordinates)."""
        self._queued_dense.append(((piece, None, start, diff, 1.0), None))

    def queued(self) -> bool:
        return bool(self._queued or self._queued_dense)

    def flush(self, wait: bool = False) -> bool:
        """Add every queued chunk to the model (call before the parameters are read);
        False when the encoder is reading and ``wait`` is False: they stay queued."""
        if not self.queued():
            return True
        if not self.gate.enter_write(wait):
            return False
        try:
            self._flush()
        finally:
            self.gate.exit_write()
        return True

    def _flush(self) -> None:
        sink = self.sink
        with torch.no_grad():
            for (bucket, w), parts in self._queued.items():
                # Each chunk's own adds: concatenating them first cost as much as the
                # adds (fresh buffers of 12 bytes per value, measured at 100M, 1%).
                for positions, values, source in parts:
                    add_at(self.buckets[bucket], positions, values, w)
                    self.traffic_bytes += values.numel() * (8 + 4 + 8)
                    self._base_pending.append((bucket, positions, 0, values, w))
                    if sink is not None:
                        sink.applied(bucket, positions, 0, values, w, source)
            for pending, source in self._queued_dense:
                bucket, _, start, values, w = pending
                self.buckets[bucket][start : start + values.numel()].add_(values, alpha=w)
                self.traffic_bytes += values.numel() * (4 + 8)
                self._base_pending.append(pending)
                if sink is not None:
                    sink.applied(bucket, None, start, values, w, source)
        self._queued.clear()
        self._queued_dense = []

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """Hold the gate (encoder) and bring the base up to what ``p`` holds of others."""
        self.gate.enter_read()
        try:
            self.settle_base()
            yield
        finally:
            self.gate.exit_read()

    def settle_base(self) -> None:
        """Add to the base what was added to ``p`` (with the gate held, or the encoder
        idle)."""
        pending, self._base_pending = self._base_pending, []
        with torch.no_grad():
            for bucket, positions, start, values, w in pending:
                if positions is None:
                    self.base[bucket][start : start + values.numel()].add_(values, alpha=w)
                    self.traffic_bytes += values.numel() * (4 + 8)
                else:
                    add_at(self.base[bucket], positions, values, w)
                    self.traffic_bytes += values.numel() * (8 + 4 + 8)

    def discard_queued(self) -> None:
        self._queued.clear()
        self._queued_dense = []

    def rebase(self) -> None:
        """The base becomes the parameters as they are: no unsent progress (after a
        restore). Call with the encoder idle."""
        self._base_pending = []
        with torch.no_grad():
            for base, bucket in zip(self.base, self.buckets, strict=True):
                base.copy_(bucket)
