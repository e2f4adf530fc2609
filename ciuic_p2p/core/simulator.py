"""Nodes on a virtual clock with in-memory delivery: hours of protocol time in seconds.

Each node is a pure state machine in aioquic's style (:class:`Endpoint`): it receives
datagrams and timer calls with ``now``, and says what to send and when it next wants
the timer. :class:`VirtualNetwork` runs a discrete-event loop: it delivers datagrams
through the scenario's link models (core.scenario.EmulatedNetwork, the same models the
real-clock emulator uses) and jumps the clock straight to the next event. Everything is
seeded; the same scenario and nodes give the same run.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import Protocol

from ciuic_p2p.core.scenario import EmulatedNetwork, Scenario


class Endpoint(Protocol):
    def receive_datagram(self, src: str, data: bytes, now: float) -> None: ...
    def datagrams_to_send(self, now: float) -> list[tuple[str, bytes]]: ...
    def get_timer(self) -> float | None: ...
    def handle_timer(self, now: float) -> None: ...


@dataclass(slots=True)
class SimulationStats:
    events: int = 0
    sent: int = 0
    delivered: int = 0
    dropped: int = 0


class VirtualNetwork:
    def __init__(self, scenario: Scenario) -> None:
        self.network = EmulatedNetwork(scenario)
        self.now = 0.0
        self.endpoints: dict[str, Endpoint] = {}
        self._arrivals: list[tuple[float, int, str, str, bytes]] = []
        self._seq = itertools.count()
        self.stats = SimulationStats()

    def add(self, name: str, endpoint: Endpoint) -> None:
        if name not in self.network.scenario.node_names():
            raise KeyError(f"{name} is not in the scenario")
        self.endpoints[name] = endpoint

    def remove(self, name: str) -> None:
        """A node stops (crashes): it neither sends nor receives any more."""
        self.endpoints.pop(name, None)

    def _flush(self, name: str) -> None:
        endpoint = self.endpoints.get(name)
        if endpoint is None:
            return
        for dst, data in endpoint.datagrams_to_send(self.now):
            self.stats.sent += 1
            arrivals = self.network.transmit(name, dst, self.now, len(data))
            if not arrivals:
                self.stats.dropped += 1
            for at in arrivals:
                heapq.heappush(self._arrivals, (at, next(self._seq), name, dst, data))

    def run_until(self, end: float, max_events: int = 50_000_000) -> None:
        """Advance virtual time to ``end``, processing every event before it."""
        for name in list(self.endpoints):
            self._flush(name)
        while self.stats.events < max_events:
            timer_at, timer_node = None, None
            for name, endpoint in self.endpoints.items():
                t = endpoint.get_timer()
                if t is not None and (timer_at is None or t < timer_at):
                    timer_at, timer_node = t, name
            arrival_at = self._arrivals[0][0] if self._arrivals else None
            change_at = self.network.next_change_at()
            candidates = [t for t in (timer_at, arrival_at, change_at) if t is not None]
            if not candidates or min(candidates) > end:
                break
            self.stats.events += 1
            if arrival_at is not None and arrival_at == min(candidates):
                at, _, src, dst, data = heapq.heappop(self._arrivals)
                self.now = max(self.now, at)
                receiver = self.endpoints.get(dst)
                if receiver is not None:
                    self.stats.delivered += 1
                    receiver.receive_datagram(src, data, self.now)
                    self._flush(dst)
            elif timer_at is not None and timer_at == min(candidates):
                assert timer_node is not None
                self.now = max(self.now, timer_at)
                self.endpoints[timer_node].handle_timer(self.now)
                self._flush(timer_node)
            else:
                assert change_at is not None
                self.now = max(self.now, change_at)
                self.network.advance(self.now)
        else:
            raise RuntimeError(f"simulation stopped after {max_events} events (runaway?)")
        self.now = max(self.now, end)
