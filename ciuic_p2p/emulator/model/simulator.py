"""Nodes on a virtual clock with in-memory delivery: hours of protocol time in seconds.

Each node is a pure state machine in aioquic's style (:class:`Endpoint`): it receives
datagrams and timer calls with ``now``, and says what to send and when it next wants
the timer. :class:`VirtualNetwork` runs a discrete-event loop: it delivers datagrams
through the scenario's link models (emulator.model.scenario.EmulatedNetwork, the same models the
real-clock emulator uses) and jumps the clock straight to the next event. Everything is
seeded; the same scenario and nodes give the same run.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import Protocol

from ciuic_p2p.emulator.model.scenario import EmulatedNetwork, Scenario


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


class Network(Protocol):
    """What VirtualNetwork needs from a network model (emulator.model.scenario.EmulatedNetwork
    or a synthetic one for large simulations)."""

    def transmit(self, src: str, dst: str, now: float, size: int) -> list[float]: ...
    def next_change_at(self) -> float | None: ...
    def advance(self, now: float) -> None: ...


class VirtualNetwork:
    def __init__(self, scenario: Scenario | None = None, network: Network | None = None) -> None:
        if network is None:
            if scenario is None:
                raise ValueError("give a scenario or a network")
            network = EmulatedNetwork(scenario)
        self.network: Network = network
        self.names = set(scenario.node_names()) if scenario is not None else None
        self.now = 0.0
        self.endpoints: dict[str, Endpoint] = {}
        self._arrivals: list[tuple[float, int, str, str, bytes]] = []
        self._timers: list[tuple[float, int, str]] = []
        self._timer_of: dict[str, float | None] = {}
        self._seq = itertools.count()
        self.stats = SimulationStats()

    def add(self, name: str, endpoint: Endpoint) -> None:
        if self.names is not None and name not in self.names:
            raise KeyError(f"{name} is not in the scenario")
        self.endpoints[name] = endpoint
        self._timer_of[name] = None
        self._flush(name)

    def remove(self, name: str) -> None:
        """A node stops (crashes): it neither sends nor receives any more."""
        self.endpoints.pop(name, None)
        self._timer_of.pop(name, None)

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
        t = endpoint.get_timer()
        if t != self._timer_of.get(name):
            self._timer_of[name] = t
            if t is not None:
                heapq.heappush(self._timers, (t, next(self._seq), name))

    def _next_timer(self) -> tuple[float, str] | None:
        while self._timers:
            t, _, name = self._timers[0]
            if self._timer_of.get(name) == t and name in self.endpoints:
                return t, name
            heapq.heappop(self._timers)
        return None

    def run_until(self, end: float, max_events: int = 50_000_000) -> None:
        """Advance virtual time to ``end``, processing every event before it."""
        while self.stats.events < max_events:
            timer = self._next_timer()
            timer_at = timer[0] if timer is not None else None
            arrival_at = self._arrivals[0][0] if self._arrivals else None
            change_at = self.network.next_change_at()
            candidates = [t for t in (timer_at, arrival_at, change_at) if t is not None]
            if not candidates or min(candidates) > end:
                break
            first = min(candidates)
            self.stats.events += 1
            if arrival_at is not None and arrival_at == first:
                at, _, src, dst, data = heapq.heappop(self._arrivals)
                self.now = max(self.now, at)
                receiver = self.endpoints.get(dst)
                if receiver is not None:
                    self.stats.delivered += 1
                    receiver.receive_datagram(src, data, self.now)
                    self._flush(dst)
            elif timer is not None and timer_at == first:
                heapq.heappop(self._timers)
                name = timer[1]
                self._timer_of[name] = None
                self.now = max(self.now, first)
                self.endpoints[name].handle_timer(self.now)
                self._flush(name)
            else:
                self.now = max(self.now, first)
                self.network.advance(self.now)
        else:
            raise RuntimeError(f"simulation stopped after {max_events} events (runaway?)")
        self.now = max(self.now, end)

    def poke(self, name: str) -> None:
        """Collect what ``name`` wants to send after the caller drove it directly
        (a broadcast, a join)."""
        self._flush(name)
