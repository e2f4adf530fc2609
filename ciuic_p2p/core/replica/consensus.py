"""The consensus mix, receiving half: pulling this replica toward its peers'
parameter fragments (the sending half is ``Replica.snapshot_params`` and
``encode_params``; the reasons: docs/concepts/update-rule.md, "The consensus mix").

A peer's fragment of step s is compared with this replica's own fragment of step s
(the newest two are kept), refused when it lies farther than
``train.params_distance_max_ratio`` of their scale, and mixed in at
``consensus_mix / (N - 1)``, clipped against the other origins' drift
(core.replica.influence ``mix_scale``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ciuic_p2p.config.sections import TrainSection
from ciuic_p2p.core.codec.chunk import ChunkHeader
from ciuic_p2p.core.codec.origin import ReplayWindow
from ciuic_p2p.core.replica.figures import OwnNorms, ReplicaStats
from ciuic_p2p.core.replica.influence import InfluenceBound
from ciuic_p2p.core.replica.messages import PayloadKind
from ciuic_p2p.core.replica.mirror import AddedPull
from ciuic_p2p.core.replica.parameters import Fragment, Parameters
from ciuic_p2p.core.replica.received import RefusedChunk
from ciuic_p2p.core.replica.roster import Roster
from ciuic_p2p.errors import ReplayedChunkError

__all__ = ["MAX_HELD_CHUNKS", "ConsensusMix", "HeldFragment"]


MAX_HELD_CHUNKS = 4096
"""Fragment chunks held per bucket and round (``_mix``): a bucket's fragment is one
chunk per ``codec.chunk_payload_bytes`` of it (a 4 GiB bucket at 1 MiB), from at most
a few origins before the second one's first arrives; past it a chunk is dropped."""


@dataclass(frozen=True, slots=True)
class HeldFragment:
    """A consensus fragment's difference from this replica's parameters of its step,
    waiting for another origin's in its bucket to be clipped against."""

    origin: str
    header: ChunkHeader
    diff: torch.Tensor
    diff_sq: float
    body: memoryview | None


