"""How far one origin may move this replica: what a peer's update chunk may claim and
weigh, judged by what this replica knows rather than by what the chunk says of itself.

A member with a valid certificate can publish any well-formed chunk. Without these
bounds one member destroyed every honest model within seconds by republishing the
others' chunks sign-flipped, each claiming ``replicas = 1`` (weight 1 instead of 1/N)
and a fresh step number (the replay window takes every new number). The bounds:

- **Weight.** A chunk's claimed replica count is raised to one below the replicas
  whose updates of the steps up to it (within ``staleness_bound_steps``) this replica
  has taken, its own included: a claim of a smaller run buys no larger share than
  1/(N-1). One below, because an honest origin counts a joiner (or a death) later
  than the others see its updates, and a receiver that weighted its chunks
  otherwise than the origin does would stay apart from it for good.
- **Pace.** An origin's update steps are its own clock, so they are held to the run's:
  a new step must lie within the staleness bound ahead of the run (the lower median of
  the newest steps of this replica and the origins it has taken updates from, so one
  origin cannot carry the window), and each step is taken once. An origin therefore
  gets at most one update per step of the run's progress (a final send may follow the
  last by one step, so no wider gap is asked), each held to its norm per step covered
  below; steps behind its newest are taken too (repair brings honest chunks late),
  each clipped as one step's update.
- **Norm.** Each update (one origin, one step, one bucket) is clipped to
  ``influence_clip_ratio`` (``influence_clip_ratio_rounds`` for outer rounds) times
  the lower median, over the origins and this replica,
  of their running update norms in that bucket (CenteredClip's idea with a robust
  centre; the running norms are of what was taken, after clipping, so an origin cannot
  raise its own reference). This replica's own updates count among them, so with one
  honest peer and one liar the liar is held to this replica's own scale. All of an
  origin's updates together are held to the same ratio per step the run's front
  advances (a budget per origin and bucket, saved up to one longest merge, more for
  an update behind the front): fresh step numbers buy a member nothing.
- **Direction.** A bounded norm still lets a member spend its share against the run: a
  sign-flipped copy of an honest update cancels it. Each update is compared with this
  replica's own recent updates (the sum of its last sends, in a count sketch of
  ``SKETCH_SIZE`` cells: a cosine estimate at O(k) per chunk with no dense buffer, on
  the cells the chunk touches), and an origin whose running agreement turns negative
  loses weight, down to none at ``-influence_disagreement``. Honest replicas' updates
  agree on average (one loss, data of one distribution: +0.2 between digits
  replicas); a flipped copy disagrees as much as the original agreed (-0.35). Near a
  minimum honest updates are mostly noise and their cosines swing +-0.4 around 0
  (an honest regression replica's running agreement drifted to -0.18), so the weight
  is taken from the agreement's upper confidence bound (its running mean plus
  ``AGREEMENT_Z`` standard errors): only an origin that disagrees beyond its own
  noise loses weight; flipping noise moves nothing the norm bound does not hold. An
  origin whose updates weigh nothing is not counted among the replicas N every chunk
  is weighted by (:meth:`InfluenceBound.counted`): else it would still dilute every
  honest update by N/(N+1).
- **Set aside.** An origin refused ``set_aside_refusals`` times within a window of
  ``staleness_bound_steps`` steps is set aside for ``set_aside_steps`` steps: its
  payloads are refused unread, and the caller says so (with how to revoke it).

Pure: no clock (steps are this replica's), no I/O. The own updates are recorded from the
encoder thread and read on the training thread: each field is replaced whole, and a
read of a sketch being added to is an estimate either way.
"""

from __future__ import annotations

import bisect
import collections
import math
from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass, field

import torch

from ciuic_p2p.config.sections import TrainSection

SKETCH_SIZE = 1 << 14
"""Cells of the direction sketch per bucket: a cosine's estimate has a standard error
of about 1/sqrt(SKETCH_SIZE) (0.008) on top of the true value."""
_HASH_MULT = 0x9E3779B1
"""Knuth's multiplicative hash: a position's cell and sign come from its product."""
NORM_EMA = 0.1
AGREEMENT_EMA = 0.1
AGREEMENT_MIN_UPDATES = 4
"""Updates of an origin seen before its agreement changes its weight."""
AGREEMENT_Z = 2.0
"""Standard errors of its running cosine an origin's agreement is given before its
weight falls: consecutive cosines are correlated (momentum), so a running mean of
noise strays further than independent samples would; 2 kept honest regression
replicas at weight 1 where 0 cut them to none half the time."""
_EMA_SE = math.sqrt(AGREEMENT_EMA / (2.0 - AGREEMENT_EMA))
"""A running mean's standard error per unit of its samples' deviation."""


