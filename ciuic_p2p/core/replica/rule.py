"""One training replica's side of the update rule: pure (no clock, no I/O).

The trainer's model lives in flat fp32 buckets (core.codec.layout); the model's parameters
are views into them, so a chunk is applied where the model reads it, with no copy.
With N the number of training replicas alive and ``w = 1/N``:

    local step:   the optimizer moves the parameters; the replica keeps all of it
    send:         chunks = C(params - base)          # top-k + INT8, error feedback
                  base += what the chunks carry      # base: params without unsent
                                                     # progress (anchor - residual)
    peer chunk:   params += w * c_j                  # on arrival, up to the bound late
    settlement:   params -= (1 - w) * c_i(s)         # once every live replica's
                                                     # stream has reached step s

Each chunk states the N its origin counted when it took the update, and every
replica (the origin at settlement too) weights it by that N, not by its own count:
replicas learn of a joiner or a death at different steps, and with their own counts
they would add different amounts of the same chunk and stay apart for good.

So every value sent ends up with weight ``w`` in every replica: each replica moves by
the mean of all replicas' updates, as synchronous data parallelism with averaged
gradients does, and with density 1 and no delay the two are the same computation.
The replica sends the optimizer's delta, not the gradient, so that any optimizer works
unchanged (momentum and Adam state stay local; what top-k leaves out waits in the
residual: Lin et al. 2018, "Deep Gradient Compression").

Why settle late: a replica must answer its own gradient at once and in full. A rule
that applied the own update at weight ``w`` at once and the peers' when they came
would leave ``1 - w`` of every step's restoring force late; with late settlement the
late part is the difference between the peers' updates and one's own, which
averages out (the measurements behind both: docs/concepts/update-rule.md).

This is delayed averaging of local updates: each replica runs local SGD and the
average reaches it late, as in asynchronous decentralized SGD (AD-PSGD, Lian et al.
2018, which proves convergence under bounded staleness) and in DiLoCo (Douillard et
al. 2023), whose replicas take local steps between averaged outer updates; with a
send interval above one step the local deltas are merged, like DiLoCo's inner steps.

A state handed to a joiner (or written as a checkpoint) is :meth:`Replica.shared_params`:
the parameters without the unsent progress and with the unsettled own chunks at their
weight, with each origin's newest step in it. The joiner then gets every later chunk
as the others do; the live parameters would count the donor's unsent part twice and
its unsettled part ``1 - w`` too much, for good.

Replicas differ by their unsent residuals, the chunks in flight and the unsettled own
chunks, and drift for good when chunks are lost (an origin that died with chunks in
flight, a partition, a refused chunk). The consensus mix bounds that: every
``consensus_interval_steps`` (at the same steps everywhere) a replica sends one of
``consensus_fragments`` fragments of its parameters in turn (dense INT8, 1/F of the
model: a round costs about what an update does, instead of 51 of them) and keeps a
copy; a receiver adds ``consensus_mix / (N - 1)`` of the difference between the
peer's fragment of step s and its own of step s
(CHOCO-SGD, Koloskova et al. 2019, gossips compressed parameters with neighbours the
same way). Comparing with its own *current* parameters instead would pull every
replica back toward a stale point by a different amount.

Every chunk is checked before anything changes: run, layout, bucket and range, exactly
once (per origin, incarnation, step, bucket, range start), and its RMS against the
running RMS of this replica's own chunks of that bucket (or the replicas' lower median
of theirs, when more; core.replica.intake ``rms_reference``); a refusal is counted under
its reason and the step goes on.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ciuic_p2p.config.sections import CodecSection, TrainSection
from ciuic_p2p.core.codec.bucket import BucketEncoder, BucketSpec, ChunkSource, SentChunk
from ciuic_p2p.core.codec.chunk import ChunkHeader, Codec
from ciuic_p2p.core.codec.layout import BucketLayout
from ciuic_p2p.core.codec.pieces import PieceMap
from ciuic_p2p.core.codec.select import RunParts, sequential
from ciuic_p2p.core.replica.final import (
    FINAL_DTYPES,
    FinalRound,
    FinalSummary,
    copy_dtype,
    own_copy,
)
from ciuic_p2p.core.replica.intake import (
    STALENESS_BINS,
    Intake,
    OwnNorms,
    Prepared,
    RefusedChunk,
    ReplicaStats,
)
from ciuic_p2p.core.replica.messages import PayloadKind, envelope
from ciuic_p2p.core.replica.mirror import AddedChunk
from ciuic_p2p.core.replica.outer import OuterStep
from ciuic_p2p.core.replica.parameters import (
    AccessGate,
    AddSink,
    Fragment,
    Parameters,
    Range,
    add_at,
    fragment_range,
)
from ciuic_p2p.core.replica.roster import PeerState, Roster


@dataclass(frozen=True, slots=True)
class TakenUpdate:
    """An update taken at ``step`` (training thread), to be encoded by
    :meth:`Replica.encode_update` (encoder thread): the progress itself stays in the
    model until the encoder reads it."""

    step: int
    replicas: int


FINAL_COVERED_STEPS = 16
"""The steps the run's last update (:meth:`Replica.take_final`) is stamped past the
last send: receivers hold an update to ``influence_clip_ratio`` times one step's norm
per step it covers, and what error feedback held back spans many steps. At most
``max_send_interval_steps`` and a quarter of the staleness bound, and never past the
window of the slowest replica known (receivers take a step at most the bound ahead of
the run's front)."""


__all__ = [
    "STALENESS_BINS",
    "Fragment",
    "PeerState",
    "Prepared",
    "RefusedChunk",
    "Replica",
    "ReplicaStats",
    "TakenUpdate",
    "consensus_distance",
]


class Replica:
    """The update rule for one replica (see the module docstring). Its parts: the
    parameters and their base (core.replica.parameters), who the other replicas are
    (core.replica.roster), and the intake of their payloads (core.replica.intake);
    this class sends, settles and hands out the state, and is what the hook holds."""

    def __init__(
        self,
        layout: BucketLayout,
        buckets: Sequence[torch.Tensor],
        source: ChunkSource,
        peer: str,
        codec: CodecSection,
        train: TrainSection,
        seed: int = 0,
        run_parts: RunParts[Any] = sequential,
        *,
        gate: AccessGate | None = None,
        numpy_scan: bool | None = None,
        sink: AddSink | None = None,
        pieces: PieceMap | None = None,
    ) -> None:
        """``run_parts``: how the encoders' CPU scans run their parts (codec.select);
        ``gate``: keeps the encoder thread's reads and the training thread's adds apart
        (core.replica.parameters; none needed when both run on one thread);
        ``numpy_scan``: see codec.select.ApproxTopK; ``sink``: told of every add to
        the parameters (core.replica.mirror, for a node's other local ranks).
        ``pieces``: the parts of the layout's buckets this replica holds (a rank of a
        node that shards the model: core.codec.pieces), one tensor of ``buckets``
        each; None: the whole buckets. A sharded replica encodes its pieces, applies
        what falls on them, mixes the parts of the consensus fragments on them, and
        ends in the last round; it runs in ``step`` mode (``outer``: not yet)."""
        self.layout = layout
        if pieces is not None and pieces.is_whole:
            pieces = None
        if pieces is not None and train.mode == "outer":
            raise ValueError("a sharded replica runs in train.mode = 'step' (outer: not yet)")
        self.pieces = pieces
        self.parameters = Parameters(buckets, gate, sink, pieces)
        self.buckets = self.parameters.buckets
        self.base = self.parameters.base
        self.source = source
        self.peer = peer
        self.train = train
        self.codec = codec
        device = self.parameters.device
        self.own_params: dict[int, Fragment] = {}
        """This replica's consensus fragments at the steps it sent them (the newest
        two): a peer's parameters of step s are compared with ours of step s."""
        self._debts: collections.deque[
            tuple[int, int, int, int, int, torch.Tensor | None, torch.Tensor, bytearray | None]
        ] = collections.deque()
        """Own sent chunks not yet settled, with the replica count they claimed and,
        for a sink, their bytes (appended by the encoder thread); their weight is read
        when they are settled (:meth:`_own_weight`)."""
        self.roster = Roster(peer, train.staleness_bound_steps)
        self.norms = OwnNorms(len(layout.buckets))
        self.stats = ReplicaStats()
        self.outer = OuterStep(self.buckets, train) if train.mode == "outer" else None
        """Rounds and the outer optimizer (``train.mode = "outer"``; core.replica.outer)."""
        self.intake = Intake(
            layout=layout,
            parameters=self.parameters,
            roster=self.roster,
            norms=self.norms,
            own_params=self.own_params,
            source=source,
            train=train,
            stats=self.stats,
            outer=self.outer,
        )
        held = pieces.pieces if pieces is not None else PieceMap.whole(layout).pieces
        self.encoders = [
            BucketEncoder(
                piece.bucket,
                piece.numel,
                BucketSpec.from_config(codec, piece.numel, layout.buckets[piece.bucket].sparse),
                source,
                device,
                seed=seed + i,
                run_parts=run_parts,
                keep_residual=False,
                numpy_scan=numpy_scan,
                offset=piece.start,
            )
            for i, piece in enumerate(held)
        ]
        self.mean_send_bytes = 0.0
        """Running mean of the bytes one update send publishes (the backlog marks are
        multiples of it)."""
        self.density = codec.density
        self.send_interval = train.inner_steps if self.outer else train.send_interval_steps
        self.step = 0
        self.last_send_step = 0

    # -- the parts, as the hook reads them ----------------------------------------------

    @property
    def peers(self) -> dict[str, PeerState]:
        return self.roster.peers

    @property
    def replicas(self) -> int:
        return self.intake.replicas

    @property
    def joined(self) -> list[str]:
        """Replicas registered since the caller last cleared this (it answers JOIN)."""
        return self.roster.joined

    @property
    def early_joins(self) -> dict[str, tuple[int, bool]]:
        return self.roster.early_joins

    @property
    def weight(self) -> float:
        return self.intake.weight

    def chunk_weight(self, h: ChunkHeader) -> float:
        return self.intake.chunk_weight(h)

    def flush(self, wait: bool = False) -> bool:
        """Add every queued peer chunk (call before the parameters are read); False
        when the encoder is reading the parameters and ``wait`` is False (they go in
        at the next call)."""
        return self.parameters.flush(wait)

    def traffic_bytes(self) -> int:
        """Bucket memory the hook's code paths read and wrote so far, in bytes."""
        return self.parameters.traffic_bytes + sum(e.traffic_bytes for e in self.encoders)

    def held_bytes(self) -> int:
        """Bytes of the tensors the update rule holds beyond the model itself."""
        held = sum(b.numel() * b.element_size() for b in self.base)
        held += sum(e.held_bytes() for e in self.encoders)
        held += self.outer.held_bytes() if self.outer is not None else 0
        # Snapshots (taken in one C call): the encoder thread adds and drops entries
        # while a trainer reads its stats, and iterating the live ones raised "deque
        # mutated during iteration" in the trainer's step.
        held += sum(
            v.numel() * v.element_size() for f in tuple(self.own_params.values()) for v in f.values
        )
        for debt in tuple(self._debts):
            positions, values = debt[5], debt[6]
            held += values.numel() * values.element_size()
            held += 0 if positions is None else positions.numel() * positions.element_size()
        return held

    # -- peers' payloads (core.replica.intake) ---------------------------------------------

    def prepare(self, origin: str, payload: bytes | memoryview) -> Prepared | RefusedChunk:
        """Decode and check what needs no replica state (any thread: the channel's
        reader decodes while the trainer computes)."""
        return self.intake.prepare(origin, payload)

    def apply(self, item: Prepared | RefusedChunk) -> None:
        """Apply a prepared payload (training thread), exactly once; a refusal is
        counted and raised."""
        self.intake.apply(item, self.step)

    def receive(self, origin: str, payload: bytes | memoryview) -> None:
        """Prepare and apply one mesh payload; raises :class:`RefusedChunk` (counted)."""
        self.intake.receive(origin, payload, self.step)

    def register(self, origin: str, payload: bytes | memoryview | None, step: int = 0) -> None:
        """A chunk of ``origin`` arrived and is kept for later: it is a replica."""
        self.intake.register(origin, payload, step)

    def held_by_state(self, origin: str, payload: bytes | memoryview) -> bool:
        """An update the restored state holds, read from its header (counted)."""
        return self.intake.held_by_state(origin, payload)

    # -- local side --------------------------------------------------------------------

    def set_alive(self, members: Iterable[str]) -> None:
        """The mesh members alive now (core.replica.roster says who of them count)."""
        self.roster.set_alive(members, self.step)

    def local_step(self) -> bool:
        """Count one local step; True when an update is due (take and encode it)."""
        self.step += 1
        self.stats.steps += 1
        self.roster.release_cut_off(self.step)
        if self.outer is not None:  # rounds end at the same steps everywhere
            return self.outer.is_due(self.step)
        return self.step - self.last_send_step >= self.send_interval

    def take_update(self) -> TakenUpdate:
        """Take the local progress since the last send (training thread: O(1), the
        encoder reads the progress from the model when it runs :meth:`encode_update`);
        the model keeps all of it until :meth:`settle`."""
        self.last_send_step = self.step
        return TakenUpdate(self.step, self.replicas)

    def daemon_lost(self) -> None:
        """This replica's daemon went away (a restart) while it trains on: the
        replicas it had still count in the N its chunks claim until each is heard
        again, or the grace after the return has passed. Its new daemon's first
        member list holds itself alone, and chunks that claimed N = 1 then were kept
        at weight 1 here and taken at 1/2 by the others (core.replica.roster)."""
        self.roster.lose_touch()

    def daemon_back(self) -> None:
        """Its daemon is back (see :meth:`daemon_lost`)."""
        self.roster.touch_back(self.step)

    def take_final(self) -> TakenUpdate:
        """Take the run's last update (:meth:`finish`'s): everything not sent yet,
        stamped :data:`FINAL_COVERED_STEPS` past the last send (a receiver takes each
        step of an origin once per bucket and range, and holds an update to the steps
        it covers)."""
        t = self.train
        covered = max(1, min(FINAL_COVERED_STEPS, t.max_send_interval_steps,
                             t.staleness_bound_steps // 4))  # fmt: skip
        # Never below this step: steps merged since the last send are in it.
        step = max(self.step, self.last_send_step + covered)
        # Nor past the window of the slowest replica known, an excused one included: a
        # replica the staleness bound ahead of the others stamped its last update past
        # what they take (refused as pace now and then in tests/train/test_training.py:
        # step 166 past a window up to 162). A fresh step all the same: the last send's
        # chunks have its step.
        slowest = min((p.step for p in self.peers.values()), default=None)
        if slowest is not None:
            ceiling = slowest + t.staleness_bound_steps
            step = max(self.step, self.last_send_step + 1, min(step, ceiling))
        self.last_send_step = step
        return TakenUpdate(step, self.replicas)

    def settle(self, everything: bool = False) -> int:
        """Take back ``1 - w`` of each own sent chunk once every live replica's stream
        has reached its step (then their chunks of that step have been added here), or
        all of them with ``everything``; how many were settled."""
        if everything:
            floor = max(self.step, self.last_send_step)
        else:
            floor = min(
                (
                    (p.step if p.done_at is None else max(p.step, p.done_at))
                    for name, p in self.peers.items()
                    if not p.lagging and not self.intake.influence.set_aside(name, self.step)
                ),
                default=self.step,
            )
        n = 0
        debts = self._debts
        outer = self.outer
        while debts and debts[0][0] <= floor:
            step, claimed, bucket, start, length, positions, values, payload = debts.popleft()
            w = self._own_weight(step, claimed)
            if outer is not None:
                # The rounds before this one are complete too (the floor is past
                # them): complete them first, so the chunk is settled on time.
                for kick in outer.complete_through(floor, before_round=outer.round_of(step)):
                    self.parameters.add_slice(kick.bucket, kick.start, kick.values)
                weight = w * outer.coefficient(step)
                outer.record(bucket, start, positions, values, w, step)
            else:
                weight = w
            if weight != 1.0:
                self.parameters.add(
                    Range(bucket, start, length), positions, values, weight - 1.0,
                    None if payload is None else AddedChunk(payload),
                )  # fmt: skip
            n += 1
        if outer is not None:
            for kick in outer.complete_through(floor):
                self.parameters.add_slice(kick.bucket, kick.start, kick.values)
        self.flush(wait=everything)
        return n

    def encode_update(
        self,
        taken: TakenUpdate,
        step: int | None = None,
        replicas: int | None = None,
        *,
        dense: bool = False,
    ) -> list[bytes]:
        """Encode a taken update into mesh payloads (encoder thread: it reads the
        model through the gate and writes only the base, the encoders and the own
        records). Each chunk states the replica count read when the update was taken
        (or ``replicas``): every replica, this one at settlement included, weights it
        ``1/replicas``, so a membership change seen at different moments by different
        replicas does not leave them apart. ``dense``: every element, INT8, so that
        error feedback keeps only the rounding (the last update of a run)."""
        payloads: list[bytes] = []
        step = taken.step if step is None else step
        n = max(1, taken.replicas if replicas is None else replicas)
        residual_sq = 0.0
        with self.parameters.reading():
            for enc, bucket, base in zip(self.encoders, self.buckets, self.base, strict=True):
                enc.replicas = n
                if enc.spec.codec.is_sparse and enc.spec.density != self.density:
                    enc.spec = _with_density(enc.spec, self.density)
                spec = enc.spec
                if dense and spec.codec.is_sparse:
                    enc.spec = _dense_int8(spec)
                try:
                    chunks = enc.encode_progress(bucket, base, step)
                finally:
                    enc.spec = spec
                payloads += [envelope(PayloadKind.UPDATE) + chunk for chunk in chunks]
                for sent in enc.last_sent:
                    self._record_own(sent)
                residual_sq += enc.residual_norm**2
        norm = math.sqrt(residual_sq)
        self.stats.residual_norm = norm
        self.stats.residual_norm_max = max(self.stats.residual_norm_max, norm)
        self.stats.sends += 1
        self.stats.chunks_sent += len(payloads)
        sent_bytes = sum(len(p) for p in payloads)
        self.stats.bytes_published += sent_bytes
        m = self.mean_send_bytes
        self.mean_send_bytes = sent_bytes if m == 0.0 else 0.9 * m + 0.1 * sent_bytes
        return payloads

    def start_final(self, members: Iterable[str], publish: Callable[[bytes], None]) -> int:
        """Start the run's last round (core.replica.final; ``train.finish_average``
        names the copies' dtype): this replica's parameters become its copy as sent,
        handed to ``publish`` as ``FINAL`` payloads a bucket at a time (never the whole
        copy's chunks at once), and ``members``' copies are averaged in as they
        arrive; the bytes published. Training thread, with the encoder idle."""
        names = sorted(set(members) - {self.peer})
        wanted = FINAL_DTYPES[self.train.finish_average]
        count = len(names) + 1
        step = self.step
        own: list[torch.Tensor] = []
        sent = 0
        self.flush(wait=True)
        for enc, bucket in zip(self.encoders, self.buckets, strict=True):
            copy = own_copy(bucket, copy_dtype(bucket, wanted))
            own.append(copy)
            enc.replicas = count  # the chunks say how many copies their origin averages
            for chunk in enc.encode_copy(copy, step):
                payload = envelope(PayloadKind.FINAL) + chunk
                sent += len(payload)
                publish(payload)
            with torch.no_grad():
                self.parameters.add_piece(len(own) - 1, 0, copy.float() - bucket)
            self.fold_final()  # one bucket's difference at a time
        final = FinalRound(
            own,
            names,
            self.train.finish_average_distance_max_ratio,
            buckets=[enc.bucket for enc in self.encoders],
        )
        self.intake.start_final(final, self.step)
        self.fold_final()
        self.stats.bytes_published += sent
        return sent

    @property
    def final_complete(self) -> bool:
        """Every member's whole copy is in (after :meth:`start_final`)."""
        final = self.intake.final
        return final is not None and final.complete

    def fold_final(self) -> None:
        """Add what the last round took to the model and the base now (each peer's
        copy's difference would otherwise wait for an encoder read that never comes,
        at 4 bytes per parameter per peer). With the encoder idle."""
        self.parameters.flush(wait=True)
        with self.parameters.reading():
            pass

    def end_final(self) -> FinalSummary | None:
        """End the last round (later copies are refused as late); its summary, None
        when none was started."""
        self.fold_final()
        final = self.intake.final
        if final is not None and not final.complete:
            # What was added is (sum of the copies taken - own) / members: scaled to
            # the copies each element got, it is their mean.
            for b, counts in final.coverage():
                with torch.no_grad():
                    moved = self.buckets[b].float() - final.own[b].float()  # a new tensor
                    moved.mul_(final.count / counts - 1.0)
                self.parameters.add_piece(b, 0, moved)
                self.fold_final()
        return self.intake.end_final()

    def snapshot_params(self) -> Fragment:
        """This step's consensus fragment of the parameters (training thread; 1/F of
        the model), kept to compare with the peers' of the same step."""
        self.flush()
        fragments = max(1, self.train.consensus_fragments)
        interval = max(1, self._consensus_interval())
        index = (self.step // interval) % fragments
        starts = []
        values = []
        with torch.no_grad():
            for enc, bucket in zip(self.encoders, self.buckets, strict=True):
                # The fragment's range of the layout's bucket, where it falls on this
                # piece (a whole bucket's: all of it), in the piece's coordinates.
                first, length = fragment_range(
                    self.layout.buckets[enc.bucket].numel, index, fragments
                )
                lo = min(max(first, enc.offset), enc.offset + enc.numel)
                hi = max(lo, min(first + length, enc.offset + enc.numel))
                starts.append(lo - enc.offset)
                values.append(bucket[lo - enc.offset : hi - enc.offset].clone())
        fragment = Fragment(index, self.step, tuple(starts), tuple(values))
        if self.parameters.sink is not None:
            self.parameters.sink.snapshot(index, self.step, fragments)
        while len(self.own_params) >= 2:
            self.own_params.pop(min(self.own_params))
        self.own_params[self.step] = fragment
        self.parameters.traffic_bytes += 8 * sum(v.numel() for v in values)
        return fragment

    def encode_params(self, fragment: Fragment, step: int | None = None) -> list[bytes]:
        """A consensus fragment as dense INT8 chunks (any thread)."""
        step = fragment.step if step is None else step
        payloads: list[bytes] = []
        with torch.no_grad():
            for enc, start, values in zip(
                self.encoders, fragment.starts, fragment.values, strict=True
            ):
                if values.numel():
                    payloads += [
                        envelope(PayloadKind.PARAMS) + c
                        for c in enc.encode_snapshot(values, start, step)
                    ]
        return payloads

    def _consensus_interval(self) -> int:
        """Steps between consensus fragments: in outer mode a whole number of rounds
        (at least one), so that a fragment goes with a round, at the same steps
        everywhere."""
        n = self.train.consensus_interval_steps
        if self.outer is None or n <= 0:
            return n
        h = self.outer.inner_steps
        return h * max(1, -(-n // h))

    def wants_params(self) -> bool:
        n = self._consensus_interval()
        return n > 0 and self.replicas > 1 and self.step % n == 0

    def backlog_marks(self) -> tuple[float, float]:
        """The high and low backlog marks in bytes: multiples of one send (what a
        backlog means depends on the model's size), at least the fixed marks."""
        t = self.train
        send = self.mean_send_bytes
        return (
            max(float(t.backlog_high_bytes), t.backlog_high_sends * send),
            max(float(t.backlog_low_bytes), t.backlog_low_sends * send),
        )

    def adapt(self, backlog_bytes: int) -> None:
        """Follow the daemon's unsent backlog: merge steps and lower the density while
        it is above the high mark, recover one notch at a time below the low mark."""
        t = self.train
        high, low = self.backlog_marks()
        if backlog_bytes > high:
            self.stats.backoffs += 1
            if self.outer is None:  # rounds keep their length: only the density gives
                self.send_interval = min(t.max_send_interval_steps, self.send_interval * 2)
            self.density = max(t.min_density, self.density / 2)
        elif backlog_bytes < low:
            if self.outer is None:
                self.send_interval = max(t.send_interval_steps, self.send_interval // 2)
            self.density = min(self.codec.density, self.density * 2)

    def blocking(self) -> list[str]:
        """Live replicas more than the staleness bound behind this one's next step."""
        floor = self.step + 1 - self.train.staleness_bound_steps
        twice = self.train.excused_twice_not_waited
        influence = self.intake.influence
        return [
            name
            for name, p in self.peers.items()
            if p.done_at is None
            and p.step < floor
            and not p.lagging
            and not (twice and p.excusals >= 2)
            and not influence.set_aside(name, self.step)
        ]

    def excuse(self, names: Iterable[str]) -> None:
        """Stop waiting for these replicas (past the bound longer than the grace: dead
        or very slow) until their chunks are back within the bound."""
        for name in names:
            p = self.peers.get(name)
            if p is not None and not p.lagging:
                p.lagging = True
                p.excusals += 1
                self.stats.excused += 1

    def applied_steps(self) -> dict[str, int]:
        """For each origin, the newest of its update steps in :meth:`shared_params`
        (this replica's own: the last it sent): travels with a state snapshot. Only
        chunks applied count, and the floors of the state this one started from."""
        held = dict(self.intake.floors)
        for k, p in self.peers.items():
            held[k] = max(held.get(k, 0), p.applied_step)
        return {**held, self.peer: self.last_send_step}

    def shared_params(self) -> list[torch.Tensor]:
        """The parameters as every replica will hold them once what this one has
        applied is settled, without what it has not sent yet: each own sent chunk at
        its weight instead of in full (unsettled), and no unsent progress (the base).
        A joiner or a restart starts from these and gets this replica's later chunks
        as every other replica does; the live parameters would count the unsent part
        twice and the unsettled part ``1 - w`` too much, for good. Call with the
        encoder idle; the tensors are fresh copies."""
        self.parameters.flush(wait=True)
        self.parameters.settle_base()
        outer = self.outer
        with torch.no_grad():
            out = [b.clone() for b in self.base]
            if outer is not None:  # the kick every replica adds at the next completion
                for b, kick in zip(out, outer.held, strict=False):
                    b.add_(kick)
            for step, claimed, bucket, start, length, positions, values, _ in self._debts:
                weight = w = self._own_weight(step, claimed)
                if outer is not None:
                    weight = w * (outer.coefficient(step) + outer.early_correction(step)[0])
                if weight != 1.0:
                    piece, at = self._own_piece(bucket, start, length)
                    _add_into(out[piece], at, positions, values, weight - 1.0)
            if outer is not None:  # peers' rounds ahead, their momentum part waiting
                for d in outer.deferred:
                    extra = d.w * outer.early_correction(d.round * outer.inner_steps)[0]
                    _add_into(out[d.bucket], d.start, d.positions, d.values, extra)
        return out

    def shared_momentum(self) -> list[torch.Tensor]:
        """The outer momentum as every replica will hold it once the unsettled own
        chunks are settled (empty without momentum): it travels beside
        :meth:`shared_params`. Call with the encoder idle; fresh copies."""
        outer = self.outer
        if outer is None or not outer.buffers:
            return []
        with torch.no_grad():
            out = [m.clone() for m in outer.buffers]
            for step, claimed, bucket, start, _length, positions, values, _ in self._debts:
                factor = self._own_weight(step, claimed) * outer.early_correction(step)[1]
                _add_into(out[bucket], start, positions, values, factor)
            for d in outer.deferred:
                factor = d.w * outer.early_correction(d.round * outer.inner_steps)[1]
                _add_into(out[d.bucket], d.start, d.positions, d.values, factor)
        return out

    def start_at(
        self,
        step: int,
        applied: dict[str, int] | None = None,
        next_round: int | None = None,
        finals: dict[str, tuple[int, int]] | None = None,
        reached: dict[str, tuple[int, int]] | None = None,
    ) -> None:
        """Begin at ``step`` from the parameters now in the buckets (after a state
        sync or a checkpoint): the next update is measured from here. ``applied``
        (the state's :meth:`applied_steps`): each origin's chunks up to that step are
        in the state already and are dropped when they arrive. ``next_round`` (the
        state's :meth:`next_round`, outer mode): where its rounds stood. ``finals``
        (the state's :meth:`final_stamps`): the run's last updates it holds.
        ``reached`` (the state's :meth:`reached_counts`): how many chunks of each origin
        it holds."""
        self.parameters.flush(wait=True)
        self.parameters.discard_queued()
        self.intake.set_floors(applied or {}, reached)
        self.intake.set_finals(finals or {})
        self.step = self.last_send_step = step
        self.parameters.rebase()
        if self.outer is not None:
            self.outer.start_at(step, next_round)

    def final_stamps(self) -> dict[str, list[int]]:
        """For each origin whose run's last update is in :meth:`shared_params`, stamped
        past its last step (:meth:`take_final`): [its last step, the stamp]. A run
        resumed from this state numbers its updates from the last step on, and its
        peers must take them: the floors alone (the stamps) dropped 16 steps of every
        peer's updates."""
        finals = {
            name: [p.done_at, p.applied_step]
            for name, p in self.peers.items()
            if p.done_at is not None and p.applied_step > p.done_at
        }
        if self.last_send_step > self.step:
            finals[self.peer] = [self.step, self.last_send_step]
        return finals

    def reached_counts(self) -> dict[str, list[int]]:
        """For each origin, how many of its chunks :meth:`shared_params` holds (those
        applied or held by the state this replica started from: each origin's are
        delivered in its order, so they are its first ones), and how many of those are
        of its newest step there (the rest of that step may come later); this replica's
        own: all it sent. Travels with a state snapshot: a replica restored from it
        counts them towards the origin's DONE."""
        floors = self.applied_steps()
        counts = {
            k: [p.applied + p.held_by_state, p.at_step_count if p.at_step == floors[k] else 0]
            for k, p in self.peers.items()
        }
        return {**counts, self.peer: [self.stats.chunks_sent, 0]}

    def state_meta(self) -> dict[str, Any]:
        """What travels with a state snapshot beside the tensors (statefile's meta):
        :meth:`applied_steps`, and in outer mode :meth:`next_round`."""
        meta: dict[str, Any] = {
            "applied": self.applied_steps(),
            "finals": self.final_stamps(),
            "reached": self.reached_counts(),
        }
        if self.outer is not None:
            meta["next_round"] = self.outer.next_round
        return meta

    def _own_weight(self, step: int, claimed: int) -> float:
        """The weight an own chunk of ``step`` that claimed ``claimed`` replicas is
        settled at: the one every receiver gives it (:meth:`chunk_weight`), read when
        it is settled, once the others' chunks of its steps have reached this replica
        as they reached them. Read when it was sent, it missed the replicas whose
        chunks were late here: a replica back from its daemon's restart took its own
        updates of the gap at 1 (it had heard no one within the bound) where the
        others took them at 1/2, and stayed apart from them for good."""
        return self.intake.weight_of(step, claimed)

    def _own_piece(self, bucket: int, start: int, length: int) -> tuple[int, int]:
        """The piece an own chunk of ``bucket``'s ``[start, start + length)`` came
        from (each encoder's chunks lie in its piece), and where in it."""
        if self.pieces is None:
            return bucket, start
        part = self.pieces.split(bucket, start, length)[0]
        return part.piece, part.piece_offset

    def _record_own(self, sent: SentChunk) -> None:
        h = sent.header
        self.intake.influence.record_own(
            h.bucket, h.step, sent.positions, h.range_start, sent.values
        )
        self._debts.append(
            (
                h.step,
                h.replicas,
                h.bucket,
                h.range_start,
                h.range_len,
                sent.positions,
                sent.values,
                # Only a node's other local ranks need the bytes (core.replica.mirror).
                sent.payload if self.parameters.sink is not None else None,
            )
        )
        rms = float(torch.linalg.vector_norm(sent.values)) / math.sqrt(max(1, h.count))
        self.norms.record(h.bucket, rms)


def _add_into(
    target: torch.Tensor,
    start: int,
    positions: torch.Tensor | None,
    values: torch.Tensor,
    alpha: float,
) -> None:
    """``target[start + positions] += alpha * values`` (dense: a slice from ``start``)."""
    if alpha == 0.0:
        return
    if positions is None:
        target[start : start + values.numel()].add_(values, alpha=alpha)
    else:
        add_at(target, positions + start, values, alpha)


def _with_density(spec: BucketSpec, density: float) -> BucketSpec:
    return BucketSpec(
        codec=spec.codec,
        density=density,
        block_size=spec.block_size,
        exact=spec.exact,
        sample_size=spec.sample_size,
        chunk_payload_bytes=spec.chunk_payload_bytes,
        residual_max_ratio=spec.residual_max_ratio,
    )


def _dense_int8(spec: BucketSpec) -> BucketSpec:
    return BucketSpec(
        codec=Codec.DENSE_INT8,
        density=1.0,
        block_size=spec.block_size,
        exact=True,
        sample_size=spec.sample_size,
        chunk_payload_bytes=spec.chunk_payload_bytes,
    )


def consensus_distance(replicas: Sequence[Sequence[torch.Tensor]]) -> float:
    """RMS of each replica minus the mean, relative to the mean's RMS (0: identical)."""
    flat = [torch.cat([b.detach().float().flatten().cpu() for b in r]) for r in replicas]
    stack = torch.stack(flat)
    mean = stack.mean(0)
    spread = float((stack - mean).pow(2).mean().sqrt())
    scale = float(mean.pow(2).mean().sqrt())
    return spread / scale if scale > 0 else 0.0
