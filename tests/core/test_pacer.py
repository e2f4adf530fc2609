"""core.link.pacer: the token bucket that paces a link's bulk bytes."""

from __future__ import annotations

import math

import pytest

from ciuic_p2p.core.link.pacer import MIN_BURST_BYTES, MIN_RATE_BPS, Pacer


def test_unpaced_lets_everything_go() -> None:
    p = Pacer()
    assert p.rate_bps is None
    assert p.allowance(0.0) >= 1 << 40
    assert p.wait_s(10**9, 0.0) == 0.0


def test_a_rate_gives_one_burst_then_its_pace() -> None:
    p = Pacer(burst_s=0.005)
    p.set_rate(80e6, now=10.0)  # 10 MB/s: a burst of 50 kB
    assert p.allowance(10.0) == 50_000
    p.spend(50_000)
    assert p.allowance(10.0) == 0
    assert p.wait_s(20_000, 10.0) == pytest.approx(0.002)
    assert p.allowance(10.001) == pytest.approx(10_000, abs=1)
    assert p.allowance(20.0) == 50_000  # idle time refills the burst, no more
    # Over a second of sends the bytes that go are the rate's, plus one burst.
    sent, now = 0, 20.0
    p.spend(p.allowance(now))
    while now < 21.0:
        now += 0.0007
        n = p.allowance(now)
        p.spend(n)
        sent += n
    assert sent == pytest.approx(10_000_000, rel=0.01)


def test_slow_links_keep_a_least_burst_and_rate() -> None:
    p = Pacer()
    p.set_rate(1e3, now=0.0)  # a peer that claims 1 kbit/s
    assert p.rate_bps == MIN_RATE_BPS
    assert p.allowance(0.0) == MIN_BURST_BYTES


@pytest.mark.parametrize("bad", [0.0, -5.0, math.nan, math.inf, None])
def test_no_finite_positive_rate_means_no_pace(bad: float | None) -> None:
    p = Pacer()
    p.set_rate(8e6, 0.0)
    p.spend(p.allowance(0.0))
    p.set_rate(bad, 0.0)
    assert p.rate_bps is None
    assert p.allowance(0.0) >= 1 << 40


def test_a_new_rate_keeps_the_debt_and_a_clock_that_steps_back_adds_nothing() -> None:
    p = Pacer()
    p.set_rate(8e6, 5.0)  # 1 MB/s, burst 16 KiB (the least)
    p.spend(p.allowance(5.0) + 1000)  # 1000 bytes into debt
    p.set_rate(16e6, 5.0)
    assert p.allowance(5.0) == 0
    assert p.allowance(4.0) == 0
    assert p.wait_s(1000, 5.0) == pytest.approx(2000 * 8 / 16e6)
