"""One training replica's side of the update rule: pure (no clock, no I/O).

The trainer's model lives in flat fp32 buckets (core.codec.layout); the model's parameters
are views into them, so a chunk is applied where the model reads it, with no copy.
With N the number of training replicas alive and ``w = 1/N``:

    local step:   the optimizer moves the parameters; the replica keeps all of it
    send:         delta = params - anchor; anchor = params
                  chunks = C(residual + delta)       # top-k + INT8, error feedback
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
averages out (the measurements behind both: docs/update-rule.md).

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
``consensus_interval_steps`` (at the same steps everywhere) a replica sends its
parameters (dense INT8) and keeps a copy; a receiver adds ``consensus_mix / (N - 1)``
of the difference between the peer's parameters of step s and its own of step s
(CHOCO-SGD, Koloskova et al. 2019, gossips compressed parameters with neighbours the
same way). Comparing with its own *current* parameters instead would pull every
replica back toward a stale point by a different amount.

Every chunk is checked before anything changes: run, layout, bucket and range, exactly
once (per origin, incarnation, step, bucket, range start), and its RMS against the
running RMS of this replica's own chunks of that bucket; a refusal is counted under
its reason and the step goes on.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from ciuic_p2p.config.sections import CodecSection, TrainSection
from ciuic_p2p.core.codec.bucket import BucketEncoder, BucketSpec, ChunkSource, decode_chunk
from ciuic_p2p.core.codec.chunk import ChunkHeader, Codec
from ciuic_p2p.core.codec.layout import BucketLayout
from ciuic_p2p.core.codec.select import RunParts, sequential
from ciuic_p2p.core.replica.intake import (
    STALENESS_BINS,
    Intake,
    OwnNorms,
    Prepared,
    RefusedChunk,
    ReplicaStats,
)
from ciuic_p2p.core.replica.messages import PayloadKind, envelope
from ciuic_p2p.core.replica.parameters import Parameters, Range
from ciuic_p2p.core.replica.roster import PeerState, Roster

__all__ = [
    "STALENESS_BINS",
    "PeerState",
    "Prepared",
    "RefusedChunk",
    "Replica",
    "ReplicaStats",
    "consensus_distance",
]


class Replica:
    """The update rule for one replica (see the module docstring). Its parts: the
    parameters and anchor (core.replica.parameters), who the other replicas are
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
    ) -> None:
        """``run_parts``: how the encoders' CPU scans run their parts (codec.select)."""
        self.layout = layout
        self.parameters = Parameters(buckets)
        self.buckets = self.parameters.buckets
        self.anchor = self.parameters.anchor
        self.source = source
        self.peer = peer
        self.train = train
        self.codec = codec
        device = self.parameters.device
        self._spare = [torch.zeros_like(b) for b in self.buckets]
        self._spare_other = [torch.zeros_like(b) for b in self.buckets]
        self._params_ring = [[torch.zeros_like(b) for b in self.buckets] for _ in range(2)]
        self.own_params: dict[int, list[torch.Tensor]] = {}
        """This replica's parameters at the steps it sent them (the newest two): a
        peer's parameters of step s are compared with ours of step s."""
        self._debts: collections.deque[
            tuple[int, float, int, int, int, torch.Tensor | None, torch.Tensor]
        ] = collections.deque()
        """Own sent chunks not yet settled, with the weight they went out with
        (appended by the encoder thread)."""
        self.roster = Roster(peer, train.staleness_bound_steps)
        self.norms = OwnNorms(len(layout.buckets))
        self.stats = ReplicaStats()
        self.intake = Intake(
            layout=layout,
            parameters=self.parameters,
            roster=self.roster,
            norms=self.norms,
            own_params=self.own_params,
            source=source,
            train=train,
            stats=self.stats,
        )
        self.encoders = [
            BucketEncoder(
                info.index,
                info.numel,
                BucketSpec.from_config(codec, info.numel, info.sparse),
                source,
                device,
                seed=seed + info.index,
                run_parts=run_parts,
            )
            for info in layout.buckets
        ]
        self.param_encoders = [
            BucketEncoder(
                info.index,
                info.numel,
                BucketSpec(
                    codec=Codec.DENSE_INT8,
                    block_size=codec.block_size,
                    chunk_payload_bytes=codec.chunk_payload_bytes,
                ),
                source,
                device,
            )
            for info in layout.buckets
        ]
        self.density = codec.density
        self.send_interval = train.send_interval_steps
        self.step = 0
        self.last_send_step = 0

    # -- the parts, as the hook reads them ----------------------------------------------

    @property
    def peers(self) -> dict[str, PeerState]:
        return self.roster.peers

    @property
    def replicas(self) -> int:
        return self.roster.replicas

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

    def flush(self) -> None:
        """Add every queued peer chunk (call before the parameters are read)."""
        self.parameters.flush()

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
        return self.step - self.last_send_step >= self.send_interval

    def take_update(self) -> list[torch.Tensor]:
        """Take the local progress since the last send (training thread) for
        :meth:`encode_update`; the model keeps all of it until :meth:`settle`. The
        buffers alternate between two sets, so the encoder may still read the previous
        set while this one fills."""
        self.flush()
        self.last_send_step = self.step
        self._spare, deltas = self._spare_other, self._spare
        self._spare_other = deltas
        with torch.no_grad():
            for bucket, anchor, delta in zip(self.buckets, self.anchor, deltas, strict=True):
                torch.sub(bucket, anchor, out=delta)
                anchor.copy_(bucket)
        return deltas

    def settle(self, everything: bool = False) -> int:
        """Take back ``1 - w`` of each own sent chunk once every live replica's stream
        has reached its step (then their chunks of that step have been added here), or
        all of them with ``everything``; how many were settled."""
        if everything:
            floor = self.step
        else:
            floor = min(
                (
                    (p.step if p.done_at is None else max(p.step, p.done_at))
                    for p in self.peers.values()
                    if not p.lagging
                ),
                default=self.step,
            )
        n = 0
        debts = self._debts
        while debts and debts[0][0] <= floor:
            _, w, bucket, start, length, positions, values = debts.popleft()
            if w < 1.0:
                self.parameters.add(Range(bucket, start, length), positions, values, w - 1.0)
            n += 1
        self.flush()
        return n

    def encode_update(
        self, deltas: Sequence[torch.Tensor], step: int, replicas: int | None = None
    ) -> list[bytes]:
        """Encode a taken update into mesh payloads (may run on another thread: it
        touches only the encoders, the residuals and the own-RMS reference). Each
        chunk states ``replicas`` (by default the count now; pass the count read when
        the update was taken): every replica, this one at settlement included, weights
        it ``1/replicas``, so a membership change seen at different moments by
        different replicas does not leave them apart."""
        payloads: list[bytes] = []
        n = max(1, self.replicas if replicas is None else replicas)
        with torch.no_grad():
            for enc, delta in zip(self.encoders, deltas, strict=True):
                enc.replicas = n
                if enc.spec.codec.is_sparse and enc.spec.density != self.density:
                    enc.spec = _with_density(enc.spec, self.density)
                for chunk in enc.encode(delta, step):
                    self._record_own(chunk)
                    payloads.append(envelope(PayloadKind.UPDATE) + chunk)
                if enc.residual is not None:
                    norm = float(torch.linalg.vector_norm(enc.residual))
                    self.stats.residual_norm = norm
                    self.stats.residual_norm_max = max(self.stats.residual_norm_max, norm)
        self.stats.sends += 1
        self.stats.chunks_sent += len(payloads)
        self.stats.bytes_published += sum(len(p) for p in payloads)
        return payloads

    def snapshot_params(self) -> list[torch.Tensor]:
        """A copy of the parameters at this step (training thread) for
        :meth:`encode_params`, kept to compare with the peers' of the same step."""
        self.flush()
        buf = self._params_ring[len(self.own_params) % 2]
        if len(self.own_params) >= 2:
            buf = self.own_params.pop(min(self.own_params))
        with torch.no_grad():
            for spare, bucket in zip(buf, self.buckets, strict=True):
                spare.copy_(bucket)
        self.own_params[self.step] = buf
        return buf

    def encode_params(self, params: Sequence[torch.Tensor], step: int) -> list[bytes]:
        """Parameters as dense INT8 chunks, for the consensus mix (any thread)."""
        payloads: list[bytes] = []
        with torch.no_grad():
            for enc, bucket in zip(self.param_encoders, params, strict=True):
                if enc.residual is not None:
                    enc.residual.zero_()  # a snapshot, not a stream: no error feedback
                payloads += [envelope(PayloadKind.PARAMS) + c for c in enc.encode(bucket, step)]
        return payloads

    def wants_params(self) -> bool:
        n = self.train.consensus_interval_steps
        return n > 0 and self.replicas > 1 and self.step % n == 0

    def adapt(self, backlog_bytes: int) -> None:
        """Follow the daemon's unsent backlog: merge steps and lower the density while
        it is above the high mark, recover one notch at a time below the low mark."""
        t = self.train
        if backlog_bytes > t.backlog_high_bytes:
            self.send_interval = min(t.max_send_interval_steps, self.send_interval * 2)
            self.density = max(t.min_density, self.density / 2)
        elif backlog_bytes < t.backlog_low_bytes:
            self.send_interval = max(t.send_interval_steps, self.send_interval // 2)
            self.density = min(self.codec.density, self.density * 2)

    def blocking(self) -> list[str]:
        """Live replicas more than the staleness bound behind this one's next step."""
        floor = self.step + 1 - self.train.staleness_bound_steps
        return [
            name
            for name, p in self.peers.items()
            if p.done_at is None and p.step < floor and not p.lagging
        ]

    def excuse(self, names: Iterable[str]) -> None:
        """Stop waiting for these replicas (past the bound longer than the grace: dead
        or very slow) until their chunks are back within the bound."""
        for name in names:
            p = self.peers.get(name)
            if p is not None and not p.lagging:
                p.lagging = True
                self.stats.excused += 1

    def applied_steps(self) -> dict[str, int]:
        """For each origin, the newest of its update steps in :meth:`shared_params`
        (this replica's own: the last it sent): travels with a state snapshot."""
        return {self.peer: self.last_send_step, **{k: p.step for k, p in self.peers.items()}}

    def shared_params(self) -> list[torch.Tensor]:
        """The parameters as every replica will hold them once what this one has
        applied is settled, without what it has not sent yet: each own sent chunk at
        its weight instead of in full (unsettled), and no unsent progress (the delta
        since the last send and the residuals). A joiner or a restart starts from
        these and gets this replica's later chunks as every other replica does; the
        live parameters would count the unsent part twice and the unsettled part
        ``1 - w`` too much, for good. Call with the encoder idle; the tensors are
        scratch buffers, valid until the next :meth:`take_update`."""
        self.flush()
        out = self._spare_other
        with torch.no_grad():
            for o, anchor, enc in zip(out, self.anchor, self.encoders, strict=True):
                o.copy_(anchor)
                if enc.residual is not None:
                    o.sub_(enc.residual)
            for _, w, bucket, start, length, positions, values in self._debts:
                if w >= 1.0:
                    continue
                if positions is None:
                    out[bucket][start : start + length].add_(values, alpha=w - 1.0)
                else:
                    out[bucket].index_add_(0, positions + start, values, alpha=w - 1.0)
        return out

    def start_at(self, step: int, applied: dict[str, int] | None = None) -> None:
        """Begin at ``step`` from the parameters now in the buckets (after a state
        sync or a checkpoint): the next update is measured from here. ``applied``
        (the state's :meth:`applied_steps`): each origin's chunks up to that step are
        in the state already and are dropped when they arrive."""
        self.parameters.flush()
        self.parameters.discard_queued()
        self.intake.set_floors(applied or {})
        self.step = self.last_send_step = step
        self.parameters.reanchor()

    def _record_own(self, chunk: bytes | bytearray) -> None:
        decoded = decode_chunk(chunk, self.buckets[0].device)
        h = decoded.header
        w = self.chunk_weight(h)
        self._debts.append(
            (h.step, w, h.bucket, h.range_start, h.range_len, decoded.positions, decoded.values)
        )
        rms = float(torch.linalg.vector_norm(decoded.values)) / math.sqrt(max(1, h.count))
        self.norms.record(h.bucket, rms)


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


def consensus_distance(replicas: Sequence[Sequence[torch.Tensor]]) -> float:
    """RMS of each replica minus the mean, relative to the mean's RMS (0: identical)."""
    flat = [torch.cat([b.detach().float().flatten().cpu() for b in r]) for r in replicas]
    stack = torch.stack(flat)
    mean = stack.mean(0)
    spread = float((stack - mean).pow(2).mean().sqrt())
    scale = float(mean.pow(2).mean().sqrt())
    return spread / scale if scale > 0 else 0.0
