"""A replica's figures (``ReplicaStats``, what ``MeshSync.stats`` reports) and the
running RMS of its own chunks, shared by its sending and receiving halves."""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field

import numpy as np

__all__ = ["STALENESS_BINS", "OwnNorms", "ReplicaStats"]

STALENESS_BINS = 4096


@dataclass(slots=True)
class ReplicaStats:
    steps: int = 0
    sends: int = 0
    chunks_sent: int = 0
    bytes_published: int = 0
    applied: int = 0
    applied_from: collections.Counter[str] = field(default_factory=collections.Counter)
    """Updates applied per origin, kept after the origin left (one entry a member)."""
    params_mixed: int = 0
    chunk_bytes_received: int = 0
    """Bytes of the peers' update and consensus chunks decoded here."""
    final_chunks: int = 0
    """Chunks of the peers' copies taken in the last round (core.replica.final)."""
    params_unmatched: int = 0
    """Peer parameters of a step this replica kept none of its own for: not mixed."""
    before_state: int = 0
    """Peer chunks dropped because the state this replica restored holds them."""
    excused: int = 0
    """Times a replica was excused from the staleness bound (see Replica.excuse)."""
    other_runs: int = 0
    """JOIN, GONE and DONE of other runs on the same mesh, ignored."""
    refused: collections.Counter[str] = field(default_factory=collections.Counter)
    last_refusal: str = ""
    clipped: int = 0
    """Peer update chunks taken at less than their full norm or weight (the influence
    bound: an update past the clip, an origin working against this replica's
    direction), and consensus fragments mixed at less than their full pull (clipped, or
    heard with no other origin's to hold them against and dropped)."""
    weight_raised: int = 0
    """Peer update chunks whose claimed replica count was below the replicas whose
    updates of the steps before (within the staleness bound) reached this one,
    weighted by that count instead."""
    set_aside: dict[str, int] = field(default_factory=dict)
    """Origins set aside after repeated refusals: until which of this replica's steps."""
    backoffs: int = 0
    """Times the backlog was over the high mark (interval doubled, density halved)."""
    residual_norm: float = 0.0
    residual_norm_max: float = 0.0
    staleness: np.ndarray = field(default_factory=lambda: np.zeros(STALENESS_BINS, np.int64))

    def staleness_quantile(self, q: float) -> int:
        total = int(self.staleness.sum())
        if total == 0:
            return 0
        idx = int(np.searchsorted(np.cumsum(self.staleness), math.ceil(q * total)))
        return min(idx, STALENESS_BINS - 1)


class OwnNorms:
    """The running RMS of this replica's own chunks, per bucket: what a peer's chunk
    is held against, with the other replicas' (:meth:`Intake.rms_reference`; written
    as this replica encodes, read as peers' chunks arrive)."""

    def __init__(self, buckets: int) -> None:
        self.rms: list[float] = [0.0] * buckets
        self.count: list[int] = [0] * buckets

    def record(self, bucket: int, rms: float) -> None:
        n = self.count[bucket]
        if rms > 0.0:
            old = self.rms[bucket]
            self.rms[bucket] = rms if n == 0 else 0.9 * old + 0.1 * rms
            self.count[bucket] = n + 1
