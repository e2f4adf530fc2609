"""What arrives from a peer, as a replica's intake holds it between decoding (any
thread) and applying (between two steps): a :class:`Prepared` payload, or a
:class:`RefusedChunk` with its reason."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ciuic_p2p.core.codec.chunk import ChunkHeader
from ciuic_p2p.core.replica.messages import PayloadKind
from ciuic_p2p.errors import CiuicError

__all__ = ["Prepared", "RefusedChunk"]


class RefusedChunk(CiuicError):
    """A peer's chunk that this replica will not apply (reason in ``reason``)."""

    def __init__(
        self, reason: str, message: str, origin: str = "", kind: PayloadKind | None = None
    ) -> None:
        super().__init__(message)
        self.reason = reason
        self.origin = origin
        self.kind = kind
        self.set_aside_until: int | None = None
        """Set when this refusal set its origin aside (until this replica's step)."""
        """What was refused, when known (only refused updates count toward the
        origin's total at the end of a run)."""


@dataclass(frozen=True, slots=True)
class Prepared:
    """A decoded, checked payload waiting to be applied."""

    origin: str
    kind: PayloadKind
    header: ChunkHeader | None
    positions: torch.Tensor | None
    values: torch.Tensor | None
    rms: float
    step: int
    chunks: int
    """DONE: update chunks the origin sent in all."""
    ask: bool = False
    """JOIN: the origin wants this replica's JOIN in answer."""
    body: memoryview | None = None
    """A chunk's bytes as they came (core.replica.mirror replays them elsewhere)."""
    stateless: bool = False
    """JOIN: the origin hands no state (core.replica.messages ``Presence``)."""