class ConsensusMix:
    """The receiving half of the consensus mix (see the module docstring); the parts it
    shares with the rest of the replica are passed in."""

    def __init__(
        self,
        *,
        parameters: Parameters,
        roster: Roster,
        norms: OwnNorms,
        own_params: dict[int, Fragment],
        influence: InfluenceBound,
        train: TrainSection,
        stats: ReplicaStats,
        replicas: Callable[[], int],
    ) -> None:
        """``own_params``: this replica's fragments at the steps it sent them;
        ``replicas``: N as this replica weights by it, now."""
        self.parameters = parameters
        self.roster = roster
        self.norms = norms
        self.own_params = own_params
        self.influence = influence
        self.train = train
        self.stats = stats
        self.replicas = replicas
        self._seen = ReplayWindow(window_steps=1 << 16)
        self._held: dict[tuple[int, int], list[HeldFragment]] = {}
        """Per bucket and round: the chunks of fragments heard before any other
        origin's (:meth:`_mix`), for the rounds whose parameters are kept (two)."""

    def apply(
        self, origin: str, h: ChunkHeader, values: torch.Tensor, body: memoryview | None
    ) -> None:
        self._drop_expired_held()
        if self.parameters.pieces is not None:
            self._apply_parts(origin, h, values, body)
            return
        mine = self._own_fragment(h)
        if mine is None:
            # We sent none at that step (joined since, skipped, or the peer's is
            # older than the fragments we keep): nothing to compare it with, so it
            # is not mixed. Holding it against our parameters of now instead
            # refused honest late fragments (a peer 20 steps behind in outer mode).
            self._check_once(origin, h)
            self.stats.params_unmatched += 1
            return
        self._check_params(origin, h, values, mine)
        self._check_once(origin, h)
        self._mix(origin, h, values, mine, body)

    def _apply_parts(
        self, origin: str, h: ChunkHeader, values: torch.Tensor, body: memoryview | None
    ) -> None:
        """A sharded rank (core.codec.pieces): each part of the peer's fragment chunk
        that falls on one of its pieces is held against its own fragment of that piece
        and mixed as a chunk of its own; every part is checked before any is mixed."""
        pieces = self.parameters.pieces
        assert pieces is not None
        fragment = self.own_params.get(h.step)
        parts = []
        for part in pieces.split(h.bucket, h.range_start, h.range_len):
            mine = None if fragment is None else fragment.piece_slice(part.piece, part)
            if mine is None:
                continue
            at = part.range_offset
            sub = dataclasses.replace(
                h, range_start=h.range_start + at, range_len=part.length, count=part.length
            )
            parts.append((sub, values[at : at + part.length], mine))
        if not parts:
            self._check_once(origin, h)
            self.stats.params_unmatched += 1
            return
        for sub, theirs, mine in parts:
            self._check_params(origin, sub, theirs, mine)
        self._check_once(origin, h)
        for sub, theirs, mine in parts:
            self._mix(origin, sub, theirs, mine, None)

    def _check_once(self, origin: str, h: ChunkHeader) -> None:
        try:
            self._seen.check_and_record(h)
        except ReplayedChunkError as exc:
            raise RefusedChunk(
                "duplicate", f"chunk from {origin}: {exc}", origin, PayloadKind.PARAMS
            ) from None

    def _own_fragment(self, h: ChunkHeader) -> torch.Tensor | None:
        """Our parameters of the same step and span as a peer's fragment, if we kept
        them (``own_params``: the fragments of our last two consensus rounds)."""
        fragment = self.own_params.get(h.step)
        return None if fragment is None else fragment.slice_of(h.bucket, *_span(h))

    def _check_params(
        self, origin: str, h: ChunkHeader, values: torch.Tensor, own: torch.Tensor
    ) -> None:
        """Parameters far from ours, measured against our parameters' own scale (a
        faulty node, not drift), are refused; see ``train.params_distance_max_ratio``."""
        n = math.sqrt(max(1, h.range_len))
        dist = float(torch.linalg.vector_norm(values - own)) / n
        scale = float(torch.linalg.vector_norm(own)) / n
        t = self.train
        floor = 0.0
        if self.norms.count[h.bucket] >= t.norm_warmup_chunks:
            floor = t.update_norm_max_ratio * self.norms.rms[h.bucket]
        allowed = max(t.params_distance_max_ratio * scale, floor)
        # Where ours are all zero and no floor exists yet, nothing is allowed to move.
        if not math.isfinite(dist) or dist > allowed:
            raise RefusedChunk(
                "norm",
                f"parameters from {origin} (step {h.step}) are {dist:.3g} RMS away from "
                f"this replica's ({scale:.3g} RMS), over the {allowed:.3g} allowed",
                origin,
                PayloadKind.PARAMS,
            )

    def _mix(
        self,
        origin: str,
        h: ChunkHeader,
        values: torch.Tensor,
        mine: torch.Tensor,
        body: memoryview | None,
    ) -> None:
        """Pulls this replica toward a peer's fragment, clipped against the other
        origins' (core.replica.influence ``mix_scale``). The first fragment of a bucket,
        heard before any other origin's of its round, has nothing to be clipped
        against: where the run has other replicas to send one, its chunks are held
        until another origin's comes (then all are mixed, each held against the
        others), or dropped once this replica keeps no parameters of its round."""
        with torch.no_grad():
            diff = values.sub(mine)
            diff_sq = float(torch.dot(diff.float(), diff.float())) / max(1, diff.numel())
        alive = self.roster.mesh_alive
        known = self.influence.drift_known(origin, h.bucket, h.step, diff_sq, alive)
        key = (h.bucket, h.step)
        if not known and self.replicas() > 2:
            # With one other replica its fragment is the whole of the others' view.
            held = self._held.setdefault(key, [])
            if len(held) >= MAX_HELD_CHUNKS:
                self.stats.clipped += 1  # more chunks than a bucket's fragment has
                return
            held.append(HeldFragment(origin, h, diff, diff_sq, body))
            return
        self._pull(origin, h, diff, diff_sq, body)
        for other in self._held.pop(key, []):
            if other.origin != origin and other.origin in alive:
                self._pull(other.origin, other.header, other.diff, other.diff_sq, other.body)
            else:
                self.stats.clipped += 1

    def _pull(
        self,
        origin: str,
        h: ChunkHeader,
        diff: torch.Tensor,
        diff_sq: float,
        body: memoryview | None,
    ) -> None:
        mix = self.train.consensus_mix / max(1, self.replicas() - 1)
        alive = self.roster.mesh_alive
        factor = self.influence.mix_scale(origin, h.bucket, h.step, diff_sq, alive)
        if factor < 1.0:
            self.stats.clipped += 1
        if factor <= 0.0:
            return
        with torch.no_grad():
            diff.mul_(mix * factor)
        source = None if body is None else AddedPull(body, mix * factor)
        self.parameters.add_slice(h.bucket, h.range_start, diff, source)
        self.stats.params_mixed += 1

    def _drop_expired_held(self) -> None:
        """A held fragment whose round we keep no parameters of any more: no other
        origin's came to hold it against, and it is not mixed."""
        for key, held in list(self._held.items()):
            if key[1] not in self.own_params:
                del self._held[key]
                self.stats.clipped += len(held)


def _span(h: ChunkHeader) -> tuple[int, int]:
    return h.range_start, h.range_len
