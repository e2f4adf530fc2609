"""The replica schedule (core.replica.schedule): the hook's policy without threads."""

from __future__ import annotations

from ciuic_p2p.core.replica.schedule import (
    EncodeParams,
    EncodeUpdate,
    HandState,
    ReplicaSchedule,
    ReportStats,
    StepFacts,
    WaitForEncoder,
)


def schedule(interval_s: float = 0.0, now: float = 0.0) -> ReplicaSchedule:
    return ReplicaSchedule(checkpoint_interval_s=interval_s, now=now)


def test_an_idle_encoder_takes_the_due_update() -> None:
    s = schedule()
    assert s.after_step(StepFacts(step=1, update_due=True), 0.0) == [EncodeUpdate()]
    assert s.after_step(StepFacts(step=2), 0.0) == []


def test_an_update_due_while_the_encoder_is_busy_merges_into_the_next_send() -> None:
    s = schedule()
    busy = StepFacts(step=1, update_due=True, encoder_idle=False)
    assert s.after_step(busy, 0.0) == [] and s.merged_steps == 1
    assert s.after_step(StepFacts(step=2, update_due=True), 0.0) == [EncodeUpdate()]
    assert s.merged_steps == 1


def test_a_joiners_snapshot_goes_first_and_the_update_waits() -> None:
    s = schedule()
    facts = StepFacts(step=3, update_due=True, snapshot_wanted=True)
    assert s.after_step(facts, 0.0) == [HandState(checkpoint=False)]
    assert s.merged_steps == 1  # one encoder job at a time


def test_a_rounds_send_is_never_merged_and_goes_before_a_joiners_snapshot() -> None:
    """Outer mode: the peers complete a round only with every replica's send of it."""
    s = schedule()
    busy = StepFacts(step=5, update_due=True, encoder_idle=False, round_end=True)
    assert s.after_step(busy, 0.0) == [WaitForEncoder(), EncodeUpdate()]
    joiner = StepFacts(step=10, update_due=True, snapshot_wanted=True, round_end=True)
    assert s.after_step(joiner, 0.0) == [EncodeUpdate()]
    assert s.merged_steps == 0
    # The snapshot follows once the encoder is free, between steps.
    assert s.between_steps(StepFacts(step=10, snapshot_wanted=True, encoder_idle=False)) == []
    assert s.between_steps(StepFacts(step=10, snapshot_wanted=True)) == [HandState(False)]
    # Inside a round the snapshot goes at once, as in step mode.
    inside = StepFacts(step=11, snapshot_wanted=True, round_end=False)
    assert s.after_step(inside, 0.0) == [HandState(checkpoint=False)]


def test_no_snapshot_before_the_state_is_restored() -> None:
    s = schedule()
    facts = StepFacts(step=3, snapshot_wanted=True, ready=False)
    assert s.after_step(facts, 0.0) == []
    assert s.between_steps(facts) == []
    assert s.between_steps(StepFacts(step=3, snapshot_wanted=True)) == [HandState(False)]
    assert s.between_steps(StepFacts(step=3, snapshot_wanted=True, encoder_idle=False)) == []


def test_the_mix_goes_after_the_update_in_its_job_and_waits_for_an_idle_encoder() -> None:
    s = schedule()
    both = StepFacts(step=5, update_due=True, params_due=True)
    # One job: the update first, then the fragment; no step merges behind a mix.
    assert s.after_step(both, 0.0) == [EncodeUpdate(with_params=True)]
    assert s.merged_steps == 0
    # Due while busy: kept pending, sent once the encoder is free.
    s2 = schedule()
    assert s2.after_step(StepFacts(step=5, params_due=True, encoder_idle=False), 0.0) == []
    assert s2.after_step(StepFacts(step=6), 0.0) == [EncodeParams()]
    assert s2.params_skipped == 0


def test_a_mix_due_again_before_the_last_went_is_skipped() -> None:
    s = schedule()
    s.after_step(StepFacts(step=5, params_due=True, encoder_idle=False), 0.0)
    s.after_step(StepFacts(step=10, params_due=True, encoder_idle=False), 0.0)
    assert s.params_skipped == 1
    assert s.after_step(StepFacts(step=11), 0.0) == [EncodeParams()]
    assert s.after_step(StepFacts(step=12), 0.0) == []  # one mix, not two


def test_periodic_checkpoints_follow_the_interval_and_need_an_idle_encoder() -> None:
    s = schedule(interval_s=60.0, now=100.0)
    on = {"checkpointing": True}
    assert s.after_step(StepFacts(step=1, **on), 159.0) == []
    assert s.after_step(StepFacts(step=1, encoder_idle=False, **on), 160.0) == []
    assert s.after_step(StepFacts(step=1, **on), 160.0) == [HandState(checkpoint=True)]
    assert s.after_step(StepFacts(step=2, **on), 161.0) == []  # the interval restarts
    s.checkpointed(200.0)  # written elsewhere (SIGTERM, finish)
    assert s.after_step(StepFacts(step=3, **on), 221.0) == []
    assert s.after_step(StepFacts(step=3, **on), 260.0) == [HandState(checkpoint=True)]


def test_an_update_and_a_checkpoint_never_share_a_step() -> None:
    s = schedule(interval_s=1.0)
    facts = StepFacts(step=1, update_due=True, checkpointing=True)
    assert s.after_step(facts, 10.0) == [EncodeUpdate()]
    assert s.after_step(StepFacts(step=2, checkpointing=True), 10.0) == [HandState(True)]


def test_no_checkpoint_without_a_directory_or_an_interval() -> None:
    assert schedule(interval_s=1.0).after_step(StepFacts(step=1), 99.0) == []
    s = schedule(interval_s=0.0)
    assert s.after_step(StepFacts(step=1, checkpointing=True), 99.0) == []


def test_statistics_every_eighth_step_whatever_else_happens() -> None:
    s = schedule()
    steps = [n for n in range(1, 33) if ReportStats() in s.after_step(StepFacts(step=n), 0.0)]
    assert steps == [8, 16, 24, 32]
    busy = StepFacts(step=40, update_due=True, encoder_idle=False)
    assert s.after_step(busy, 0.0) == [ReportStats()]


def test_a_stall_is_excused_only_past_the_grace() -> None:
    assert not ReplicaSchedule.stalled(9.99, 10.0)
    assert not ReplicaSchedule.stalled(10.0, 10.0)
    assert ReplicaSchedule.stalled(10.01, 10.0)
