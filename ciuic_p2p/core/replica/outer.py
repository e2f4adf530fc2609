"""The outer step of ``train.mode = "outer"``: rounds of H inner steps, and the outer
optimizer over the mean of the replicas' rounds. Pure (no clock, no I/O).

A replica sends its round's progress (the pseudo-gradient ``params - anchor``, negated,
through the error-feedback codec) at every step that is a multiple of H. Where the
per-step rule adds ``w * c`` of every chunk (``w = 1/N``), the outer step adds what the
outer optimizer makes of the mean ``D_r = sum_j w * c_j`` of round r:

    average:   params += lr * D_r                                  (SparseLoCo)
    nesterov:  m_r = mu * m_{r-1} + D_r
               params += lr * (D_r + mu * m_r)
                       = lr * (1 + mu) * D_r  +  lr * mu^2 * m_{r-1}   (DiLoCo)

Both are linear in the chunks, so a chunk is applied as it arrives, with its own
coefficient, and the round is not waited for: ``lr * (1 + mu) * w`` of it at once (the
origin's own chunk, already in its parameters in full, is settled to that weight once
every replica has sent its round), and the momentum part through the dense buffer
``m``: once round r is complete here (every live replica's stream past its last step),
``m`` is scaled by ``mu`` (it is then ``m_r``) and the kick ``lr * mu^2 * m_{r-1}``,
computed at the previous completion and held since, is added to the parameters. So
once round r is complete a replica holds exactly DiLoCo's anchor after round r, one
round late (as asynchronous DiLoCo applies it), plus its own progress since. A chunk
that comes after its round was completed here (late) gets the kicks it missed as part
of its coefficient (at most ``lr * mu^2 / (1 - mu)`` more). A chunk of a round ahead
of the oldest incomplete one (its origin is ahead of a replica still in an older
round) gets its ``lr * (1 + mu) * w`` at once, and enters ``m`` only when its round is
the next to complete, as if it arrived then: a chunk r rounds ahead entered into
``m`` at once would need ``mu^-r`` in ``m`` and a negative coefficient of the same
size to cancel the kicks it gets early, which leave the parameters far off until the
rounds complete (measured: losses of 150-365 on digits at mu = 0.5 while one replica
restored its state 7 rounds behind). So every replica adds every chunk with the same
total weight whatever the order it saw them in, and no factor exceeds the late one.

The replica's base (core.replica.parameters) is the anchor less the residual the
error feedback holds back; what the outer step adds goes into both, like any chunk.
With ``average`` at ``lr = 1`` this is the per-step rule with a send every H steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ciuic_p2p.config.sections import TrainSection
from ciuic_p2p.core.replica.parameters import add_at


@dataclass(frozen=True, slots=True)
class Deferred:
    """A chunk's momentum part, kept until its round is the next to complete."""

    round: int
    bucket: int
    start: int
    positions: torch.Tensor | None
    values: torch.Tensor
    w: float


@dataclass(frozen=True, slots=True)
class Kick:
    """Add ``values`` to ``[start, start + len)`` of a bucket and its base (the momentum
    part of a round's step)."""

    bucket: int
    start: int
    values: torch.Tensor


