"""A replica's intake of its peers' payloads (the receiving half of core.replica.rule).

``prepare`` decodes and checks what needs no replica state, on any thread (the
trainer's channel decodes on its reader thread while the model computes); ``apply``
then, between two steps, checks what does (the RMS bound against this replica's own
updates, exactly once per origin, incarnation, step, bucket and range start), queues
the values, and ``flush`` adds every queued chunk with two adds at positions per bucket.
Consensus fragments go to the consensus mix (core.replica.consensus), the last
round's copies to core.replica.final.
Every refusal names its reason (``other_run``, ``layout``, ``range``, ``malformed``,
``duplicate``, ``norm``, ``pace``, ``set_aside``; for the last round's copies also
``final_member`` and ``late``) and is counted; nothing changes
before a payload is accepted. What an accepted update may weigh and move is bounded by
what this replica knows, not by what the chunk says (core.replica.influence).
JOIN, GONE and DONE of another run sharing the mesh are ignored and counted apart.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math

import torch

from ciuic_p2p.config.sections import TrainSection
from ciuic_p2p.core.codec.bucket import ChunkSource, decode_chunk
from ciuic_p2p.core.codec.chunk import ChunkHeader, parse_chunk
from ciuic_p2p.core.codec.layout import BucketLayout, describe_layout
from ciuic_p2p.core.codec.origin import ReplayWindow
from ciuic_p2p.core.codec.pieces import RowEnds
from ciuic_p2p.core.replica.consensus import MAX_HELD_CHUNKS, ConsensusMix
from ciuic_p2p.core.replica.figures import STALENESS_BINS, OwnNorms, ReplicaStats
from ciuic_p2p.core.replica.final import (
    MIN_CHUNK_ELEMENTS,
    FinalRefusal,
    FinalRound,
    FinalSummary,
    held_dtype,
    shape_error,
)
from ciuic_p2p.core.replica.influence import InfluenceBound, PaceRefusal
from ciuic_p2p.core.replica.messages import (
    MAX_NODE_RANKS,
    PayloadKind,
    TrainWireError,
    decode_done,
    decode_payload,
    decode_presence,
)
from ciuic_p2p.core.replica.mirror import AddedChunk
from ciuic_p2p.core.replica.outer import OuterStep
from ciuic_p2p.core.replica.parameters import Fragment, Parameters
from ciuic_p2p.core.replica.received import Prepared, RefusedChunk
from ciuic_p2p.core.replica.roster import PeerState, Roster
from ciuic_p2p.errors import CodecError, ReplayedChunkError

__all__ = [
    "MAX_HELD_CHUNKS",
    "STALENESS_BINS",
    "Intake",
    "OwnNorms",
    "Prepared",
    "RefusedChunk",
    "ReplicaStats",
]


class Intake:
    """The receiving half of a replica (see the module docstring); the parts it
    shares with the sending half (core.replica.rule) are passed in."""

    def __init__(
        self,
        *,
        layout: BucketLayout,
        parameters: Parameters,
        roster: Roster,
        norms: OwnNorms,
        own_params: dict[int, Fragment],
        source: ChunkSource,
        train: TrainSection,
        stats: ReplicaStats,
        outer: OuterStep | None = None,
    ) -> None:
        """``own_params``: this replica's consensus fragments at the steps it sent them
        (the consensus mix compares a peer's of step s with ours of step s);
        ``outer``: the outer step, in ``outer`` mode (each chunk's coefficient)."""
        self.layout = layout
        self.parameters = parameters
        self.roster = roster
        self.norms = norms
        self.own_params = own_params
        self.source = source
        self.train = train
        self.stats = stats
        self.outer = outer
        self._updates = ReplayWindow(window_steps=1 << 16)
        self.influence = InfluenceBound(
            train,
            len(layout.buckets),
            parameters.device,
            roster.me,
            announced=lambda: ((name, p.step) for name, p in roster.peers.items()),
        )
        self.consensus = ConsensusMix(
            parameters=parameters,
            roster=roster,
            norms=norms,
            own_params=own_params,
            influence=self.influence,
            train=train,
            stats=stats,
            replicas=lambda: self.replicas,
        )
        self.floors: dict[str, int] = {}
        """Per origin: update steps at or below this are in the restored state."""
        self.held_finals: dict[str, int] = {}
        """Origins' last updates' stamps a restored state holds (:meth:`set_finals`)."""
        self.counted_by_state: dict[str, list[int]] = {}
        """Origins whose chunks in the restored state its writer counted: [the writer's
        count of the floor's step, the arrivals of that step here] (set_floors)."""
        self.final: FinalRound | None = None
        """The run's last round, once this replica started it (:meth:`start_final`)."""
        self.final_ended = False
        self._row_ends = RowEnds(layout)
        self._final_early: list[Prepared] = []
        """Peers' copies that came before this replica started its last round (it
        was still applying their last updates); at most one model's worth each."""
        self._final_early_elements: collections.Counter[str] = collections.Counter()
        self._final_early_counts: collections.Counter[str] = collections.Counter()
        self._final_early_limit = (
            layout.numel // MIN_CHUNK_ELEMENTS
            + len(layout.buckets)
            + len(layout.slots) * MAX_NODE_RANKS
        )
        """Early copy chunks held per member: an honest copy's full-size chunks, its
        buckets' last, and a sharded sender's short ones at its pieces' ends."""
        self._final_early_keys: set[tuple[str, int, int]] = set()

    @property
    def weight(self) -> float:
        return 1.0 / self.replicas

    @property
    def replicas(self) -> int:
        """N as this replica weights by it: itself and the other replicas, less those
        whose updates weigh nothing here (core.replica.influence)."""
        return 1 + self.influence.counted(self.roster.counted_names())

    def chunk_weight(self, h: ChunkHeader) -> float:
        """The weight an update chunk gets here: the one its origin gave it (the same
        in every replica, whoever counted a joiner or a death first), but never more
        than 1 over the replicas whose updates of the steps before it (within the
        staleness bound) reached this one (a claim of a smaller run buys no larger
        share); this replica's own when the chunk does not say. The origin weights its
        own chunks the same way."""
        return self.weight_of(h.step, h.replicas)

    def weight_of(self, step: int, claimed: int) -> float:
        """:meth:`chunk_weight` of a chunk of ``step`` that claimed ``claimed``
        replicas (0: it does not say)."""
        if not claimed:
            return self.weight
        return 1.0 / max(claimed, self.influence.replicas_seen(step) - 1)

    def set_floors(
        self, applied: dict[str, int], reached: dict[str, tuple[int, int]] | None = None
    ) -> None:
        """Each origin's newest step in a restored state: its chunks up to there are
        held by the state and dropped when they arrive. ``reached``: per origin, how
        many of its chunks the state holds and how many of those are of the floor's
        step, as its writer counted them. Those origins' accounts start there; of their
        chunks that arrive here up to the floor, only those of the floor's step past
        that many are counted (a trainer restarted under a daemon that stayed never
        gets again what that daemon delivered to its earlier life: a count of arrivals
        fell short of the origin's DONE for good)."""
        self.floors = {k: int(v) for k, v in applied.items() if k != self.roster.me}
        self.held_finals = {}
        self.counted_by_state = {}
        for origin, (count, at_floor) in (reached or {}).items():
            state = self.roster.account(origin) if origin in self.floors else None
            if state is not None:
                state.held_by_state = count
                state.at_step, state.at_step_count = self.floors[origin], at_floor
                self.counted_by_state[origin] = [at_floor, 0]

    def _count_held(self, origin: str, h: ChunkHeader, state: PeerState | None) -> None:
        """Count an arrival that the restored state holds (see :meth:`set_floors`)."""
        if state is None:
            return
        counted = self.counted_by_state.get(origin)
        if counted is None:
            state.held_by_state += 1
            state.reached(h.step)
        elif h.step == self.floors.get(origin):
            counted[1] += 1  # of the floor's step: those past the writer's count are new
            if counted[1] > counted[0]:
                state.held_by_state += 1
                state.at_step_count += 1

    def set_finals(self, finals: dict[str, tuple[int, int]]) -> None:
        """Origins whose run's last update (stamped past their last step, core.replica.
        rule ``take_final``) a restored state holds: (their last step, the stamp). Their
        floor is their last step, so that a resumed run's updates of the steps up to
        the stamp are taken; the last update itself, dense at the stamp, stays held."""
        for origin, (done, stamp) in finals.items():
            if origin != self.roster.me and self.floors.get(origin, -1) == stamp:
                self.floors[origin] = done
                self.held_finals[origin] = stamp

    def _state_holds(self, origin: str, h: ChunkHeader) -> bool:
        """The restored state holds this update chunk already."""
        if h.step <= self.floors.get(origin, -1):
            return True
        return h.step == self.held_finals.get(origin) and not h.codec.is_sparse

    def receive(self, origin: str, payload: bytes | memoryview, step: int) -> None:
        """Prepare and apply one mesh payload from ``origin``; raises
        :class:`RefusedChunk` (and counts it) when refused, with nothing changed."""
        try:
            self.apply(self.prepare(origin, payload), step)
        finally:
            self.parameters.flush()

    def register(self, origin: str, payload: bytes | memoryview | None, step: int = 0) -> None:
        """A chunk of ``origin`` arrived and is kept for later (raw ``payload``, or
        prepared, of ``step``): it is a replica, that far on at least."""
        state = self.roster.account(origin)
        if payload is not None:
            with contextlib.suppress(TrainWireError, CodecError):
                step = parse_chunk(decode_payload(payload).body)[0].step
        if state is not None:
            state.step = max(state.step, step)

    def held_by_state(self, origin: str, payload: bytes | memoryview) -> bool:
        """True, and counted as held by the restored state, for an update of this run
        that the restored state already holds, read from its header alone (the updates
        that arrive while a joiner fetches its state are mostly these: decoding each
        cost the joiner seconds). False for anything else: prepare and apply it."""
        try:
            msg = decode_payload(payload)
            if msg.kind is not PayloadKind.UPDATE:
                return False
            h, _ = parse_chunk(msg.body)
        except (TrainWireError, CodecError):
            return False  # prepare refuses it, with the reason
        if h.run_id != self.source.run_id or not self._state_holds(origin, h):
            return False
        self.stats.before_state += 1
        self._count_held(origin, h, self.roster.account(origin))
        return True

    def prepare(self, origin: str, payload: bytes | memoryview) -> Prepared | RefusedChunk:
        """Decode and check what needs no replica state (any thread: the channel's
        reader decodes while the trainer computes)."""
        try:
            return self._prepare(origin, payload)
        except RefusedChunk as exc:
            exc.origin = origin
            return exc

    def _prepare(self, origin: str, payload: bytes | memoryview) -> Prepared:
        try:
            msg = decode_payload(payload)
        except TrainWireError as exc:
            raise RefusedChunk("malformed", f"from {origin}: {exc}") from None
        if msg.kind is PayloadKind.DONE:
            try:
                run_id, step, chunks = decode_done(msg.body)
            except TrainWireError as exc:
                raise RefusedChunk("malformed", f"from {origin}: {exc}") from None
            if run_id != self.source.run_id:
                raise RefusedChunk(
                    "other_run", f"{origin} finished another run", origin, PayloadKind.DONE
                )
            return Prepared(origin, PayloadKind.DONE, None, None, None, 0.0, step, chunks)
        if msg.kind in (PayloadKind.JOIN, PayloadKind.GONE):
            try:
                presence = decode_presence(msg.body)
            except TrainWireError as exc:
                raise RefusedChunk("malformed", f"from {origin}: {exc}") from None
            if presence.run_id != self.source.run_id:
                raise RefusedChunk("other_run", f"{origin} trains another run", origin, msg.kind)
            theirs = presence.layout
            if theirs is not None and theirs.layout_id != self.layout.layout_id:
                # Not a replica of this run's model: never counted, never waited for.
                raise RefusedChunk(
                    "layout",
                    f"{origin}'s replica of this run has "
                    f"{describe_layout(theirs.layout_id, theirs.tensors, theirs.params)}; "
                    f"this one has {self.layout.describe()}: the replicas of one run must "
                    "train the same model (parameter names, shapes and order)",
                    origin,
                    msg.kind,
                )
            return Prepared(
                origin, msg.kind, None, None, None, 0.0, presence.step, 0, presence.ask,
                stateless=presence.stateless,
            )  # fmt: skip
        try:
            decoded = decode_chunk(msg.body, self.parameters.device)
        except CodecError as exc:
            raise RefusedChunk("malformed", f"chunk from {origin}: {exc}") from None
        h = decoded.header
        try:
            self._check(origin, h)
        except RefusedChunk as exc:
            exc.kind = msg.kind
            raise
        if msg.kind in (PayloadKind.PARAMS, PayloadKind.FINAL) and h.codec.is_sparse:
            raise RefusedChunk("malformed", f"parameters from {origin} are not dense")
        rms = float(torch.linalg.vector_norm(decoded.values)) / math.sqrt(max(1, h.count))
        if msg.kind is not PayloadKind.FINAL:
            self.stats.chunk_bytes_received += len(msg.body)
        positions, values = decoded.positions, decoded.values
        pieces = self.parameters.pieces
        if pieces is not None and msg.kind is PayloadKind.UPDATE:
            # What falls on this rank's pieces, still in the chunk's coordinates: the
            # bounds weigh what moves this rank's shard, against the updates this rank
            # sent of it (a chunk's whole RMS held against one rank's rows refused
            # honest chunks whose largest values lay on the other rank's).
            part = pieces.restrict(h.bucket, h.range_start, h.range_len, positions, values)
            if part is None:
                positions, values = _NO_POSITIONS, values[:0]
            else:
                positions, values = part
            norm = float(torch.linalg.vector_norm(values)) if values.numel() else 0.0
            rms = norm / math.sqrt(max(1, values.numel()))
        return Prepared(origin, msg.kind, h, positions, values, rms, h.step, 0, body=msg.body)

    def apply(self, item: Prepared | RefusedChunk, step: int) -> None:
        """Apply a prepared payload (training thread; ``step``: this replica's),
        exactly once; a refusal is counted and raised."""
        if (
            isinstance(item, RefusedChunk)
            and item.reason == "other_run"
            and item.kind
            in (
                PayloadKind.JOIN,
                PayloadKind.GONE,
                PayloadKind.DONE,
            )
        ):
            self.stats.other_runs += 1  # runs share a mesh: their presence is not an error
            return
        try:
            self._apply(item, step)
        except RefusedChunk as exc:
            self.stats.refused[exc.reason] += 1
            self.stats.last_refusal = str(exc)
            if exc.kind is PayloadKind.UPDATE and exc.reason != "duplicate" and exc.origin:
                account = self.roster.existing_account(exc.origin)
                if account is not None:
                    account.refused += 1
            # Not faults: the mesh's repairs, a peer counted out of the last round
            # (its DONE not heard here), a copy after the round ended.
            counts = exc.reason not in (
                "duplicate",
                "set_aside",
                "other_run",
                "final_member",
                "late",
            )
            if counts and exc.origin and self.influence.refused(exc.origin, step):
                until = step + self.train.set_aside_steps
                self.stats.set_aside[exc.origin] = until
                exc.set_aside_until = until
            raise

    def _apply(self, item: Prepared | RefusedChunk, step: int) -> None:
        if isinstance(item, RefusedChunk):
            raise item
        origin = item.origin
        if item.kind is PayloadKind.GONE:
            self.roster.gone(origin)
            return
        if item.kind is PayloadKind.JOIN:
            self.roster.join(origin, item.step, item.ask, step)
            self.roster.note_stateless(origin, item.stateless)
            return
        state = self.roster.account(origin)
        if item.kind is not PayloadKind.DONE and self.influence.set_aside(origin, step):
            raise RefusedChunk(
                "set_aside",
                f"{origin} is set aside after repeated refusals (until step "
                f"{self.influence.origins[origin].aside_until})",
                origin,
                item.kind,
            )
        if item.kind is PayloadKind.DONE:
            if state is not None:
                state.done_at, state.chunks_sent = item.step, item.chunks
            return
        if self.final is not None and item.kind is not PayloadKind.FINAL:
            # The last round averages what every replica held when it began: an
            # update taken during it would move this replica alone, and the round's
            # rescaling would amplify it.
            raise RefusedChunk(
                "late", f"chunk from {origin} after the last round began", origin, item.kind
            )
        h = item.header
        assert h is not None and item.values is not None
        if item.kind is PayloadKind.PARAMS:
            self.consensus.apply(origin, h, item.values, item.body)
        elif item.kind is PayloadKind.FINAL:
            self._apply_final(item, h)
        else:
            self._apply_update(item, h, state, step)

    def start_final(self, final: FinalRound, step: int) -> None:
        """Start the last round: take the copies that came before it (refusals
        counted in the round's summary)."""
        self.final = final
        early, self._final_early = self._final_early, []
        self._final_early_elements.clear()
        self._final_early_counts.clear()
        self._final_early_keys.clear()
        for item in early:
            with contextlib.suppress(RefusedChunk):
                self.apply(item, step)

    def end_final(self) -> FinalSummary | None:
        """End the last round: later copies are refused as ``late``."""
        self.final_ended = True
        self._final_early = []
        self._final_early_keys.clear()
        return None if self.final is None else self.final.summary()

    def _apply_final(self, item: Prepared, h: ChunkHeader) -> None:
        origin, values = item.origin, item.values
        assert values is not None
        if self.final_ended:
            raise RefusedChunk(
                "late", f"final copy from {origin} after the last round", origin, item.kind
            )
        if self.final is None:
            # Before this replica's own round (it still applies the peers' last
            # updates): held, from a replica whose DONE was heard (it sends its copy
            # after), one model's worth each at most, in the dtype it came in.
            state = self.roster.existing_account(origin)
            if state is None or state.done_at is None:
                raise RefusedChunk(
                    "final_member",
                    f"final copy from {origin}, not a replica of this run that said DONE",
                    origin,
                    item.kind,
                )
            self._check_copy_shape(origin, h)
            key = (origin, h.bucket, h.range_start)
            if key in self._final_early_keys:  # the mesh's at-least-once delivery
                raise RefusedChunk(
                    "duplicate", f"final copy from {origin} held already", origin, item.kind
                )
            if self._final_early_elements[origin] + h.range_len > self.layout.numel:
                raise RefusedChunk(
                    "range",
                    f"final copy from {origin} holds more than the model",
                    origin,
                    item.kind,
                )
            if self._final_early_counts[origin] >= self._final_early_limit:
                # Short chunks are an honest sharded sender's at its rows' ends only:
                # one per piece of each of its ranks, beside the full-size ones.
                raise RefusedChunk(
                    "range",
                    f"final copy from {origin} in more chunks than a copy has",
                    origin,
                    item.kind,
                )
            self._final_early_keys.add(key)
            self._final_early_counts[origin] += 1
            self._final_early_elements[origin] += h.range_len
            held = values.to(held_dtype(h.codec))
            # Its bytes are not kept: only the mirror of a node's local ranks reads
            # them, and it records nothing of the last round.
            self._final_early.append(dataclasses.replace(item, values=held, body=None))
            return
        # The copy's shape as its origin sent it (its parts on a sharded rank's pieces
        # need not be whole chunks); then each part is taken on its piece.
        self._check_copy_shape(origin, h)
        pieces = self.parameters.pieces
        if pieces is None:
            parts = [(h.bucket, h.range_start, values)]
        else:
            parts = [
                (p.piece, p.piece_offset, values[p.range_offset : p.range_offset + p.length])
                for p in pieces.split(h.bucket, h.range_start, h.range_len)
            ]
        if not parts:  # none of it on this rank's pieces
            self.stats.final_chunks += 1
            return
        try:
            # One chunk, held against the own copy as one range (a few bias elements
            # alone, a part, drifted further than their bucket and were refused).
            diffs = self.final.take_parts(origin, parts, h.replicas)
        except FinalRefusal as exc:
            raise RefusedChunk(exc.reason, str(exc), origin, item.kind) from None
        for (piece, start, _), diff in zip(parts, diffs, strict=True):
            self.parameters.add_piece(piece, start, diff)
        self.stats.final_chunks += 1

    def _check_copy_shape(self, origin: str, h: ChunkHeader) -> None:
        end = h.range_start + h.range_len
        why = shape_error(
            self.layout.buckets[h.bucket].numel, *_span(h), self._row_ends.at(h.bucket, end)
        )
        if why is not None:
            raise RefusedChunk("malformed", f"final copy from {origin}: {why}", origin)

    def rms_reference(self, bucket: int) -> float | None:
        """What a peer's update chunk's RMS is held against in ``bucket``: this
        replica's own running RMS, or the lower median of the replicas' (its own
        included, core.replica.influence) when that is more. Against its own alone, a
        replica whose updates ran small refused an honest peer's: a restarted
        replica's, whose updates grow for a while after its return, at 52 times a
        receiver's own. A member cannot raise the median above an honest replica's,
        nor lower the bound below this replica's own. None before the warm-up."""
        own, count = self.norms.rms[bucket], self.norms.count[bucket]
        if count < self.train.norm_warmup_chunks:
            return None
        median = self.influence.rms_reference(bucket, self.roster.mesh_alive, own, count)
        return own if median is None else max(own, median)

    def _apply_update(
        self, item: Prepared, h: ChunkHeader, state: PeerState | None, step: int
    ) -> None:
        origin, values = item.origin, item.values
        assert values is not None
        self.influence.record_rms(origin, h.bucket, item.rms)
        ref = self.rms_reference(h.bucket)
        # Per step the update covers, as the clip holds it (core.replica.influence):
        # a replica whose channel was full while its daemon restarted merged dozens of
        # steps into one send, refused at 65 times one step's RMS.
        covered = self.influence.covered(origin, h.step)
        if ref is not None and item.rms > self.train.update_norm_max_ratio * ref * covered:
            raise RefusedChunk(
                "norm",
                f"chunk from {origin} (step {h.step}, covering {covered}) has RMS "
                f"{item.rms:.3g}, over {self.train.update_norm_max_ratio:g} x the "
                f"replicas' running {ref:.3g} per step",
                origin,
                PayloadKind.UPDATE,
            )
        outer = self.outer
        if outer is not None and not outer.accepts(h.step, step, self.train.staleness_bound_steps):
            raise RefusedChunk(
                "range",
                f"chunk from {origin} claims step {h.step}, more than the staleness bound "
                f"and a round ahead of this replica's {step}",
                origin,
                PayloadKind.UPDATE,
            )
        # Before the replay window: a resumed run's own update of a held last
        # update's step (sparse, at the stamp) is not that update again.
        if self._state_holds(origin, h):
            self.stats.before_state += 1
            self._count_held(origin, h, state)
            return
        self._check_once(self._updates, origin, h)
        influence = self.influence
        try:
            influence.check_pace(origin, h.step, step)
        except PaceRefusal as exc:
            raise RefusedChunk(
                "pace", f"chunk from {origin}: {exc}", origin, PayloadKind.UPDATE
            ) from None
        influence.take_step(origin, h.step)
        if h.replicas and h.replicas < influence.replicas_seen(h.step) - 1:
            self.stats.weight_raised += 1
        w = self.chunk_weight(h)
        factor = 1.0
        if values.numel():  # none of it on a sharded rank's pieces: nothing to bound
            factor = influence.scale(
                origin,
                h.step,
                h.bucket,
                item.positions,
                h.range_start,
                values,
                self.roster.mesh_alive,
                step,
            )
        if factor < 1.0:
            self.stats.clipped += 1
        w *= factor
        if w > 0.0 and values.numel():
            source = None if item.body is None else AddedChunk(item.body)
            if self.outer is None:
                self.parameters.add(h, item.positions, values, w, source)
            else:
                coefficient = self.outer.coefficient(h.step)
                self.parameters.add(h, item.positions, values, w * coefficient, source)
                self.outer.record(h.bucket, h.range_start, item.positions, values, w, h.step)
        if state is not None:
            state.step = max(state.step, h.step)
            state.applied_step = max(state.applied_step, h.step)
            state.applied += 1
            state.reached(h.step)
            if state.lagging and state.step > step - self.train.staleness_bound_steps:
                state.lagging = False
        self.stats.applied += 1
        self.stats.applied_from[origin] += 1
        self.stats.staleness[min(STALENESS_BINS - 1, max(0, step - h.step))] += 1

    def _check(self, origin: str, h: ChunkHeader) -> None:
        if h.run_id != self.source.run_id:
            raise RefusedChunk(
                "other_run", f"chunk from {origin} is of run {h.run_id.hex()}, not this one"
            )
        if h.layout_id != self.layout.layout_id:
            raise RefusedChunk(
                "layout",
                f"chunk from {origin} is for parameter layout {h.layout_id:016x}; this "
                f"model's is {self.layout.layout_id:016x} (another model shape?)",
            )
        buckets = self.layout.buckets
        if h.bucket >= len(buckets) or h.range_start + h.range_len > buckets[h.bucket].numel:
            raise RefusedChunk(
                "range",
                f"chunk from {origin} addresses bucket {h.bucket} "
                f"[{h.range_start}, {h.range_start + h.range_len}) outside the model",
            )

    def _check_once(self, window: ReplayWindow, origin: str, h: ChunkHeader) -> None:
        try:
            window.check_and_record(h)
        except ReplayedChunkError as exc:
            raise RefusedChunk(
                "duplicate", f"chunk from {origin}: {exc}", origin, PayloadKind.UPDATE
            ) from None


_NO_POSITIONS = torch.zeros(0, dtype=torch.int64)
"""A chunk none of which falls on a sharded rank's pieces: applied (counted), adds
nothing."""


def _span(h: ChunkHeader) -> tuple[int, int]:
    return h.range_start, h.range_len
