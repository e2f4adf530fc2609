"""Whether a run's state agrees with the run: what a joiner checks before it takes a
state fetched from the mesh (train.statesync). Pure: numbers in, a reason out.

A state's version is its writer's step and its meta's ``applied`` the newest update
step of each origin it holds (core.replica.rule). A member can write any state as its
own (core.store.holder keeps each writer's apart), so a joiner takes one only when
it fits what the run's replicas announce (their JOIN steps, ``replica.peers``):

- the run's step is the *lower median* of the replicas' announced steps: one replica
  that claims a far step cannot move it, nor can one of two;
- the state's step lies within ``bound`` (``train.staleness_bound_steps``) of it;
- each origin's floor is at most that origin's announced step plus ``bound`` (a
  snapshot is taken a little after the JOIN it answers), an origin that announced
  nothing at most the window's top: a floor above it would have the joiner drop that
  origin's honest updates for good.

The values' finiteness is checked where they are read (core.store.statefile).

Where the run has two or more other replicas, a state must also agree with them:
the joiner samples spans of other replicas' states (not the writer's) and takes the
state only when at least one sample lies within the tolerance of it and no more
disagree than agree (:func:`agreement_refusal`). One member can neither pass its own
forged state (every honest sample disagrees) nor veto an honest one in a run of
three or more others (the honest samples outvote it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

MAX_ORIGINS = 4096
"""Floors one state may carry (its meta area holds far fewer)."""


@dataclass(frozen=True, slots=True)
class RunWindow:
    """The steps a state of the run may be at: ``low`` to ``high``, around ``step``."""

    step: int
    low: int
    high: int
    announced: Mapping[str, int]
    bound: int


def run_window(
    announced: Mapping[str, int], bound: int, behind: int | None = None
) -> RunWindow | None:
    """The window of the replicas' announced steps (None: no replica announced one):
    ``bound`` ahead of the run, ``behind`` (default ``bound``) behind it. A state
    behind the run is no lever (the joiner takes the chunks since, held for it; a
    restarted daemon's prefetched state is that), one ahead of it is."""
    if not announced:
        return None
    steps = sorted(announced.values())
    step = steps[(len(steps) - 1) // 2]
    low = max(0, step - (bound if behind is None else behind))
    return RunWindow(step, low, step + bound, dict(announced), bound)


def state_refusal(window: RunWindow, version: int, applied: object) -> str | None:
    """Why a state at ``version`` with floors ``applied`` does not agree with the run
    (None: it does)."""
    if not window.low <= version <= window.high:
        return (
            f"its step {version} is outside the run's window {window.low}..{window.high} "
            f"(the replicas stand at {window.step})"
        )
    if not isinstance(applied, dict) or len(applied) > MAX_ORIGINS:
        return "its per-origin floors are malformed"
    for origin, floor in applied.items():
        if not isinstance(origin, str) or type(floor) is not int or floor < 0:
            return "its per-origin floors are malformed"
        said = window.announced.get(origin)
        limit = window.high if said is None else said + window.bound
        if floor > limit:
            return f"its floor for {origin} is {floor}, above what that origin announced ({said})"
    return None


def agreement_refusal(distances: Mapping[str, float | None], tolerance: float) -> str | None:
    """Why a state is not vouched for by the other replicas' samples (None: it is).
    ``distances``: each voucher's relative distance from the state (None: it sent no
    sample, which neither vouches nor objects)."""
    answered = {w: d for w, d in distances.items() if d is not None}
    agree = sum(1 for d in answered.values() if d <= tolerance)
    disagree = len(answered) - agree
    if not answered:
        return "no other replica sent a sample of its state to compare it with"
    if agree == 0 or disagree > agree:
        shown = ", ".join(f"{d:.3g}" for d in sorted(answered.values()))
        return (
            f"{disagree} of {len(answered)} other replicas' states differ from it by more "
            f"than {tolerance:g} (relative distances {shown})"
        )
    return None