class UpdateNorm:
    """The running squared norm of one update in one bucket, per step it covers: an
    update spans several chunks, so each update's total is folded into the mean when
    the next one starts; an update that merged k steps (a back-off, a round) counts
    its norm over k, as correlated steps add up."""

    __slots__ = ("covered", "mean_sq", "step", "total_sq")

    def __init__(self) -> None:
        self.mean_sq: float | None = None
        self.step = -1
        self.total_sq = 0.0
        self.covered = 1

    def add(self, step: int, sq: float, covered: int) -> None:
        if step != self.step:
            if self.step >= 0:
                per_step = self.total_sq / self.covered**2
                m = self.mean_sq
                self.mean_sq = per_step if m is None else (1 - NORM_EMA) * m + NORM_EMA * per_step
            self.step, self.total_sq, self.covered = step, 0.0, max(1, covered)
        self.total_sq += sq

    def value(self) -> float | None:
        """The running mean per step, or the first update's while it is the only one."""
        if self.mean_sq is not None:
            return self.mean_sq
        return self.total_sq / self.covered**2 if self.step >= 0 else None


@dataclass(slots=True)
class OriginRecord:
    """What this replica knows of one origin's updates (kept while it is a peer)."""

    steps: set[int] = field(default_factory=set)
    """Update steps taken from it, within the staleness bound of its newest."""
    step_list: list[int] = field(default_factory=list)
    """The same steps, sorted."""
    newest: int = -1
    claimed: int = -1
    """The newest update step its chunks said, taken or not: where it says it is, one
    voice in :meth:`InfluenceBound.run_front`'s median."""
    norms: dict[int, UpdateNorm] = field(default_factory=dict)
    """Per bucket: the running squared norm of one of its updates, as taken."""
    taken_sq: dict[tuple[int, int], float] = field(default_factory=dict)
    """(step, bucket) -> squared norm of what was taken of that update so far."""
    agreement: float = 0.0
    """The running mean of its updates' cosines with this replica's direction."""
    agreement_sq: float = 0.0
    """The running mean of their squares (the cosines' spread)."""
    updates_seen: int = 0
    refusals: collections.deque[int] = field(default_factory=collections.deque)
    """This replica's steps at its recent refusals."""
    aside_until: int = -1
    clipped: int = 0
    """Chunks taken at less than their full norm."""
    weight_raised: int = 0
    """Chunks whose claimed replica count was raised."""
    drift_sq: dict[int, tuple[int, float]] = field(default_factory=dict)
    """Per bucket: the step of its latest consensus fragment and the mean square of its
    difference from this replica's parameters of that step, per element."""
    budget: dict[int, tuple[float, int]] = field(default_factory=dict)
    chunk_rms: dict[int, tuple[float, int]] = field(default_factory=dict)
    """Per bucket: the running RMS of its update chunks and how many were seen (what
    its own norm bound holds others' chunks against, as this replica sees it)."""
    """Per bucket: the norm it may still move this replica by, and the run's front
    (this replica's vouched step) when that was last topped up."""


class DirectionSketch:
    """This replica's recent updates, summed, in a count sketch per bucket: the
    current window and the one before (each spans ``window`` own sends)."""

    def __init__(self, buckets: int, device: torch.device, window: int) -> None:
        self.window = max(1, window)
        self.cells = [torch.zeros(2, SKETCH_SIZE, device=device) for _ in range(buckets)]
        self.sends = [0] * buckets

    def add(
        self, bucket: int, positions: torch.Tensor | None, start: int, values: torch.Tensor
    ) -> None:
        sends = self.sends[bucket] + 1
        self.sends[bucket] = sends
        cells = self.cells[bucket]
        if sends % self.window == 0:  # the older window goes, the current becomes it
            cells[1].copy_(cells[0])
            cells[0].zero_()
        index, sign = _cells(positions, start, values)
        cells[0].index_add_(0, index, values.float() * sign)

    def cosine(
        self, bucket: int, positions: torch.Tensor | None, start: int, values: torch.Tensor
    ) -> float | None:
        """The estimated cosine between these values and the recent own updates on the
        coordinates they touch; None when there are none yet. On those coordinates
        only: a sparse chunk touches 1% of a bucket, and a cosine against the whole
        of the own updates would be diluted by the rest (an exact flip of the own
        direction read as -0.1, not -1)."""
        if self.sends[bucket] == 0:
            return None
        own = self.cells[bucket].sum(0)
        index, sign = _cells(positions, start, values)
        theirs = torch.zeros_like(own).index_add_(0, index, values.float() * sign)
        norm = float(torch.linalg.vector_norm(theirs))
        if norm == 0.0 or not math.isfinite(norm):
            return None
        touched = torch.zeros_like(own).index_fill_(0, index, 1.0)
        own_norm = float(torch.linalg.vector_norm(own * touched))
        if own_norm == 0.0:
            return None
        return float(torch.dot(own, theirs)) / (own_norm * norm)


