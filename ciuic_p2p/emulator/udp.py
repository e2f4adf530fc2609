"""Emulated links between a node and its UDP socket, on the real clock.

:class:`EmulatedDatagramTransport` wraps the asyncio datagram transport a node sends
through: each ``sendto`` asks the scenario's link model (sender node → the node that
owns the destination address) when the datagram's copies arrive, and hands each copy
to the real socket at that time. Receiving is untouched, so the node's code (QUIC
included) runs unchanged; only the sending side of each directed link is shaped,
which is where netem shapes too.

Timers: asyncio's selector rounds timeouts up to whole milliseconds (and uvloop keeps
time in milliseconds), so a timer fires late: by about 1 ms on average on a busy loop
here (the 55 pairs of the 11-city scenario: RTT error +1.3 ms mean with no lead), by
less on an idle one (a fixed 1 ms lead made a lone 10 ms link read 8.7-9.0 ms).
Releases are therefore scheduled early by a :class:`TimerLead` that follows the
measured lateness; the calibration test and bench/emulator.py measure what remains.

Order: datagrams wait in one heap per sending node, keyed by arrival time (then by
send order), behind one timer for the earliest; each firing releases every datagram
that is due. A timer per datagram let two datagrams of a link swap places whenever
the lead moved between their sends or millisecond rounding put them in one tick, and
QUIC takes a datagram overtaken by three others as lost: on a 330 ms path with no
loss at all, aioquic halved its window every few seconds and one link carried under
1 MB/s of the 12.5 it was given.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

from ciuic_p2p.emulator.model.scenario import EmulatedNetwork

Address = tuple[str, int]
TIMER_LEAD_S = 0.001


class TimerLead:
    """How early to schedule releases so that they happen on time on average.

    asyncio timers fire late by an amount that depends on the machine and on how busy
    the loop is (about 1 ms on a busy 11-node loop here, less when idle). Every release
    reports how late it was against its intended time, and the lead follows the mean
    lateness (an exponential moving average, clamped to [0, 3] ms). One instance is
    shared by every node of a mesh, since they share the loop."""

    def __init__(self, initial_s: float = TIMER_LEAD_S) -> None:
        self.lead_s = initial_s

    def observe(self, late_s: float) -> None:
        self.lead_s = min(0.003, max(0.0, self.lead_s + 0.05 * late_s))


class EmulatedDatagramTransport(asyncio.DatagramTransport):
    def __init__(
        self,
        inner: asyncio.DatagramTransport,
        network: EmulatedNetwork,
        node: str,
        address_book: Mapping[Address, str],
        start: float,
        clock: Callable[[], float] = time.monotonic,
        lead: TimerLead | None = None,
    ) -> None:
        super().__init__()
        self.inner = inner
        self.network = network
        self.node = node
        self.address_book = address_book
        self.start = start
        self.clock = clock
        self.lead = lead or TimerLead()
        self.passed_through = 0
        self._due: list[tuple[float, int, bytes, Any]] = []
        """(arrival, send order, payload, address): a heap, earliest first."""
        self._order = itertools.count()
        self._timer: asyncio.Handle | None = None
        self._timer_for = math.inf
        """The arrival time the pending timer was set for."""

    def sendto(self, data: Any, addr: Any = None) -> None:
        dst = self.address_book.get((addr[0], addr[1])) if addr is not None else None
        if dst is None or dst == self.node:
            self.passed_through += 1
            self.inner.sendto(data, addr)
            return
        now = self.clock() - self.start
        payload = bytes(data)
        for arrival in self.network.transmit(self.node, dst, now, len(payload)):
            heapq.heappush(self._due, (arrival, next(self._order), payload, addr))
        self._arm(now)

    def _arm(self, now: float) -> None:
        """Set the timer for the earliest waiting datagram, unless it is set already
        for that time or earlier."""
        if not self._due:
            return
        head = self._due[0][0]
        if self._timer is not None:
            if self._timer_for <= head:
                return
            self._timer.cancel()
        self._timer_for = head
        wait = head - now - self.lead.lead_s
        loop = asyncio.get_running_loop()
        if wait > 0:
            self._timer = loop.call_later(wait, self._release)
        else:
            self._timer = loop.call_soon(self._release)

    def _release(self) -> None:
        self._timer, self._timer_for = None, math.inf
        now = self.clock() - self.start
        horizon = now + self.lead.lead_s
        closing = self.inner.is_closing()
        while self._due and self._due[0][0] <= horizon:
            arrival, _, data, addr = heapq.heappop(self._due)
            self.lead.observe(now - arrival)
            if not closing:
                self.inner.sendto(data, addr)
        self._arm(now)

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self.inner.get_extra_info(name, default)

    def is_closing(self) -> bool:
        return self.inner.is_closing()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._due.clear()
        self.inner.close()

    def abort(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._due.clear()
        self.inner.abort()
