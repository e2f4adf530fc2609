"""The daemon's events as a live feed: what ``ciuic-node monitor`` follows.

Every structlog event the process logs at ``info`` or above (membership changes,
trainers attaching and leaving, the store's puts and refusals, reloads, the leave)
reaches each open :class:`EventFeed` through logsetup's tap, whatever ``log.level``
says and before the journal's rate limit. A feed is bounded: a reader that falls
behind loses the oldest events, counted, and never blocks the daemon nor grows its
memory past ``max_queued`` events. The tap is the process's: a process that runs
several daemons (the lab's meshes) feeds each subscriber the events of all of them.
"""

from __future__ import annotations

import asyncio
import collections
import datetime as dt
import math
import threading
from typing import Any

from ciuic_p2p.logsetup import add_tap, remove_tap

MAX_QUEUED_EVENTS = 1024
"""Events one feed holds for its reader; past it the oldest go (and are counted)."""
MAX_FIELD_CHARS = 2048
"""An event's field longer than this is cut (one event stays one short line)."""


class EventFeed:
    """One subscriber's bounded queue of events; a context manager (subscribed while
    inside)."""

    def __init__(self, max_queued: int = MAX_QUEUED_EVENTS) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.get_ident()
        self._queue: collections.deque[dict[str, Any]] = collections.deque(maxlen=max_queued)
        self._wake = asyncio.Event()
        self.dropped = 0
        """Events lost because the reader fell behind, in all."""
        self._dropped_told = 0

    def __enter__(self) -> EventFeed:
        add_tap(self._heard)
        return self

    def __exit__(self, *_: object) -> None:
        remove_tap(self._heard)

    def _heard(self, event: dict[str, Any]) -> None:
        # The tap runs on the thread that logged: only the loop's thread touches the queue.
        if threading.get_ident() == self._thread:
            self._push(event)
        elif not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._push, event)

    def _push(self, event: dict[str, Any]) -> None:
        if len(self._queue) == self._queue.maxlen:
            self.dropped += 1  # the deque lets the oldest go
        self._queue.append(_shown(event))
        self._wake.set()

    async def take(self) -> tuple[list[dict[str, Any]], int]:
        """The events queued now (waits for one), and how many were lost since the last
        call."""
        while not self._queue:
            self._wake.clear()
            await self._wake.wait()
        events = list(self._queue)
        self._queue.clear()
        lost, self._dropped_told = self.dropped - self._dropped_told, self.dropped
        return events, lost


def _shown(event: dict[str, Any]) -> dict[str, Any]:
    """An event as a JSON object: when, level, name, logger, then its fields as JSON
    values (anything else as its text)."""
    out: dict[str, Any] = {
        "at": dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds"),
        "level": event.get("level", "info"),
        "event": str(event.get("event", "")),
        "logger": str(event.get("logger_name") or event.get("logger") or ""),
    }
    for key, value in event.items():
        if key in ("event", "level", "logger", "logger_name") or key.startswith("_"):
            continue
        out[str(key)] = _value(value)
    return out


def _value(value: object) -> object:
    if value is None or isinstance(value, bool | int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)  # JSON has no NaN
    if isinstance(value, list | tuple | set | frozenset):
        return [_value(v) for v in list(value)[:64]]
    if isinstance(value, dict):
        return {str(k)[:256]: _value(v) for k, v in list(value.items())[:64]}
    return str(value)[:MAX_FIELD_CHARS]
