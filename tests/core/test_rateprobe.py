"""The rate-probe schedule: which link gets filler, when, and how often (pure)."""

from __future__ import annotations

import itertools

from ciuic_p2p.core.link.rateprobe import MAX_BACKOFF, RateProbes

MBIT = 1e6


def probes(below: float = 0.5) -> RateProbes:
    return RateProbes(probe_bytes=1 << 20, interval_s=60.0, below=below, ceiling_bps=10 * MBIT)


def test_no_probe_bytes_no_probes() -> None:
    p = RateProbes(probe_bytes=0, interval_s=60.0, below=0.5, ceiling_bps=10 * MBIT)
    assert p.choose(0.0, {"b": None}, ["b"], idle=True) is None


def test_an_unmeasured_link_is_probed_once_per_interval_and_only_when_ready() -> None:
    p = probes()
    assert p.choose(0.0, {"b": None}, [], idle=True) is None  # bulk waits for it
    probe = p.choose(0.0, {"b": None}, ["b"], idle=False)  # its own queue is enough
    assert probe is not None and (probe.peer, probe.reason) == ("b", "unmeasured")
    assert probe.nbytes == 1 << 20
    assert p.choose(59.0, {"b": None}, ["b"], idle=True) is None
    again = p.choose(60.0, {"b": None}, ["b"], idle=True)
    assert again is not None and again.peer == "b"
    assert p.sent == {"unmeasured": 2, "low": 0}


def test_one_link_a_turn_in_a_fixed_order() -> None:
    p = probes()
    published: dict[str, float | None] = {"c": None, "b": None}
    first = p.choose(0.0, published, ["b", "c"], idle=True)
    second = p.choose(0.0, published, ["b", "c"], idle=True)
    assert first is not None and second is not None
    assert [first.peer, second.peer] == ["b", "c"]
    assert p.choose(0.0, published, ["b", "c"], idle=True) is None


def test_a_link_reading_far_below_the_best_is_probed_only_while_the_node_is_idle() -> None:
    p = probes()
    published: dict[str, float | None] = {
        "b": 9 * MBIT,
        "c": 2 * MBIT,
        "d": 6 * MBIT,
        "e": 8 * MBIT,
    }
    assert p.choose(0.0, published, ["b", "c", "d", "e"], idle=False) is None
    probe = p.choose(0.0, published, ["b", "c", "d", "e"], idle=True)
    assert probe is not None and (probe.peer, probe.reason) == ("c", "low")
    # The rest read above half the second best (4 Mbit/s): none is probed.
    assert p.choose(0.0, published, ["b", "c", "d", "e"], idle=True) is None


def test_one_member_claiming_a_fast_link_does_not_draw_probes_down_every_other() -> None:
    p = probes()
    published: dict[str, float | None] = {"liar": 10 * MBIT, "c": 3 * MBIT, "d": 3 * MBIT}
    assert p.choose(0.0, published, ["liar", "c", "d"], idle=True) is None


def test_the_yardstick_never_reads_above_the_ceiling() -> None:
    """A reading of 80 Mbit/s on a node told its links carry at most 10 (one burst the
    event loop read at once) does not make every honest link look slow."""
    p = probes()
    published: dict[str, float | None] = {"b": 80 * MBIT, "x": 70 * MBIT, "c": 6 * MBIT}
    assert p.choose(0.0, published, ["b", "x", "c"], idle=True) is None


def test_a_link_that_stays_slow_is_probed_ever_less_often_up_to_a_bound() -> None:
    p = probes()
    published: dict[str, float | None] = {"a": 9 * MBIT, "b": 9 * MBIT, "c": 1 * MBIT}
    sent_at = []
    for t in range(0, 60 * 40, 10):
        if p.choose(float(t), published, ["a", "b", "c"], idle=True) is not None:
            sent_at.append(t)
    gaps = [b - a for a, b in itertools.pairwise(sent_at)]
    assert gaps[:4] == [60, 120, 240, 480]
    assert max(gaps) == 60 * MAX_BACKOFF


