"""An asyncio event loop on virtual time: when nothing is ready, the clock jumps to
the next timer instead of sleeping. Daemons on the in-memory transport run minutes of
protocol time in a fraction of a second, and a test that would wait forever fails at
once (nothing ready, nothing scheduled) instead of hanging.

    run_virtual(main(), limit_s=600)     # main() sees loop.time() advance; no sleeps

Real file descriptors (a socket pair to a stand-in trainer) still work: each turn
polls them without blocking before time moves.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class VirtualClock:
    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


class _Selector(selectors.DefaultSelector):
    """Polls the real descriptors; when none is ready, moves the clock on by the
    loop's timeout (the time to its next timer) instead of waiting for it."""

    def __init__(self, clock: VirtualClock) -> None:
        super().__init__()
        self.clock = clock
        self.idle_turns = 0

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = super().select(0)
        if ready or timeout == 0:
            self.idle_turns = 0
            return ready
        if timeout is None:
            # Nothing scheduled and nothing ready: give real descriptors (a thread
            # writing to the self-pipe) a moment, then call it a deadlock.
            self.idle_turns += 1
            if self.idle_turns > 200:
                raise RuntimeError("virtual-time loop idle: nothing ready, nothing scheduled")
            return super().select(0.005)
        self.idle_turns = 0
        self.clock.now += timeout
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self, clock: VirtualClock | None = None) -> None:
        self.clock = clock or VirtualClock()
        super().__init__(selector=_Selector(self.clock))

    def time(self) -> float:
        return self.clock.now


def run_virtual(coro: Coroutine[Any, Any, T], limit_s: float = 3600.0) -> T:
    """Run ``coro`` to completion on a fresh virtual-time loop; fails past ``limit_s``
    of virtual time."""
    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(asyncio.wait_for(coro, limit_s))
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
