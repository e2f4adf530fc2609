"""Callbacks that must outlive whatever they are handed.

Everything that reaches a node from the network (a datagram, a timer of a
connection a stranger opened, a frame from a member, a line on a local socket) is
handled in a callback of the event loop. Our own code answers every bad input with a
typed error (``ciuic_p2p.errors``) on purpose; a library can still raise anything
(aioquic raised ``IndexError`` for a datagram of a QUIC version it does not speak),
and an exception that escapes a loop callback is only logged by asyncio, while one
that escapes a task ends the task: a receive loop that died would leave the node
deaf. So every such callback runs through :meth:`Guard.call`, which catches
``Exception`` (never ``BaseException``: Ctrl+C and cancellation pass), counts it by
where it happened (``internal_errors`` on /metrics and in ``status``), keeps the last
one for tests, and logs it rate-limited. The node exits only by decision.

:func:`install_loop_handler` does the same for whatever asyncio itself reports
("exception in callback", "Task exception was never retrieved").
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

from ciuic_p2p.logsetup import get_logger

P = ParamSpec("P")
T = TypeVar("T")

log = get_logger("ciuic.guard")


class Guard:
    """Counts and survives exceptions of one component's callbacks."""

    def __init__(self, component: str) -> None:
        self.component = component
        self.counts: collections.Counter[str] = collections.Counter()
        """Exceptions caught, by where (``datagram``, ``timer``, ``frame``...)."""
        self.last: BaseException | None = None
        """The newest exception caught (tests and the fuzz target re-raise it)."""

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def call(self, where: str, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T | None:
        """``fn(*args)``, or None when it raised (counted and logged)."""
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            self.record(where, exc)
            return None

    def record(self, where: str, exc: BaseException) -> None:
        self.counts[where] += 1
        self.last = exc
        # Keyed by where and the exception's type: a flood of one fault is one line a
        # minute (logsetup's limiter), a new fault is seen at once.
        log.error(
            "internal_error",
            component=self.component,
            where=where,
            error_type=type(exc).__name__,
            error=repr(exc)[:300],
        )


def install_loop_handler(loop: asyncio.AbstractEventLoop, guard: Guard) -> None:
    """Route what asyncio reports to ``guard`` instead of its default handler."""

    def handler(_loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if not isinstance(exc, BaseException):
            exc = RuntimeError(str(context.get("message", "asyncio reported an error")))
        guard.record("loop", exc)

    loop.set_exception_handler(handler)