def test_a_link_that_reads_well_again_starts_over() -> None:
    p = probes()
    low: dict[str, float | None] = {"a": 9 * MBIT, "b": 9 * MBIT, "c": 1 * MBIT}
    well: dict[str, float | None] = {"a": 9 * MBIT, "b": 9 * MBIT, "c": 8 * MBIT}
    ready = ["a", "b", "c"]
    assert p.choose(0.0, low, ready, idle=True) is not None
    assert p.choose(60.0, low, ready, idle=True) is not None  # backoff now 2
    assert p.choose(100.0, well, ready, idle=True) is None
    # Slow again later: one interval after its last probe, not two.
    assert p.choose(120.0, low, ready, idle=True) is not None


def test_a_probed_link_is_unpaced_for_a_bounded_while() -> None:
    p = probes()
    probe = p.choose(0.0, {"b": None}, ["b"], idle=True)
    assert probe is not None
    # 1 MiB twice over at the 10 Mbit/s ceiling, plus a second.
    assert probe.unpaced_until == (2 * (1 << 20) * 8 / (10 * MBIT)) + 1.0
    assert p.unpaced("b", 1.0) and not p.unpaced("c", 1.0)
    assert not p.unpaced("b", probe.unpaced_until)
    assert not p.unpaced("b", 0.5)  # once over, it stays over


def test_a_peer_that_leaves_and_rejoins_keeps_its_wait() -> None:
    p = probes()
    assert p.choose(0.0, {"b": None}, ["b"], idle=True) is not None
    assert p.choose(1.0, {}, [], idle=True) is None
    assert not p.unpaced("b", 1.0)  # gone: its pace is none of our business now
    assert p.choose(2.0, {"b": None}, ["b"], idle=True) is None  # back within 60 s
    assert p.choose(60.0, {"b": None}, ["b"], idle=True) is not None
    # Forgotten once its longest wait is over: the table does not grow.
    p.choose(60.0 + 60 * MAX_BACKOFF, {}, [], idle=True)
    assert p.choose(60.0 + 60 * MAX_BACKOFF, {"b": None}, ["b"], idle=True) is not None


def test_a_busy_moment_does_not_reset_a_slow_links_wait() -> None:
    p = probes()
    low: dict[str, float | None] = {"a": 9 * MBIT, "b": 9 * MBIT, "c": 1 * MBIT}
    ready = ["a", "b", "c"]
    sent_at = []
    for t in range(0, 60 * 20, 10):
        busy = t % 100 == 50  # one busy moment in ten
        if p.choose(float(t), low, ready, idle=not busy) is not None:
            sent_at.append(t)
    assert [b - a for a, b in itertools.pairwise(sent_at)][:3] == [60, 120, 240]


def test_a_link_that_stays_unmeasured_is_probed_ever_less_often() -> None:
    """A peer that never publishes what it measured draws a bounded trickle."""
    p = probes()
    sent_at = [t for t in range(0, 60 * 30, 10) if p.choose(float(t), {"b": None}, ["b"], True)]
    assert [b - a for a, b in itertools.pairwise(sent_at)][:4] == [60, 120, 240, 480]


def test_a_slow_links_probe_keeps_it_unpaced_long_enough_to_cross() -> None:
    p = probes()
    probe = p.choose(0.0, {"a": 9 * MBIT, "b": 9 * MBIT, "c": 4 * MBIT}, ["c"], idle=True)
    assert probe is not None and probe.peer == "c"
    # 1 MiB twice over at its 4 Mbit/s reading, plus a second; never above 10 s.
    assert probe.unpaced_until == 2 * (1 << 20) * 8 / (4 * MBIT) + 1.0
    crawl = probes().choose(0.0, {"a": 9 * MBIT, "b": 9 * MBIT, "c": 0.1 * MBIT}, ["c"], True)
    assert crawl is not None and crawl.unpaced_until == 10.0
