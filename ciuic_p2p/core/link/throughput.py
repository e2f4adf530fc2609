"""The rate a peer's bytes reach this node, measured passively from the bulk frames the
link already carries. Pure: the session feeds it its bulk lane's arrivals with ``now``.

A bulk frame (a chunk, a store piece) is written whole by its sender, so while it is
arriving the sender is not waiting for the application: the pace of its bytes is the
path's (its bottleneck, its congestion window), as in packet-train dispersion. One
sample per frame of at least ``min_sample_bytes``: the bytes after the frame's first
piece over the time from that piece to the last. The first piece is left out because
its bytes may have queued in this node's socket while it was busy. Time between
frames (the sender idle) is never counted, so an idle link does not read slow.

A frame of at least twice ``ramp_bytes`` is timed from where its first ``ramp_bytes``
end: the first frame of a transfer on an idle link arrives in QUIC's slow start, and
its average is the ramp's, far below the rate it reached (a 1 MiB frame that came at
2 Mbit/s for 200 kB, then at 20, averages 7.4). The links' pacer (core.link.pacer)
paces at a multiple of this estimate, and a paced link reads no faster than its pace,
so an estimate held down by the ramp holds the next rounds down with it: in
bench/strategy.py the first paced 2.1 MB round took 33-63 s where the unpaced one
before it took 22-24 s.

The estimate is the second highest of the last ``SAMPLES`` samples: what the link
carries when nothing else holds a frame back, as BBR's bottleneck estimate is a
maximum. A frame sent while QUIC's window still grows (the first on a link idle for a
while: slow start), or one that shared the path with others, reads low, and these are
common: the median of a run of 2 MB rounds over an emulated 20 Mbit/s, 140 ms path
read 8-16 Mbit/s. One burst that a busy event loop reads at once (a short time, too
high a rate) is left out as the highest.
"""

from __future__ import annotations

from collections import deque

SAMPLES = 9
MIN_SPAN_S = 0.002
"""A frame that arrived faster than this gives no sample: the time is the clock's and
the event loop's resolution, not the path's."""
RAMP_BYTES = 256 * 1024
"""The head of a large frame left out of its sample (a few round trips of slow start on
the paths the pacer serves)."""
MAX_RATE_FOLD = 4.0
"""A frame timed from where its ramp ends, or the last quarter of one timed whole,
reads at most this many times the pace of the whole frame (from its first piece), or
the frame gives no sample. Slow start on a long path
makes the tail outrun the whole by 2-3.5x (1 MiB at 20 Mbit/s over 220 ms: 1.1 s of
ramp, then 0.3 s); a burst reads far more: where several daemons and the WAN emulator
share one event loop, a busy loop delays the emulator's deliveries and then makes them
at once, and the tail of a 1 MiB frame over a 3.7 Mbit/s emulated link read 56 Mbit/s
(bench/strategy.py, the 11-city matrix) while the whole frame read near 4."""
MARK_BYTES = 32 * 1024
"""A frame's arrival time is noted each time this many more of its bytes came..."""
MAX_MARKS = 16
"""...up to here (512 KiB: a larger frame is timed after its ramp)."""
MAX_RATE_BPS = 1e12
"""Above any link: a sample beyond it is a clock artefact, not a measurement."""


class ReceiveRate:
    """One link's receive rate (see the module docstring)."""

    def __init__(self, min_sample_bytes: int = 64 * 1024, ramp_bytes: int = RAMP_BYTES) -> None:
        self.min_sample_bytes = max(1, min_sample_bytes)
        self.ramp_bytes = max(1, ramp_bytes)
        self._samples: deque[float] = deque(maxlen=SAMPLES)
        self._started_at: float | None = None
        """When the first piece of the frame now arriving came (None: between frames)."""
        self._first_piece = 0
        self._seen = 0
        """Bytes of the frame now arriving so far."""
        self._ramp_end: tuple[float, int] | None = None
        """When its first ``ramp_bytes`` had come, and how many bytes had by then."""
        self._marks: list[tuple[int, float]] = []
        """(bytes seen, when) as the frame passed 32 KiB, 64 KiB, 96 KiB...: where
        its last quarter began, for a frame timed whole."""
        self.samples_taken = 0
        self.bursts_left_out = 0
        """Frames whose tail read too fast against the whole (``MAX_RATE_FOLD``)."""

    def arrived(self, nbytes: int, completed: list[int], left_over: int, now: float) -> None:
        """``nbytes`` arrived at ``now``; they ended frames of the sizes in
        ``completed`` (header included, in order) and left ``left_over`` bytes of the
        next frame buffered."""
        if nbytes <= 0:
            return
        if not completed:
            if self._started_at is None:  # these bytes begin a frame
                self._begin(nbytes, now)
                return
            self._seen += nbytes
            if self._ramp_end is None and self._seen >= self.ramp_bytes:
                self._ramp_end = (now, self._seen)
            if len(self._marks) < MAX_MARKS and self._seen >= MARK_BYTES * (len(self._marks) + 1):
                self._marks.append((self._seen, now))
            return
        if self._started_at is not None:  # the frame that began in an earlier piece
            size = completed[0]
            ramp = self._ramp_end
            whole = (size - self._first_piece, now - self._started_at)
            if ramp is not None and size - ramp[1] >= self.ramp_bytes:
                tail = (size - ramp[1], now - ramp[0])
                self._sample_unless_burst(tail, whole, tail)
            elif size >= self.min_sample_bytes:
                # Its last quarter (from the last mark at or under three quarters of
                # it) must not outrun the whole either.
                head = [m for m in self._marks if m[0] <= 3 * size // 4]
                tail = (size - head[-1][0], now - head[-1][1]) if head else whole
                self._sample_unless_burst(tail, whole, whole)
        # Any other frame ended in this same piece (no time to measure); what is left
        # over is the first piece of the next.
        if left_over > 0:
            self._begin(left_over, now)
        else:
            self._started_at = None

    def _begin(self, first_piece: int, now: float) -> None:
        self._started_at, self._first_piece = now, first_piece
        self._seen, self._ramp_end = first_piece, None
        self._marks.clear()

    def _sample_unless_burst(
        self, tail: tuple[int, float], whole: tuple[int, float], sample: tuple[int, float]
    ) -> None:
        """``sample`` (bytes, seconds), unless the frame's ``tail`` read more than
        ``MAX_RATE_FOLD`` times the pace of the ``whole``."""
        (tail_bytes, tail_s), (whole_bytes, whole_s) = tail, whole
        if tail_s * whole_bytes * MAX_RATE_FOLD < whole_s * tail_bytes:
            self.bursts_left_out += 1
            return
        self._sample(*sample)

    def _sample(self, nbytes: int, span_s: float) -> None:
        if nbytes <= 0 or span_s < MIN_SPAN_S:
            return
        rate_bps = nbytes * 8 / span_s
        if rate_bps > MAX_RATE_BPS:
            return
        self._samples.append(rate_bps)
        self.samples_taken += 1

    @property
    def rate_bps(self) -> float | None:
        """The estimate, or None before the first sample."""
        if not self._samples:
            return None
        ranked = sorted(self._samples)
        return ranked[-2] if len(ranked) > 1 else ranked[-1]
