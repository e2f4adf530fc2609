"""When a replica takes, encodes, mixes, snapshots and checkpoints: the hook's policy
as a pure machine, so that it is tested without threads.

    schedule = ReplicaSchedule(checkpoint_interval_s=600.0, now=now)
    for action in schedule.after_step(facts, now): ...     # after each optimizer step
    for action in schedule.between_steps(facts): ...       # while polling deliveries
    schedule.stalled(waited_s, grace_s)                    # excuse the replicas behind?

The hook (train/hook.py) observes the facts (the replica's step and what it says is
due, whether the encoder thread is idle, whether a joiner asked for the state) and
carries out the actions; it decides nothing itself.

The policy:

- The encoder takes one job at a time, so at most one encoding action is returned per
  call, in this order of precedence: a snapshot a joiner waits for (it goes before
  the update, which merges into the next send); the update, carrying the consensus
  fragment when one is due (after the update, in the same job: an update never
  waits behind a mix); a pending fragment alone; a periodic checkpoint.
- An update due while the encoder is busy is not sent: its steps stay in the local
  progress and go with the next send (``merged_steps``). Not so the send that ends an
  outer round (``round_end``): the peers complete the round only with it, so the step
  waits for the encoder (``WaitForEncoder``, counted as waiting) and the round's send
  goes before a snapshot a joiner waits for (that one follows once the encoder is
  free, between steps). A mix due while another is
  still pending is skipped (``params_skipped``): the encoder was busy a whole interval.
- Every ``stats_every_steps`` steps the replica adapts to the daemon's backlog and the
  trainer's figures go to the daemon (``ReportStats``).
- A step waits while a live replica is past the staleness bound behind, and excuses
  it after ``stall_grace_s`` (dead or far too slow: training goes on).
"""

from __future__ import annotations

from dataclasses import dataclass

STATS_EVERY_STEPS = 8


@dataclass(frozen=True, slots=True)
class StepFacts:
    """What the hook saw, for one decision."""

    step: int
    update_due: bool = False
    """The replica's send interval has passed since its last send."""
    params_due: bool = False
    """A consensus mix is due at this step."""
    encoder_idle: bool = True
    snapshot_wanted: bool = False
    """A joiner asked the daemon for this run's state."""
    ready: bool = True
    """The replica's state is restored: only then may peers have it."""
    checkpointing: bool = False
    """A checkpoint directory is set."""
    round_end: bool = False
    """The update due ends an outer round (``train.mode = "outer"``): never merged."""


@dataclass(frozen=True, slots=True)
class WaitForEncoder:
    """Wait (bounded, counted) until the encoder's job is done: the round's send that
    follows may not be merged into the next."""


@dataclass(frozen=True, slots=True)
class HandState:
    """Snapshot the state (on the training thread) and hand it to the daemon on the
    encoder thread; with ``checkpoint``, write the checkpoint file too."""

    checkpoint: bool


@dataclass(frozen=True, slots=True)
class EncodeParams:
    """Encode and publish a snapshot of the parameters (the consensus mix)."""


@dataclass(frozen=True, slots=True)
class EncodeUpdate:
    """Take the local progress, encode and publish it."""

    with_params: bool = False
    """Then snapshot and publish the consensus fragment due, in the same job."""


@dataclass(frozen=True, slots=True)
class ReportStats:
    """Adapt to the daemon's backlog, and send the trainer's figures with the next
    chunks."""


ScheduleAction = WaitForEncoder | HandState | EncodeParams | EncodeUpdate | ReportStats


class ReplicaSchedule:
    """See the module docstring."""

    def __init__(
        self,
        *,
        checkpoint_interval_s: float,
        now: float,
        stats_every_steps: int = STATS_EVERY_STEPS,
    ) -> None:
        """``checkpoint_interval_s``: 0 or less writes no periodic checkpoints."""
        self.checkpoint_interval_s = checkpoint_interval_s
        self.stats_every_steps = stats_every_steps
        self.merged_steps = 0
        self.params_skipped = 0
        self._params_pending = False
        self._checkpoint_at = now

    def checkpointed(self, now: float) -> None:
        """A checkpoint was written (by an action or directly, as at SIGTERM): the next
        periodic one is an interval from now."""
        self._checkpoint_at = now

    def after_step(self, facts: StepFacts, now: float) -> list[ScheduleAction]:
        """The actions after one optimizer step, in order."""
        actions: list[ScheduleAction] = []
        idle = facts.encoder_idle
        rounds_send = facts.update_due and facts.round_end
        if rounds_send and not idle:
            actions.append(WaitForEncoder())
            idle = True
        if facts.ready and facts.snapshot_wanted and idle and not rounds_send:
            actions.append(HandState(checkpoint=False))
            idle = False
        if facts.params_due:
            if self._params_pending:
                self.params_skipped += 1
            self._params_pending = True
        if facts.update_due:
            if idle:
                actions.append(EncodeUpdate(with_params=self._params_pending))
                self._params_pending = False
                idle = False
            else:
                self.merged_steps += 1
        if self._params_pending and idle:
            self._params_pending = False
            actions.append(EncodeParams())
            idle = False
        if facts.checkpointing and idle and self._checkpoint_due(now):
            actions.append(HandState(checkpoint=True))
            self._checkpoint_at = now
        if facts.step % self.stats_every_steps == 0:
            actions.append(ReportStats())
        return actions

    def between_steps(self, facts: StepFacts) -> list[ScheduleAction]:
        """While polling deliveries: a joiner waiting for the state gets it as soon as
        the encoder is free."""
        if facts.ready and facts.snapshot_wanted and facts.encoder_idle:
            return [HandState(checkpoint=False)]
        return []

    @staticmethod
    def stalled(waited_s: float, grace_s: float) -> bool:
        """Whether the replicas behind are excused after waiting ``waited_s``."""
        return waited_s > grace_s

    def _checkpoint_due(self, now: float) -> bool:
        interval = self.checkpoint_interval_s
        return 0 < interval <= now - self._checkpoint_at
