"""A replica's parameters: the model's flat buckets, the anchor its next update is
measured from, and the chunk values queued to be added to both, which ``flush`` adds
with two ``index_add_`` per bucket however many chunks arrived."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ciuic_p2p.core.codec.chunk import ChunkHeader


@dataclass(frozen=True, slots=True)
class Range:
    """The part of a chunk header that says where its values go."""

    bucket: int
    range_start: int
    range_len: int


class Parameters:
    def __init__(self, buckets: Sequence[torch.Tensor]) -> None:
        self.buckets = list(buckets)
        self.anchor = [b.detach().clone() for b in self.buckets]
        self._queued: dict[tuple[int, float], list[tuple[torch.Tensor, torch.Tensor]]] = {}

    @property
    def device(self) -> torch.device:
        return self.buckets[0].device if self.buckets else torch.device("cpu")

    def add(
        self,
        h: ChunkHeader | Range,
        positions: torch.Tensor | None,
        values: torch.Tensor,
        w: float,
    ) -> None:
        """Queue ``w * values`` for the bucket and the anchor (a dense range is added
        at once: it is one slice)."""
        if positions is None:
            with torch.no_grad():
                for t in (self.buckets[h.bucket], self.anchor[h.bucket]):
                    t[h.range_start : h.range_start + h.range_len].add_(values, alpha=w)
            return
        if h.range_start:
            positions = positions + h.range_start
        self._queued.setdefault((h.bucket, w), []).append((positions, values))

    def add_slice(self, bucket: int, start: int, diff: torch.Tensor) -> None:
        """Add ``diff`` to a slice of a bucket and its anchor now (the consensus mix)."""
        self.flush()
        with torch.no_grad():
            s = slice(start, start + diff.numel())
            self.buckets[bucket][s].add_(diff)
            self.anchor[bucket][s].add_(diff)

    def flush(self) -> None:
        """Add every queued chunk (call before the parameters are read)."""
        if not self._queued:
            return
        with torch.no_grad():
            for (bucket, w), parts in self._queued.items():
                if len(parts) == 1:
                    positions, values = parts[0]
                else:
                    positions = torch.cat([p for p, _ in parts])
                    values = torch.cat([v for _, v in parts])
                self.buckets[bucket].index_add_(0, positions, values, alpha=w)
                self.anchor[bucket].index_add_(0, positions, values, alpha=w)
        self._queued.clear()

    def discard_queued(self) -> None:
        self._queued.clear()

    def reanchor(self) -> None:
        """The anchor becomes the parameters as they are (after a restore)."""
        with torch.no_grad():
            for anchor, bucket in zip(self.anchor, self.buckets, strict=True):
                anchor.copy_(bucket)
