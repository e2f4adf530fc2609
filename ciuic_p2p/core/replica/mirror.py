"""What a node's other local ranks need to hold the parameters its first rank holds,
in about the bytes of the chunks the node received.

On a node whose local ranks train one replica with DDP, every rank holds the whole
model, and only the first talks to the mesh. Broadcasting every bucket after every
step cost the whole model per step (4 GB at 1B parameters). Instead the first rank
records what it adds to its parameters, in the order it adds it (:class:`MirrorLog`,
the sink of core.replica.parameters), and the other ranks replay it
(:class:`MirrorReplay`):

- a peer's update chunk, and this replica's own chunk at its settlement, as the chunk
  itself (the compressed bytes) and the weight it was added at;
- a consensus fragment's pull as the peer's fragment chunk and its scale, the
  difference taken against the replaying rank's own snapshot of that step, which
  the log marks where the first rank took it;
- anything else (an outer step's kick, the last round) as dense values.

Replayed in the same order with the same operations, the ranks stay bit-identical.
The log is a local format between processes of one node, versioned, with hard size
limits; :class:`MirrorError` for any bad byte sequence.
"""

from __future__ import annotations

import struct
from collections import Counter
from dataclasses import dataclass

import torch

from ciuic_p2p.core.codec.bucket import decode_chunk
from ciuic_p2p.core.replica.parameters import add_at, fragment_range
from ciuic_p2p.errors import CiuicError, CodecError

__all__ = [
    "AddedChunk",
    "AddedPull",
    "MirrorError",
    "MirrorLog",
    "MirrorReplay",
    "MirrorSource",
]

VERSION = 1
MAX_LOG_BYTES = 1 << 34
"""A log larger than this is refused (16 GiB: a 4-billion-parameter dense step)."""
_CHUNK, _MIX, _SNAPSHOT, _DENSE = 1, 2, 3, 4
_WEIGHTED = struct.Struct("<dI")
_SNAP = struct.Struct("<QII")
_DENSE_HEAD = struct.Struct("<IQdIB")
KEPT_SNAPSHOTS = 2
"""Snapshots a replaying rank keeps, as the first rank keeps its consensus fragments."""


class MirrorError(CiuicError):
    """A mirror log that cannot be replayed."""


@dataclass(frozen=True, slots=True)
class AddedChunk:
    """An add that is a chunk's decoded values times the weight: the chunk's bytes."""

    body: bytes | bytearray | memoryview


@dataclass(frozen=True, slots=True)
class AddedPull:
    """A consensus pull: ``scale * (fragment chunk - own snapshot of its step)``."""

    body: bytes | bytearray | memoryview
    scale: float


MirrorSource = AddedChunk | AddedPull


class MirrorLog:
    """The first rank's record of what it added to its parameters, in order (the
    sink core.replica.parameters calls); :meth:`take` hands it out as bytes."""

    def __init__(self) -> None:
        self._parts: list[bytes | bytearray | memoryview] = []
        self.paused = False
        """Once paused (``finish``, which ends with a whole broadcast) nothing is
        recorded."""
        self.bytes_taken = 0
        self.kinds: Counter[str] = Counter()
        """Entries recorded, by kind (chunk, pull, dense, snapshot)."""

    def pause(self) -> None:
        """Record nothing from now on (what is recorded is dropped)."""
        self.paused = True
        self._parts = []

    def applied(
        self,
        bucket: int,
        positions: torch.Tensor | None,
        start: int,
        values: torch.Tensor,
        w: float,
        source: object,
    ) -> None:
        """``w * values`` was added to ``bucket`` at ``positions`` (absolute; None: the
        slice from ``start``)."""
        if self.paused:
            return
        if isinstance(source, AddedChunk):
            self._add(bytes((_CHUNK,)), _WEIGHTED.pack(w, len(source.body)), source.body)
            self.kinds["chunk"] += 1
        elif isinstance(source, AddedPull):
            self._add(bytes((_MIX,)), _WEIGHTED.pack(source.scale, len(source.body)), source.body)
            self.kinds["pull"] += 1
        else:
            self.kinds["dense"] += 1
            n = values.numel()
            sparse = positions is not None
            head = _DENSE_HEAD.pack(bucket, start, w, n, int(sparse))
            parts: list[bytes | bytearray | memoryview] = [bytes((_DENSE,)), head]
            if positions is not None:
                parts.append(_raw(positions.to(torch.int64)))
            parts.append(_raw(values.to(torch.float32)))
            self._add(*parts)

    def snapshot(self, index: int, step: int, fragments: int) -> None:
        """The first rank took its consensus fragment ``index`` of ``fragments`` at
        ``step`` here."""
        if not self.paused:
            self._add(bytes((_SNAPSHOT,)), _SNAP.pack(step, index, fragments))
            self.kinds["snapshot"] += 1

    def take(self) -> bytes:
        """Everything recorded since the last call, as one log."""
        parts, self._parts = self._parts, []
        out = b"".join([bytes((VERSION,)), *parts])
        self.bytes_taken += len(out)
        return out

    def _add(self, *parts: bytes | bytearray | memoryview) -> None:
        self._parts.extend(parts)