class OuterStep:
    """The rounds and the outer optimizer's state for one replica (see the module
    docstring)."""

    def __init__(self, buckets: Sequence[torch.Tensor], train: TrainSection) -> None:
        self.inner_steps = max(1, train.inner_steps)
        self.bound_steps = train.staleness_bound_steps
        self.lr = train.outer_lr
        self.momentum = train.outer_momentum if train.outer_optimizer == "nesterov" else 0.0
        self.buffers: list[torch.Tensor] = (
            [torch.zeros_like(b, dtype=torch.float32) for b in buckets]
            if self.momentum > 0.0
            else []
        )
        """The momentum ``m`` per bucket, in the scale of the next round to complete
        (a chunk of a later round is in it divided by ``mu`` once per round ahead)."""
        self.held: list[torch.Tensor] = []
        """The kick computed at the last completion, added at the next (its round's
        step is applied one round late, as a whole)."""
        self.deferred: list[Deferred] = []
        """Momentum parts of chunks of rounds after ``next_round``, in arrival order."""
        self.next_round = 1
        """The oldest round not yet complete here (round r is sent at step ``rH``, and
        complete once every live replica's stream has reached that step)."""
        self.rounds_completed = 0

    def round_of(self, step: int) -> int:
        """The round a chunk of ``step`` belongs to: rounds are sent at multiples of H,
        and a send merged past its round's end (or the last, at ``finish``) counts in
        the round it mostly holds."""
        return max(1, step // self.inner_steps)

    def is_due(self, step: int) -> bool:
        """A round ends at this step: send."""
        return step > 0 and step % self.inner_steps == 0

    def coefficient(self, step: int) -> float:
        """What a chunk of ``step`` is multiplied by, over its ``w``, when it is added
        now (a peer's, on arrival; the own chunk's is this minus 1 at settlement) and
        its momentum part goes to :meth:`record` at the same time."""
        mu, lr = self.momentum, self.lr
        if mu == 0.0:
            return lr
        s, n = self.round_of(step), self.next_round
        if s >= n:  # on time, or ahead (its momentum part waits for its round)
            return lr * (1.0 + mu)
        # Rounds s .. n-1 completed without it: the kicks it missed, in closed form
        # (O(1) however late it is): the sum of mu^j, j = 0 .. n-s-1.
        kicks = (1.0 - mu ** (n - s)) / (1.0 - mu)
        return lr * (1.0 + mu) + lr * mu * mu * kicks

    def early_correction(self, step: int) -> tuple[float, float]:
        """For a chunk of a round ahead whose momentum part waits here (or an own
        chunk not settled yet), what a copy of this replica's state adds instead, over
        ``w``: (to the parameters, to ``m``). The copy has no waiting list: the chunk
        is in its ``m`` at once, scaled by ``mu^-(s-n+1)``, and the kicks that gets it
        from the completions before its round are taken back from its parameters (the
        exact form the module docstring avoids for the live parameters; a joiner
        holds it only until those rounds complete). (0, 0) for a round not ahead."""
        mu, lr = self.momentum, self.lr
        s, n = self.round_of(step), self.next_round
        if mu == 0.0 or s <= n:
            return 0.0, float(mu ** (n - 1 - s)) if mu else 0.0
        early = -(mu ** (n - s) - 1.0) / (1.0 - mu)  # sum of mu^-j, j = 1 .. s-n
        return lr * mu * mu * early, float(mu ** (n - 1 - s))

    def accepts(self, step: int, own_step: int, bound_steps: int) -> bool:
        """A chunk of ``step`` is no further ahead of this replica's ``own_step`` than a
        live peer can be (the staleness bound and one round): a claimed step beyond
        would be weighted by ``mu`` to a power no honest chunk needs."""
        return step <= own_step + bound_steps + self.inner_steps

    def record(
        self,
        bucket: int,
        start: int,
        positions: torch.Tensor | None,
        values: torch.Tensor,
        w: float,
        step: int,
    ) -> None:
        """Add a chunk (``positions`` relative to ``start``; None: dense) to ``m``, or
        keep it until its round is the next to complete."""
        if self.momentum == 0.0 or w == 0.0:
            return
        s = self.round_of(step)
        if s > self.next_round:
            self.deferred.append(Deferred(s, bucket, start, positions, values, w))
            return
        self._add(bucket, start, positions, values, w * self.momentum ** (self.next_round - 1 - s))

    def _add(
        self,
        bucket: int,
        start: int,
        positions: torch.Tensor | None,
        values: torch.Tensor,
        factor: float,
    ) -> None:
        with torch.no_grad():
            target = self.buffers[bucket]
            if positions is None:
                target[start : start + values.numel()].add_(values, alpha=factor)
            else:
                at = positions + start if start else positions
                add_at(target, at, values, factor)

    def complete_through(self, floor_step: int, before_round: int | None = None) -> list[Kick]:
        """Complete every round whose steps are all at or below ``floor_step`` (every
        live replica's stream has reached it), or only those before ``before_round``;
        the momentum kicks to add."""
        kicks: list[Kick] = []
        while self.next_round * self.inner_steps <= floor_step and (
            before_round is None or self.next_round < before_round
        ):
            kicks += self._complete()
        return kicks

    def _complete(self) -> list[Kick]:
        self.next_round += 1
        self.rounds_completed += 1
        mu = self.momentum
        if mu == 0.0:
            return []
        alpha = self.lr * mu * mu
        out = [Kick(i, 0, k) for i, k in enumerate(self.held)]
        with torch.no_grad():
            self.held = [m.mul_(mu).mul(alpha) for m in self.buffers]
        due = [d for d in self.deferred if d.round == self.next_round]
        if due:  # their round is next now: into m as an on-time chunk would go
            self.deferred = [d for d in self.deferred if d.round != self.next_round]
            for d in due:
                self._add(d.bucket, d.start, d.positions, d.values, d.w / mu)
        return out

    def start_at(self, step: int, next_round: int | None = None) -> None:
        """Begin after ``step`` from a restored state. ``next_round``: the oldest round
        not yet complete where the state was made (its momentum is in that round's
        scale, and the kicks of the rounds before it are in its parameters); without
        it (a state of an older version, or a count no replica at ``step`` could
        hold), every round through ``step`` counts as complete."""
        latest = step // self.inner_steps + 1
        # No live replica's rounds are incomplete further back than the staleness
        # bound and a round: a donor's word past that is refused, not followed (its
        # completions would all run at the first settle, and rounds ahead would need
        # mu to the power of the gap).
        oldest = latest - (self.bound_steps + self.inner_steps) // self.inner_steps - 1
        in_range = next_round is not None and max(1, oldest) <= next_round <= latest
        self.next_round = next_round if next_round is not None and in_range else latest
        self.deferred = []

    def held_bytes(self) -> int:
        held = [*self.buffers, *self.held]
        held += [d.values for d in self.deferred]
        held += [d.positions for d in self.deferred if d.positions is not None]
        return sum(t.numel() * t.element_size() for t in held)