def _cells(
    positions: torch.Tensor | None, start: int, values: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    if positions is None:
        at = torch.arange(start, start + values.numel(), device=values.device, dtype=torch.int64)
    else:
        at = positions.to(torch.int64) + start
    h = (at * _HASH_MULT) & 0xFFFFFFFF
    index = (h >> 8) % SKETCH_SIZE
    sign = ((h & 1) * 2 - 1).to(torch.float32)
    return index, sign


def _insert_step(steps: list[int], step: int, bound: int) -> None:
    """Insert ``step`` in the sorted ``steps``, dropping those past ``bound`` behind the
    newest."""
    i = bisect.bisect_left(steps, step)
    if i < len(steps) and steps[i] == step:
        return
    steps.insert(i, step)
    cut = bisect.bisect_left(steps, steps[-1] - bound)
    if cut:
        del steps[:cut]


def _any_within(steps: list[int], lo: int, hi: int) -> bool:
    i = bisect.bisect_left(steps, lo)
    return i < len(steps) and steps[i] <= hi


class PaceRefusal(Exception):
    """An update step this replica cannot vouch for (the reason's text)."""


class InfluenceBound:
    """The bounds of the module docstring for one replica."""

    def __init__(
        self,
        train: TrainSection,
        buckets: int,
        device: torch.device,
        me: str,
        announced: Callable[[], Iterable[tuple[str, int]]] = tuple,
    ) -> None:
        self.train = train
        self.me = me
        self.announced = announced
        """The run's replicas and the step each is known to be at (the roster's: its
        newest chunk or the step its JOIN said), for :meth:`run_front`."""
        self.min_gap = max(
            1, train.inner_steps if train.mode == "outer" else train.send_interval_steps
        )
        self.origins: dict[str, OriginRecord] = {}
        self.own_norms: dict[int, UpdateNorm] = {}
        # A round's pseudo-gradient against the own last one or two: a window of
        # rounds spans much of a run, whose direction turns (honest DiLoCo replicas
        # read as disagreeing against 16 rounds: -0.28 to +0.18; against one, 0 to 0.2).
        self.sketch = DirectionSketch(
            buckets, device, 1 if train.mode == "outer" else train.influence_window_sends
        )
        self.own_steps: list[int] = []
        """This replica's own update steps, sorted, within the bound of the newest."""
        self.clip_ratio = (
            train.influence_clip_ratio_rounds
            if train.mode == "outer"
            else train.influence_clip_ratio
        )
        """``influence_clip_ratio``, or its value for rounds in outer mode."""
        self.burst_steps = self.min_gap + (
            train.inner_steps if train.mode == "outer" else train.max_send_interval_steps
        )
        """Steps' worth of norm an origin may save up: the longest merge an honest
        replica makes and one send more (repair brings a late update beside the next)."""

    # -- this replica's own side ----------------------------------------------------------

    def record_own(
        self,
        bucket: int,
        step: int,
        positions: torch.Tensor | None,
        start: int,
        values: torch.Tensor,
    ) -> None:
        """One own sent chunk (encoder thread)."""
        covered = self._covered(self.own_steps, step)
        _insert_step(self.own_steps, step, self.train.staleness_bound_steps)
        flat = values.float()
        norm = self.own_norms.setdefault(bucket, UpdateNorm())
        norm.add(step, float(torch.dot(flat, flat)), covered)
        self.sketch.add(bucket, positions, start, values)

    def replicas_seen(self, step: int) -> int:
        """Replicas whose updates of steps within the staleness bound up to ``step``
        this replica has taken (its own included): what a chunk of ``step`` may not
        claim fewer than. Replicas learn of a joiner at different moments, so only
        updates seen count, never the roster; a replica that died still counts for
        the bound's span after its last update, everywhere alike."""
        lo = step - self.train.staleness_bound_steps
        seen = int(_any_within(self.own_steps, lo, step))
        for rec in self.origins.values():
            seen += _any_within(rec.step_list, lo, step) and not self.weightless(rec)
        return seen

    def weightless(self, rec: OriginRecord) -> bool:
        """An origin whose updates weigh nothing here (set aside, or its direction
        against the run's): it is no replica in the count every chunk is weighted by,
        or a member that joins to work against the run would dilute every honest
        update by N/(N+1) even once its own weigh nothing."""
        return rec.aside_until > rec.newest or self.agreement_weight(rec) == 0.0

    def counted(self, names: Iterable[str]) -> int:
        """How many of these replicas count towards N (not :meth:`weightless`)."""
        return sum(
            1 for n in names if (rec := self.origins.get(n)) is None or not self.weightless(rec)
        )

    # -- an origin's updates --------------------------------------------------------------

    def record(self, origin: str) -> OriginRecord:
        rec = self.origins.get(origin)
        if rec is None:
            rec = self.origins[origin] = OriginRecord()
        return rec

    def forget(self, origin: str) -> None:
        self.origins.pop(origin, None)

    def set_aside(self, origin: str, step: int) -> bool:
        rec = self.origins.get(origin)
        return rec is not None and step < rec.aside_until

    def refused(self, origin: str, step: int) -> bool:
        """Count a refusal of ``origin``'s payload at this replica's ``step``; True
        when this one sets it aside."""
        rec = self.record(origin)
        window = self.train.staleness_bound_steps
        rec.refusals.append(step)
        while rec.refusals and rec.refusals[0] <= step - window:
            rec.refusals.popleft()
        limit = self.train.set_aside_refusals
        if limit > 0 and len(rec.refusals) >= limit and step >= rec.aside_until:
            rec.aside_until = step + self.train.set_aside_steps
            rec.refusals.clear()
            return True
        return False

    def run_front(self, own_step: int) -> int:
        """The run's newest step as this replica can vouch for it: the lower median of
        its own step and each origin's newest, taken from it, said by its chunks or
        announced by it (a JOIN): after a gap (its daemon restarted, a partition) the
        updates taken are old, and a front of them alone refused every honest update
        ahead of it as ``pace`` and set the run's replicas aside. One origin's claim
        cannot carry the median."""
        newest = {
            name: max(r.newest, r.claimed)
            for name, r in self.origins.items()
            if max(r.newest, r.claimed) >= 0
        }
        for name, step in self.announced():
            if step > newest.get(name, -1):
                newest[name] = step
        steps = sorted([own_step, *newest.values()])
        return steps[(len(steps) - 1) // 2]

    def check_pace(self, origin: str, step: int, own_step: int) -> None:
        """Raise :class:`PaceRefusal` for an update step this replica cannot vouch for."""
        rec = self.record(origin)
        if step in rec.steps:
            return  # another chunk of an update already taken
        rec.claimed = max(rec.claimed, step)
        bound = self.train.staleness_bound_steps
        front = (
            self.run_front(own_step) + bound + (self.min_gap if self.train.mode == "outer" else 0)
        )
        if step > front:
            raise PaceRefusal(f"step {step} is past the run's window (up to {front})")
        # No floor behind the origin's newest: repair brings honest chunks dozens of
        # steps late (a bound of the staleness bound refused them in
        # tests/train/test_embedded.py). A late step is taken once (the replay window)
        # and clipped as one step's update.

    def take_step(self, origin: str, step: int) -> None:
        rec = self.record(origin)
        if step in rec.steps:
            return
        rec.steps.add(step)
        rec.newest = max(rec.newest, step)
        _insert_step(rec.step_list, step, self.train.staleness_bound_steps)
        floor = rec.newest - self.train.staleness_bound_steps
        if len(rec.steps) > len(rec.step_list):
            rec.steps = set(rec.step_list)
            rec.taken_sq = {k: v for k, v in rec.taken_sq.items() if k[0] >= floor}

    def record_rms(self, origin: str, bucket: int, rms: float) -> None:
        """One update chunk of ``origin`` of RMS ``rms`` in ``bucket`` (every one it
        sent, as it records its own: refused or not)."""
        if rms > 0.0 and math.isfinite(rms):
            rec = self.record(origin)
            old, n = rec.chunk_rms.get(bucket, (0.0, 0))
            rec.chunk_rms[bucket] = (rms if n == 0 else 0.9 * old + 0.1 * rms, n + 1)

    def rms_reference(
        self, bucket: int, alive: Container[str], own_rms: float, own_count: int
    ) -> float | None:
        """The lower median of the running chunk RMS in ``bucket`` over this replica
        (``own_rms`` of ``own_count`` chunks) and the origins ``alive``, each once it
        has sent ``norm_warmup_chunks``; None while none has."""
        warm = self.train.norm_warmup_chunks
        found = [
            r.chunk_rms[bucket][0]
            for name, r in self.origins.items()
            if name in alive and r.chunk_rms.get(bucket, (0.0, 0))[1] >= warm
        ]
        if own_count >= warm:
            found.append(own_rms)
        found.sort()
        return found[(len(found) - 1) // 2] if found else None

    def reference_sq(self, bucket: int, alive: Container[str]) -> float | None:
        """The lower median of the running squared norms of one update in ``bucket``
        over this replica and the origins ``alive``; None while nothing is known."""
        found = [
            r.norms[bucket].value()
            for name, r in self.origins.items()
            if bucket in r.norms and name in alive
        ]
        own = self.own_norms.get(bucket)
        found.append(None if own is None else own.value())
        norms = sorted(v for v in found if v is not None)
        return norms[(len(norms) - 1) // 2] if norms else None

    def scale(
        self,
        origin: str,
        step: int,
        bucket: int,
        positions: torch.Tensor | None,
        start: int,
        values: torch.Tensor,
        alive: Container[str],
        own_step: int = 0,
    ) -> float:
        """The factor (0 to 1) this chunk's values are taken at: its update's norm
        clipped against the reference, and against what the origin may still move
        this replica by as the run's front advances (whatever its step numbers say),
        times its origin's agreement weight. Records what was taken."""
        rec = self.record(origin)
        flat = values.float()
        sq = float(torch.dot(flat, flat))
        key = (step, bucket)
        before = rec.taken_sq.get(key, 0.0)
        factor = 1.0
        ref = self.reference_sq(bucket, alive)
        covered = self._covered(rec.step_list, step)
        if ref is not None:
            cap = self.clip_ratio**2 * ref * covered**2
            room = max(0.0, cap - before)
            if sq > room:
                factor = math.sqrt(room / sq) if sq > 0.0 else 0.0
            factor = self._spend(rec, bucket, step, factor, sq, ref, own_step)
            if factor < 1.0:
                rec.clipped += 1
        taken = factor * factor * sq
        rec.taken_sq[key] = before + taken
        if before == 0.0:
            rec.updates_seen += 1
        rec.norms.setdefault(bucket, UpdateNorm()).add(step, taken, covered)
        cos = self.sketch.cosine(bucket, positions, start, values)
        if cos is not None:
            rec.agreement = (1 - AGREEMENT_EMA) * rec.agreement + AGREEMENT_EMA * cos
            rec.agreement_sq = (1 - AGREEMENT_EMA) * rec.agreement_sq + AGREEMENT_EMA * cos * cos
        return factor * self.agreement_weight(rec)

    def drift_known(
        self, origin: str, bucket: int, step: int, diff_sq: float, alive: Container[str]
    ) -> bool:
        """Records ``origin``'s difference in ``bucket`` at consensus round ``step`` and
        says whether another origin ``alive`` has one of the same round there: a
        fragment with none to be held against is unbounded, so the caller holds it
        until one comes. Else a member that sent each round's fragment the moment the
        round opened was held against the honest drift of the round before (larger:
        the mix shrinks it round by round), and its first against nothing: unclipped,
        up to ``params_distance_max_ratio`` of the parameters' scale."""
        self.record(origin).drift_sq[bucket] = (step, diff_sq)
        return any(
            r.drift_sq.get(bucket, (-1, 0.0))[0] == step and name in alive
            for name, r in self.origins.items()
            if name != origin
        )

    def mix_scale(
        self, origin: str, bucket: int, step: int, diff_sq: float, alive: Container[str]
    ) -> float:
        """The factor (0 to 1) a consensus fragment's pull is taken at: its mean square
        difference from this replica's parameters (``diff_sq``, per element) clipped to
        the clip ratio times the lower median of the origins' differences in ``bucket``
        at the same round ``step`` (each origin's latest), times its agreement weight
        (none for an origin that weighs nothing). Honest fragments differ by the
        replicas' drift, alike from every origin (a replica that drifted sees every
        origin far, and mixes); without the clip a member pulled every fragment by
        ``consensus_mix / (N - 1)`` of up to ``params_distance_max_ratio`` of the
        parameters' scale, every round, in a direction of its choosing. Of the same
        round, not a running mean: the mix shrinks the drift it measures round by
        round, and the larger past let a member pull by the drift of rounds ago. As
        seen, not as mixed: the lower median over the origins already keeps one from
        setting the reference, and an honest origin clipped once would otherwise stay
        clipped."""
        rec = self.record(origin)
        rec.drift_sq[bucket] = (step, diff_sq)
        found = sorted(
            r.drift_sq[bucket][1]
            for name, r in self.origins.items()
            if r.drift_sq.get(bucket, (-1, 0.0))[0] == step and (name in alive or r is rec)
        )
        ref = found[(len(found) - 1) // 2]
        factor = 1.0
        if diff_sq > self.clip_ratio**2 * ref:
            factor = self.clip_ratio * math.sqrt(ref / diff_sq)
            rec.clipped += 1
        return 0.0 if self.weightless(rec) else factor

    def _spend(
        self,
        rec: OriginRecord,
        bucket: int,
        step: int,
        factor: float,
        sq: float,
        ref: float,
        own_step: int,
    ) -> float:
        """``factor`` lowered to what the origin's budget in ``bucket`` allows, and the
        budget spent: ``influence_clip_ratio`` times the reference norm per step the
        run's front advances (as this replica vouches for it), saved up to
        ``burst_steps`` steps' worth plus the staleness bound (or as many as this
        update lies behind the front, if more). One update spends at most
        ``burst_steps`` steps' worth plus as many as it lies behind the front: a
        replica catching up after a partition, a restore or its daemon's restart
        sends a backlog at once, and its fresh updates, which often arrive first,
        must not use up what the backlog is owed (they did while the savings were
        capped by each update's own allowance: a restarted replica took the others'
        backlog at a fraction and stayed apart from them). A member's fresh step
        numbers ahead of the run buy it nothing: only the run's progress does, so one
        origin moves this replica by at most the ratio times an honest step's norm per
        step, however it numbers and splits them."""
        per_step = self.clip_ratio * math.sqrt(ref)
        front = self.run_front(own_step)
        behind = max(0, front - step)
        allowance = per_step * (self.burst_steps + behind)
        most = per_step * (self.burst_steps + max(behind, self.train.staleness_bound_steps))
        left, since = rec.budget.get(bucket, (allowance, front))
        left = min(most, left + max(0, front - since) * per_step)
        usable = min(left, allowance)
        norm = factor * math.sqrt(sq)
        if norm > usable:
            factor = usable / math.sqrt(sq) if sq > 0.0 else 0.0
            norm = usable
        rec.budget[bucket] = (left - norm, max(since, front))
        return factor

    def covered(self, origin: str, step: int) -> int:
        """The steps ``origin``'s update of ``step`` covers (see :meth:`_covered`)."""
        rec = self.origins.get(origin)
        return self._covered([] if rec is None else rec.step_list, step)

    def _covered(self, steps: list[int], step: int) -> int:
        """The steps an update of ``step`` covers: since the one before it in
        ``steps`` (one send interval for a first), at most the longest merge an honest
        replica makes (its ``max_send_interval_steps``, or a round)."""
        i = bisect.bisect_left(steps, step)
        gap = step - steps[i - 1] if i > 0 else self.min_gap
        longest = (
            self.train.inner_steps
            if self.train.mode == "outer"
            else self.train.max_send_interval_steps
        )
        return max(1, min(gap, longest))

    def agreement_weight(self, rec: OriginRecord) -> float:
        """1 while an origin's agreement with this replica's direction is not below 0
        beyond its noise (:meth:`agreement_bound`), falling to 0 at
        ``-influence_disagreement``."""
        band = self.train.influence_disagreement
        if rec.updates_seen < AGREEMENT_MIN_UPDATES or band <= 0.0:
            return 1.0
        upper = agreement_bound(rec)
        return 1.0 if upper >= 0.0 else max(0.0, 1.0 + upper / band)


def agreement_bound(rec: OriginRecord) -> float:
    """The upper confidence bound of an origin's agreement: its running mean plus
    ``AGREEMENT_Z`` standard errors of that mean."""
    spread = math.sqrt(max(0.0, rec.agreement_sq - rec.agreement * rec.agreement))
    return rec.agreement + AGREEMENT_Z * _EMA_SE * spread
