"""The run's last round: every replica averages the same quantized copies of all the
replicas' parameters, its own included, so that ``finish()`` leaves one model.

Each replica's own unsent residual and the consensus mix, which covers a fraction of
the model per round, left replicas 0.6-1.0% apart after a run (relative L2), and a
user saves the model of whichever node they look at. So, once every live replica
said DONE and all their updates were applied, each replica publishes its parameters
once as dense low-bit chunks (``FINAL``; fp16 by default) and keeps its own copy as
sent. With M members (itself and the peers that said DONE) it ends at the mean of
the M copies::

    p <- q_own + sum over peers j of (q_j - q_own) / M

which needs only its own copy beside the model (2 bytes per parameter at fp16),
adds each peer's chunk as it arrives, and ends every replica that heard the same
copies at the same parameters, up to the rounding of fp32 additions.

A peer's chunk is held against the own copy of its range: farther than
``finish_average_distance_max_ratio`` times that range's RMS (or its bucket's, when
more) it is refused, so one member moves a replica at most that far, divided by M.
Every range of every member is taken once; a second copy of a range is refused.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from ciuic_p2p.core.codec.bucket import DENSE_BY_NAME, DENSE_DTYPES
from ciuic_p2p.core.codec.chunk import Codec
from ciuic_p2p.errors import CiuicError

__all__ = [
    "FINAL_DTYPES",
    "FinalRefusal",
    "FinalRound",
    "FinalSummary",
    "copy_dtype",
    "held_dtype",
    "own_copy",
    "shape_error",
]

MIN_CHUNK_ELEMENTS = 1024
"""The fewest elements a chunk of an honest copy holds, but for its bucket's last
(``codec.chunk_payload_bytes`` is at least 4096, a value at most 4 bytes): a copy
in smaller pieces is refused, so a member cannot make a replica track millions."""
MAX_PIECES = 4096
"""Disjoint ranges tracked per member and bucket (adjacent ones merge: an honest copy
in order is one): more gaps than the mesh's reordering leaves are refused."""
FINAL_DTYPES = {name: DENSE_DTYPES[codec] for name, codec in DENSE_BY_NAME.items()}
"""``train.finish_average`` values other than ``off``: the dtype copies are sent in."""


def copy_dtype(bucket: torch.Tensor, wanted: torch.dtype) -> torch.dtype:
    """The dtype a bucket's copy is sent in: a bf16 or fp16 model's own (exact; fp16
    cannot hold bf16's range), else ``wanted``, or bf16 where fp16 would overflow."""
    if bucket.dtype in (torch.bfloat16, torch.float16):
        return bucket.dtype
    # fp16's largest finite value: a parameter past it would arrive as inf and be
    # refused as non-finite.
    overflows = bucket.numel() > 0 and float(bucket.detach().abs().max()) >= 65504.0
    return torch.bfloat16 if wanted == torch.float16 and overflows else wanted


def shape_error(bucket_numel: int, start: int, length: int, row_end: bool = False) -> str | None:
    """Why a copy's chunk of ``[start, start + length)`` in a bucket of
    ``bucket_numel`` elements is not one an honest replica sends, or None.
    ``row_end``: the range ends where a tensor's row does (a sharded rank's piece
    may end there, core.codec.pieces)."""
    if length < 1:
        return "an empty range"
    if length < MIN_CHUNK_ELEMENTS and start + length != bucket_numel and not row_end:
        return (
            f"{length} elements, fewer than {MIN_CHUNK_ELEMENTS}, ending neither at its "
            "bucket's end nor at a row's"
        )
    return None


def held_dtype(codec: Codec) -> torch.dtype:
    """The dtype a copy's decoded values are held in until this replica's round
    starts: the one they were sent in (exact), fp32 for any other dense codec."""
    return DENSE_DTYPES.get(codec, torch.float32)


