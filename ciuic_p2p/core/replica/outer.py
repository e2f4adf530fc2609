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
that comes after its round was completed here (late), or before (a peer a round
ahead), gets the kicks it missed or will wrongly get as part of its coefficient, so
every replica adds every chunk with the same total weight whatever the order it saw
them in.

The replica's base (core.replica.parameters) is the anchor less the residual the
error feedback holds back; what the outer step adds goes into both, like any chunk.
With ``average`` at ``lr = 1`` this is the per-step rule with a send every H steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ciuic_p2p.config.sections import TrainSection


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
        now (a peer's, on arrival; the own chunk's is this minus 1 at settlement)."""
        mu, lr = self.momentum, self.lr
        base = lr * (1.0 + mu)
        if mu == 0.0:
            return lr
        s, n = self.round_of(step), self.next_round
        # Geometric sums in closed form: O(1) however late a chunk is.
        if s >= n:  # completions of rounds n .. s-1 will kick it early: take that back
            kicks = -(mu ** (n - s) - 1.0) / (1.0 - mu)  # sum of mu^-j, j = 1 .. s-n
        else:  # rounds s .. n-1 completed without it: the kicks it missed
            kicks = (1.0 - mu ** (n - s)) / (1.0 - mu)  # sum of mu^j, j = 0 .. n-s-1
        return base + lr * mu * mu * kicks

    def accepts(self, step: int, own_step: int, bound_steps: int) -> bool:
        """A chunk of ``step`` is no further ahead of this replica's ``own_step`` than a
        live peer can be (the staleness bound and one round): a claimed step beyond
        would be weighted by ``mu`` to a power no honest chunk needs."""
        return step <= own_step + bound_steps + self.inner_steps

    def momentum_factor(self, step: int) -> float:
        """What a chunk of ``step`` adds to ``m`` over its ``w`` (0 without momentum)."""
        if self.momentum == 0.0:
            return 0.0
        return float(self.momentum ** (self.next_round - 1 - self.round_of(step)))

    def record(
        self,
        bucket: int,
        start: int,
        positions: torch.Tensor | None,
        values: torch.Tensor,
        w: float,
        step: int,
    ) -> None:
        """Add a chunk (``positions`` relative to ``start``; None: dense) to ``m``."""
        factor = w * self.momentum_factor(step)
        if factor == 0.0:
            return
        with torch.no_grad():
            target = self.buffers[bucket]
            if positions is None:
                target[start : start + values.numel()].add_(values, alpha=factor)
            else:
                at = positions + start if start else positions
                target.index_add_(0, at, values, alpha=factor)

    def complete_through(self, floor_step: int) -> list[Kick]:
        """Complete every round whose steps are all at or below ``floor_step`` (every
        live replica's stream has reached it); the momentum kicks to add."""
        kicks: list[Kick] = []
        while self.next_round * self.inner_steps <= floor_step:
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
        return out

    def start_at(self, step: int) -> None:
        """Begin after ``step`` (a restored state holds every round through it)."""
        self.next_round = step // self.inner_steps + 1

    def held_bytes(self) -> int:
        return sum(m.numel() * m.element_size() for m in [*self.buffers, *self.held])