class MirrorReplay:
    """A follower rank's side: replays logs into its own parameter buckets."""

    def __init__(self, buckets: list[torch.Tensor]) -> None:
        self.buckets = buckets
        self.snapshots: dict[int, tuple[int, tuple[int, ...], tuple[torch.Tensor, ...]]] = {}
        """Per step: the fragment's index, each bucket's start and values."""
        self.bytes_replayed = 0

    def apply(self, log: bytes | bytearray | memoryview) -> int:
        """Replay one log (:meth:`MirrorLog.take`); the entries it held."""
        view = memoryview(log)
        if len(view) > MAX_LOG_BYTES:
            raise MirrorError(f"mirror log of {len(view)} bytes exceeds the limit")
        if len(view) < 1 or view[0] != VERSION:
            raise MirrorError("mirror log of an unknown version")
        at, entries = 1, 0
        with torch.no_grad():
            while at < len(view):
                at = self._entry(view, at)
                entries += 1
        self.bytes_replayed += len(view)
        return entries

    def _entry(self, view: memoryview, at: int) -> int:
        kind = view[at]
        at += 1
        try:
            if kind in (_CHUNK, _MIX):
                weight, length = _WEIGHTED.unpack_from(view, at)
                at += _WEIGHTED.size
                body = view[at : at + length]
                if len(body) != length:
                    raise MirrorError("mirror log truncated in a chunk")
                self._chunk(body, weight, mix=kind == _MIX)
                return at + int(length)
            if kind == _SNAPSHOT:
                step, index, fragments = _SNAP.unpack_from(view, at)
                self._snapshot(step, index, fragments)
                return at + _SNAP.size
            if kind == _DENSE:
                return self._dense(view, at)
        except struct.error:
            raise MirrorError("mirror log truncated") from None
        raise MirrorError(f"unknown mirror entry kind {kind}")

    def _chunk(self, body: memoryview, weight: float, *, mix: bool) -> None:
        try:
            self._add_chunk(body, weight, mix=mix)
        except CodecError as exc:
            raise MirrorError(f"mirror chunk: {exc}") from None
        except RuntimeError as exc:  # a chunk whose shape does not fit what it names
            raise MirrorError(f"mirror chunk does not fit: {exc}") from None

    def _add_chunk(self, body: memoryview, weight: float, *, mix: bool) -> None:
        decoded = decode_chunk(body, self.buckets[0].device)
        h = decoded.header
        if (
            h.bucket >= len(self.buckets)
            or h.range_start + h.range_len > self.buckets[h.bucket].numel()
        ):
            raise MirrorError("mirror chunk outside the model")
        target = self.buckets[h.bucket]
        values = decoded.values
        if mix:
            mine = self._mine(h.step, h.bucket, h.range_start, h.range_len)
            diff = values.sub(mine)
            diff.mul_(weight)
            target[h.range_start : h.range_start + diff.numel()].add_(diff, alpha=1.0)
        elif decoded.positions is None:
            target[h.range_start : h.range_start + values.numel()].add_(values, alpha=weight)
        else:
            positions = decoded.positions
            if h.range_start:
                positions = positions + h.range_start
            add_at(target, positions, values, weight)

    def _mine(self, step: int, bucket: int, start: int, length: int) -> torch.Tensor:
        kept = self.snapshots.get(step)
        if kept is None:
            raise MirrorError(f"a pull against a snapshot of step {step} not taken here")
        _, starts, values = kept
        lo = start - starts[bucket]
        if lo < 0 or lo + length > values[bucket].numel():
            raise MirrorError("a pull outside the snapshot's fragment")
        return values[bucket][lo : lo + length]

    def _snapshot(self, step: int, index: int, fragments: int) -> None:
        if not 1 <= fragments <= 1 << 20 or not 0 <= index < fragments:
            raise MirrorError("mirror snapshot out of range")
        starts, values = [], []
        for bucket in self.buckets:
            start, length = fragment_range(bucket.numel(), index, fragments)
            starts.append(start)
            values.append(bucket[start : start + length].clone())
        while len(self.snapshots) >= KEPT_SNAPSHOTS:
            self.snapshots.pop(min(self.snapshots))
        self.snapshots[step] = (index, tuple(starts), tuple(values))

    def _dense(self, view: memoryview, at: int) -> int:
        bucket, start, w, n, sparse = _DENSE_HEAD.unpack_from(view, at)
        at += _DENSE_HEAD.size
        if bucket >= len(self.buckets):
            raise MirrorError("mirror entry outside the model")
        target = self.buckets[bucket]
        positions = None
        if sparse:
            positions = _tensor(view, at, n, torch.int64)
            at += 8 * n
        values = _tensor(view, at, n, torch.float32).to(target.device)
        at += 4 * n
        if positions is None:
            if start + n > target.numel():
                raise MirrorError("mirror entry outside the model")
            target[start : start + n].add_(values, alpha=w)
        else:
            if n and not (int(positions.min()) >= 0 and int(positions.max()) < target.numel()):
                raise MirrorError("mirror positions outside the model")
            add_at(target, positions.to(target.device), values, w)
        return at


def _raw(t: torch.Tensor) -> memoryview:
    host = t.detach().contiguous().cpu()
    return host.view(torch.uint8).numpy().data


def _tensor(view: memoryview, at: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    size = n * torch.empty(0, dtype=dtype).element_size()
    raw = view[at : at + size]
    if len(raw) != size:
        raise MirrorError("mirror log truncated in its values")
    if not size:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=dtype)