def own_copy(bucket: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bucket's copy as sent (a new tensor, never a view of the model)."""
    copy = bucket.detach().to(dtype)
    return copy.clone() if copy.data_ptr() == bucket.data_ptr() else copy


Part = tuple[int, int, torch.Tensor]
"""A copy's part on one bucket (or piece): (its index, start, values)."""


class FinalRefusal(CiuicError):
    """A peer's final copy chunk not taken (reason in ``reason``)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(slots=True)
class FinalSummary:
    """How the last round went, as ``stats["final_round"]`` reports it."""

    members: int
    """Replicas averaged, this one included."""
    complete: bool
    """Every member's whole copy was taken."""
    missing: list[str]
    """Members whose copy did not arrive whole (refused or not in time)."""
    refused: dict[str, int] = field(default_factory=dict)
    """Chunks refused, by reason."""
    distance_max: float = 0.0
    """The largest RMS distance of a peer's chunk from this replica's copy, relative
    to its range's RMS: how far apart the replicas were before the round."""
    counted_otherwise: list[str] = field(default_factory=list)
    """Members whose copies say they average another number of copies: they heard
    other members' DONE, and end at another mean than this replica."""
    seconds: float = 0.0
    """How long the round took, from publishing this replica's copy (the hook's)."""


class FinalRound:
    """One replica's last round (see the module docstring): the own copy, the members,
    and which of their ranges were taken."""

    def __init__(
        self,
        own: Sequence[torch.Tensor],
        members: Iterable[str],
        max_distance_ratio: float,
        buckets: Sequence[int] | None = None,
    ) -> None:
        """``own``: this replica's copy of each bucket, as sent (low-bit dtype), or of
        each piece of them a sharded rank holds (the ranges taken are then the parts
        of the peers' chunks that fall on the pieces; ``buckets``: each piece's
        bucket, whose RMS over the rank's pieces is the scale a part is held against,
        as a whole bucket's is: a piece of a few elements alone was a scale no honest
        copy kept to); ``members``: the peers whose copies are averaged (not this
        replica). The caller checks a chunk's shape as sent (:func:`shape_error`)."""
        self.own = list(own)
        self.members = frozenset(members)
        self.count = len(self.members) + 1
        self.max_distance_ratio = max_distance_ratio
        self.numel = sum(o.numel() for o in self.own)
        groups = list(range(len(self.own))) if buckets is None else list(buckets)
        sq: dict[int, float] = {}
        count: Counter[int] = Counter()
        for group, o in zip(groups, self.own, strict=True):
            sq[group] = sq.get(group, 0.0) + float(torch.linalg.vector_norm(o.float())) ** 2
            count[group] += o.numel()
        self.bucket_rms = [math.sqrt(sq[g] / max(1, count[g])) for g in groups]
        """Per bucket (or piece: its bucket's over the pieces held), the own copy's RMS."""
        self.received: Counter[str] = Counter()
        """Elements taken per member."""
        self._ranges: dict[tuple[str, int], list[tuple[int, int]]] = {}
        """Per member and bucket: the sorted (start, end) ranges taken."""
        self.refused: Counter[str] = Counter()
        self.distance_max = 0.0
        self.counted_otherwise: set[str] = set()

    @property
    def complete(self) -> bool:
        return all(self.received[m] == self.numel for m in self.members)

    def missing(self) -> list[str]:
        return sorted(m for m in self.members if self.received[m] != self.numel)

    def take(
        self, origin: str, bucket: int, start: int, values: torch.Tensor, claimed: int = 0
    ) -> torch.Tensor:
        """What adding ``origin``'s copy of ``bucket[start : start + len(values)]``
        moves this replica by (fp32, to add to that slice); raises
        :class:`FinalRefusal`, counted, with nothing recorded. ``claimed``: the number
        of copies the origin averages, as its chunk says (0: not said)."""
        return self.take_parts(origin, [(bucket, start, values)], claimed)[0]

    def take_parts(
        self, origin: str, parts: Sequence[Part], claimed: int = 0
    ) -> list[torch.Tensor]:
        """:meth:`take` for the parts of one chunk (a sharded rank's pieces it falls
        on: each (piece, start, values)): held against the own copy as one range, all
        taken or none."""
        try:
            diffs = self._take(origin, parts)
        except FinalRefusal as exc:
            self.refused[exc.reason] += 1
            raise
        if claimed and claimed != self.count:
            self.counted_otherwise.add(origin)
        return diffs

    def _take(self, origin: str, parts: Sequence[Part]) -> list[torch.Tensor]:
        if origin not in self.members:
            raise FinalRefusal(
                "final_member",
                f"final copy from {origin}, which is not among this replica's "
                f"{self.count - 1} peers of the last round (no DONE heard from it)",
            )
        places = [self._place(origin, bucket, start, values) for bucket, start, values in parts]
        if len({p[0] for p in places}) != len(places):
            raise FinalRefusal("malformed", f"final copy from {origin} names a piece twice")
        with torch.no_grad():
            mine = [self.own[b][s:e].float() for b, s, e, _ in places]
            diffs = [values.float() - m for (_, _, values), m in zip(parts, mine, strict=True)]
        n = math.sqrt(max(1, sum(d.numel() for d in diffs)))
        dist = math.sqrt(sum(float(torch.dot(d, d)) for d in diffs)) / n
        own_rms = math.sqrt(sum(float(torch.dot(m, m)) for m in mine)) / n
        scale = max(own_rms, *(self.bucket_rms[p[0]] for p in places))
        allowed = self.max_distance_ratio * scale
        if not math.isfinite(dist) or dist > allowed:
            b, s, e, _ = places[0]
            raise FinalRefusal(
                "norm",
                f"final copy from {origin} of bucket {b} [{s}, {e}) is "
                f"{dist:.3g} RMS away from this replica's ({scale:.3g} RMS), over the "
                f"{allowed:.3g} allowed (train.finish_average_distance_max_ratio)",
            )
        if scale > 0.0:
            self.distance_max = max(self.distance_max, dist / scale)
        for bucket, start, end, at in places:
            self._record(origin, bucket, start, end, at)
        return [d.div_(self.count) for d in diffs]

    def _place(
        self, origin: str, bucket: int, start: int, values: torch.Tensor
    ) -> tuple[int, int, int, int]:
        """(bucket, start, end, where among the ranges taken) of a range not taken yet."""
        end = start + values.numel()
        if not 0 <= bucket < len(self.own) or not 0 <= start < end <= self.own[bucket].numel():
            raise FinalRefusal("range", f"final copy from {origin} lies outside the model")
        ranges = self._ranges.get((origin, bucket), [])
        at = bisect.bisect_left(ranges, (start, end))
        if (at > 0 and ranges[at - 1][1] > start) or (at < len(ranges) and ranges[at][0] < end):
            raise FinalRefusal(
                "duplicate",
                f"final copy from {origin} of bucket {bucket} [{start}, {end}) overlaps "
                "a range already taken",
            )
        joins = (at > 0 and ranges[at - 1][1] == start) or (
            at < len(ranges) and ranges[at][0] == end
        )
        if not joins and len(ranges) >= MAX_PIECES:
            raise FinalRefusal(
                "range", f"final copy from {origin} of bucket {bucket} in too many pieces"
            )
        return bucket, start, end, at

    def _record(self, origin: str, bucket: int, start: int, end: int, at: int) -> None:
        # Kept merged: an honest copy, in order or nearly, stays one range or a few.
        ranges = self._ranges.setdefault((origin, bucket), [])
        joins_before = at > 0 and ranges[at - 1][1] == start
        joins_after = at < len(ranges) and ranges[at][0] == end
        if joins_before and joins_after:
            ranges[at - 1] = (ranges[at - 1][0], ranges.pop(at)[1])
        elif joins_before:
            ranges[at - 1] = (ranges[at - 1][0], end)
        elif joins_after:
            ranges[at] = (start, ranges[at][1])
        else:
            ranges.insert(at, (start, end))
        self.received[origin] += end - start

    def coverage(self) -> Iterator[tuple[int, torch.Tensor]]:
        """For each bucket some element of which not every member's copy reached: the
        number of copies, the own included, taken for each element (fp32). A replica
        then rescales what it added, so that it ends at the mean of the copies it
        took, not short of it: where a member sent nothing (it died, or it is a
        member that said DONE to hold the others up), every replica that heard the
        same others still ends at the same mean."""
        for b, own in enumerate(self.own):
            counts: torch.Tensor | None = None
            for member in self.members:
                taken = self._ranges.get((member, b), [])
                if sum(e - s for s, e in taken) == own.numel():
                    continue
                if counts is None:
                    counts = torch.full((own.numel(),), float(self.count), device=own.device)
                counts -= 1.0
                for s, e in taken:
                    counts[s:e] += 1.0
            if counts is not None:
                yield b, counts

    def summary(self) -> FinalSummary:
        return FinalSummary(
            members=self.count,
            complete=self.complete,
            missing=self.missing(),
            refused=dict(self.refused),
            distance_max=round(self.distance_max, 6),
            counted_otherwise=sorted(self.counted_otherwise),
        )
