"""The passive receive-rate estimate (core.link.throughput) on virtual time: frames cut
into datagram-sized pieces, arriving at a known pace, with idle gaps between them."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ciuic_p2p.core.link.throughput import MAX_RATE_BPS, MIN_SPAN_S, SAMPLES, ReceiveRate

PIECE = 1200


def deliver(
    est: ReceiveRate, sizes: list[int], rate_bps: float, start: float, gap_s: float = 0.0
) -> float:
    """Frames of ``sizes`` at ``rate_bps``, in pieces of ``PIECE`` bytes, as a stream
    delivers them: back to back (a piece may end one frame and begin the next) or, with
    ``gap_s``, each after that much silence; the time the last byte arrived."""
    bursts = [[s] for s in sizes] if gap_s else [sizes]
    now = start
    for i, burst in enumerate(bursts):
        if i:
            now += gap_s  # the sender idle: its next frame starts a new piece
        bounds, total = [], 0
        for s in burst:
            total += s
            bounds.append(total)
        sent = done = 0
        while sent < total:
            n = min(PIECE, total - sent)
            sent += n
            now += n * 8 / rate_bps
            completed = []
            while done < len(bounds) and bounds[done] <= sent:
                completed.append(bounds[done] - (bounds[done - 1] if done else 0))
                done += 1
            est.arrived(n, completed, sent - (bounds[done - 1] if done else 0), now)
    return now


def deliver_in_two_paces(
    est: ReceiveRate, size: int, first_bytes: int, first_bps: float, then_bps: float
) -> float:
    """One frame of ``size`` from time 0: its first ``first_bytes`` at ``first_bps``
    (slow start, or a link's own pace), the rest at ``then_bps`` (the link's rate, or
    a burst a busy loop delivered at once); the time the last byte arrived."""
    now, sent = 0.0, 0
    while sent < size:
        n = min(PIECE, size - sent)
        sent += n
        now += n * 8 / (first_bps if sent <= first_bytes else then_bps)
        est.arrived(n, [size] if sent == size else [], 0, now)
    return now


def test_the_pace_of_large_frames_is_the_estimate_and_idle_gaps_do_not_count() -> None:
    est = ReceiveRate(min_sample_bytes=64 * 1024)
    deliver(est, [256 * 1024] * 5, 10e6, start=0.0, gap_s=3.0)  # seconds of silence between
    assert est.rate_bps is not None
    assert abs(est.rate_bps - 10e6) / 10e6 < 0.01
    assert est.samples_taken == 5


def test_back_to_back_frames_that_share_a_piece_each_give_a_sample() -> None:
    est = ReceiveRate(min_sample_bytes=64 * 1024)
    deliver(est, [100_000, 150_001, 99_999, 120_000], 50e6, start=1.0)
    assert est.samples_taken == 4
    assert est.rate_bps is not None and abs(est.rate_bps - 50e6) / 50e6 < 0.02


def test_small_frames_and_frames_read_at_once_give_no_sample() -> None:
    est = ReceiveRate(min_sample_bytes=64 * 1024)
    deliver(est, [4096] * 50, 10e6, start=0.0, gap_s=0.1)  # chunks too small to pace
    assert est.rate_bps is None
    # A whole frame read in two pieces within the clock's resolution: not a pace.
    est.arrived(PIECE, [], 0, 5.0)
    est.arrived(200_000 - PIECE, [200_000], 0, 5.0 + MIN_SPAN_S / 2)
    assert est.rate_bps is None and est.samples_taken == 0


def test_the_capacity_shows_through_slow_frames_and_one_burst_is_left_out() -> None:
    """Most frames read low (sent in slow start, or beside other transfers), two at
    the link's rate: the estimate is the link's; one burst read at once is ignored."""
    est = ReceiveRate(min_sample_bytes=64 * 1024)
    t = deliver(est, [128 * 1024] * (SAMPLES - 3), 6e6, start=0.0, gap_s=1.0)
    t = deliver(est, [128 * 1024] * 2, 20e6, start=t + 1, gap_s=1.0)
    deliver(est, [128 * 1024], 2e9, start=t + 1)  # queued in the socket, read at once
    assert est.rate_bps is not None and abs(est.rate_bps - 20e6) / 20e6 < 0.01


def test_a_frame_that_arrives_in_slow_start_reads_at_the_rate_it_reached() -> None:
    """The first frame on an idle link comes slowly, then at the path's rate (QUIC's
    slow start): the estimate is the rate reached, not the frame's average (a pacer
    at a multiple of the average would hold the link below what it just carried)."""
    est = ReceiveRate(min_sample_bytes=64 * 1024)
    size = 1 << 20
    now = deliver_in_two_paces(est, size, 200_000, 2e6, 20e6)
    average = (size - PIECE) * 8 / now
    assert average < 8e6
    assert est.rate_bps is not None and abs(est.rate_bps - 20e6) / 20e6 < 0.01
    assert est.samples_taken == 1


def test_a_frame_under_twice_the_ramp_is_timed_whole() -> None:
    est = ReceiveRate(min_sample_bytes=64 * 1024, ramp_bytes=256 * 1024)
    deliver(est, [400 * 1024], 10e6, start=0.0, gap_s=1.0)
    assert est.samples_taken == 1
    assert est.rate_bps is not None and abs(est.rate_bps - 10e6) / 10e6 < 0.01


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 1 << 20),
            st.lists(st.integers(0, 1 << 24), max_size=3),
            st.integers(0, 1 << 24),
            st.floats(-1e3, 1e3, allow_nan=False),
        ),
        max_size=40,
    )
)
def test_no_sequence_of_arrivals_raises_or_gives_an_impossible_rate(
    steps: list[tuple[int, list[int], int, float]],
) -> None:
    """Whatever the session hands it (clocks that jump back, sizes that disagree), the
    estimate is None or a rate in (0, MAX_RATE_BPS]."""
    est = ReceiveRate(min_sample_bytes=1)
    for nbytes, completed, left, now in steps:
        est.arrived(nbytes, completed, left, now)
        rate = est.rate_bps
        assert rate is None or 0 < rate <= MAX_RATE_BPS


def test_a_frame_whose_tail_came_in_one_burst_gives_no_sample() -> None:
    """A busy loop delays an emulated link's deliveries, then makes them at once: the
    tail of a 1 MiB frame read 14x the pace of the whole. Such a tail is no rate."""
    est = ReceiveRate(min_sample_bytes=64 * 1024)
    deliver_in_two_paces(est, 1 << 20, 300 * 1024, 3.7e6, 1e9)
    assert est.rate_bps is None and est.samples_taken == 0
    assert est.bursts_left_out == 1


def test_a_frame_timed_whole_whose_last_part_came_in_one_burst_gives_no_sample() -> None:
    """A 256 KiB rate probe (timed whole: under twice the ramp) whose last 60% the
    busy loop delivered at once (it read 2.6x the link) reads no rate; one that came
    steadily does."""
    est = ReceiveRate(min_sample_bytes=64 * 1024)
    now = deliver_in_two_paces(est, 256 * 1024, 100 * 1024, 3.6e6, 1e9)
    assert est.rate_bps is None and est.bursts_left_out == 1
    deliver(est, [256 * 1024], 3.6e6, start=now + 1.0)
    assert est.rate_bps is not None and abs(est.rate_bps - 3.6e6) / 3.6e6 < 0.01


def test_a_small_frame_in_slow_start_still_gives_a_sample() -> None:
    """The guard leaves honest slow start alone: a 256 KiB frame whose first quarter
    came at a fifth of the rate the rest came at is a sample (of its whole pace)."""
    est = ReceiveRate(min_sample_bytes=64 * 1024)
    deliver_in_two_paces(est, 256 * 1024, 64 * 1024, 2e6, 10e6)
    assert est.samples_taken == 1 and est.bursts_left_out == 0
