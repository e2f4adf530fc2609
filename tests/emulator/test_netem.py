from __future__ import annotations

import itertools
import math
import statistics

import pytest

from ciuic_p2p.emulator.model.netem import LinkModel, LinkParams


def run(
    params: LinkParams, n: int = 20_000, seed: int = 1, gap_s: float = 0.001
) -> list[list[float]]:
    link = LinkModel(params, seed)
    return [link.transmit(i * gap_s, 1000) for i in range(n)]


def within_binomial(observed: int, n: int, p: float, sigmas: float = 5.0) -> bool:
    return abs(observed - n * p) <= sigmas * math.sqrt(n * p * (1 - p)) + 1


def test_plain_delay_is_exact() -> None:
    out = run(LinkParams(delay_s=0.05), n=10)
    assert all(a == [pytest.approx(i * 0.001 + 0.05)] for i, a in enumerate(out))


def test_random_loss_rate_matches() -> None:
    out = run(LinkParams(loss=0.05))
    assert within_binomial(sum(1 for a in out if not a), len(out), 0.05)


def test_gilbert_elliott_gives_bursts_of_the_configured_length() -> None:
    p, r = 0.01, 0.25
    out = run(LinkParams(ge_p=p, ge_r=r), n=200_000)
    lost = [not a for a in out]
    bursts, current = [], 0
    for x in lost:
        if x:
            current += 1
        elif current:
            bursts.append(current)
            current = 0
    stationary_bad = p / (p + r)
    assert abs(sum(lost) / len(lost) - stationary_bad) < 0.005
    assert abs(statistics.mean(bursts) - 1 / r) < 0.3  # mean burst length 1/r = 4


def test_duplicates_at_the_configured_rate() -> None:
    out = run(LinkParams(duplicate=0.02))
    assert within_binomial(sum(1 for a in out if len(a) == 2), len(out), 0.02)


@pytest.mark.parametrize(("dist", "std_factor"), [("uniform", 1 / math.sqrt(3)), ("normal", 1.0)])
def test_jitter_has_the_configured_spread(dist: str, std_factor: float) -> None:
    jitter = 0.02
    out = run(LinkParams(delay_s=0.1, jitter_s=jitter, jitter_dist=dist))  # type: ignore[arg-type]
    delays = [a[0] - i * 0.001 for i, a in enumerate(out)]
    assert abs(statistics.mean(delays) - 0.1) < 0.001
    assert abs(statistics.pstdev(delays) - jitter * std_factor) < 0.05 * jitter
    assert min(delays) >= 0.1 - (jitter if dist == "uniform" else 3 * jitter) - 1e-12


def test_jitter_reorders_unless_told_not_to() -> None:
    params = LinkParams(delay_s=0.1, jitter_s=0.02)
    reordered = run(params, n=2000)
    firsts = [a[0] for a in reordered]
    assert any(b < a for a, b in itertools.pairwise(firsts))
    in_order = [a[0] for a in run(params.with_changes(reorder=False), n=2000)]
    assert all(b >= a for a, b in itertools.pairwise(in_order))


def test_rate_limit_paces_a_bulk_transfer_at_the_rate() -> None:
    rate = 1_000_000.0  # 1 Mbit/s; 1000-byte datagrams offered at 8 Mbit/s
    link = LinkModel(LinkParams(delay_s=0.01, rate_bps=rate, queue_bytes=10_000_000), 3)
    arrivals = [link.transmit(i * 0.001, 1000)[0] for i in range(2000)]
    achieved = 2000 * 1000 * 8 / (arrivals[-1] - arrivals[0])
    assert abs(achieved - rate) / rate < 0.01


def test_full_queue_drops_the_tail() -> None:
    link = LinkModel(LinkParams(rate_bps=1_000_000.0, queue_bytes=10_000), 3)
    results = [link.transmit(0.0, 1000) for _ in range(50)]
    assert sum(1 for r in results if r) == 10 and link.counters.queue_drops == 40
    assert link.transmit(1.0, 1000), "the queue drains with time"


def test_down_link_drops_everything_and_up_restores() -> None:
    link = LinkModel(LinkParams(delay_s=0.01, up=False), 1)
    assert all(not link.transmit(i, 100) for i in range(100))
    link.set_params(link.params.with_changes(up=True))
    assert link.transmit(200.0, 100) == [pytest.approx(200.01)]


def test_same_seed_same_sequence_other_seed_another() -> None:
    params = LinkParams(delay_s=0.05, jitter_s=0.01, loss=0.1, duplicate=0.05, ge_p=0.01, ge_r=0.3)
    assert run(params, n=3000, seed=7) == run(params, n=3000, seed=7)
    assert run(params, n=3000, seed=7) != run(params, n=3000, seed=8)


@pytest.mark.parametrize(
    "bad", [{"loss": 1.5}, {"delay_s": -1.0}, {"rate_bps": 0.0}, {"jitter_dist": "x"}]
)
def test_invalid_parameters_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        LinkParams(**bad)  # type: ignore[arg-type]
