"""Logging set-up with structlog, shared by the daemon, the CLI and the benchmarks.

Under systemd (``JOURNAL_STREAM`` set) or whenever stderr is not a terminal, each event
is one JSON object per line, which journald, Loki or jq read as is; in a terminal the
output is structlog's readable console form. Standard-library loggers (aioquic logs
through ``logging``) are routed through the same renderer.

Two processors guard every event, ours and the standard library's alike:

- no secret is ever written: a field whose name says it holds one (``private_key``,
  ``secret``, ``password``, ``token``...) is replaced by ``[redacted]``, and raw bytes
  are never dumped (``<32 bytes>``), since keys and signatures are bytes;
- a warning that repeats (same event, same peer or address) is written at most
  ``log.rate_limit_burst`` times per ``log.rate_limit_window_s``; the next one written
  after that says how many were suppressed. A peer that keeps failing must not flood
  the journal and hide everything else. An address is keyed by its host, not its
  port: a stranger that varies its source port is still one stranger.

Taps (:func:`add_tap`: daemon.events, for ``ciuic-node monitor``) hear every event
at ``info`` or above whatever ``log.level``: structlog filters at ``info`` at most and
a processor after the taps (:class:`LevelGate`) drops what the level leaves out.

Dropping never raises through the standard library: structlog's own events are
dropped with ``structlog.DropEvent``, which its loggers catch, but a standard-library
record (aioquic's, asyncio's "exception in callback") passes the limiter in a
``logging.Filter``. ``DropEvent`` is a ``BaseException`` that ``logging`` does not
catch; raised from a handler it once went out through asyncio's exception handler and
stopped the daemon after a handful of repeated errors.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import time
from collections.abc import Callable, MutableMapping
from typing import Any, TextIO

import structlog

from ciuic_p2p.config import LogSection

_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}


def wants_json(fmt: str, stream: TextIO) -> bool:
    """Decide the renderer for ``format = "auto"``: JSON unless a person is watching."""
    if fmt == "json":
        return True
    if fmt == "console":
        return False
    if os.environ.get("JOURNAL_STREAM"):
        return True
    isatty = getattr(stream, "isatty", None)
    return not (isatty is not None and isatty())


SECRET_FIELD = re.compile(r"(private|secret|password|passphrase|token|credential)", re.I)
REDACTED = "[redacted]"


def redact_secrets(_logger: Any, _method: str, event: MutableMapping[str, Any]) -> Any:
    for name, value in event.items():
        if name != "event" and SECRET_FIELD.search(name):
            event[name] = REDACTED
        elif isinstance(value, bytes | bytearray | memoryview):
            event[name] = f"<{len(value)} bytes>"
    return event


def _host(address: object) -> str:
    """``host`` of ``host:port`` / ``[v6]:port`` (the limiter's key): a port is free."""
    text = str(address)
    if text.startswith("["):
        return text[: text.find("]") + 1]
    return text.rsplit(":", 1)[0] if text.count(":") == 1 else text


class RateLimiter:
    """Drops repeats of a warning past ``burst`` per ``window_s`` (see the module
    docstring); keyed by logger, event, the peer or address it concerns (its host,
    or its ``network`` when the event names one) and, for internal errors, where and
    of which type."""

    def __init__(
        self, burst: int, window_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.burst = burst
        self.window_s = window_s
        self.clock = clock
        self._seen: dict[tuple[Any, ...], list[float | int]] = {}
        """key -> [window start, events in window, suppressed since last written]."""

    def admit(self, key: tuple[Any, ...]) -> tuple[bool, int]:
        """(write this one?, repeats suppressed before it that it should report)."""
        now = self.clock()
        entry = self._seen.get(key)
        if entry is None or now - entry[0] >= self.window_s:
            suppressed = int(entry[2]) if entry is not None else 0
            self._seen[key] = [now, 1, 0]
            if len(self._seen) > 4096:  # bounded: forget the oldest windows
                for old in sorted(self._seen, key=lambda k: self._seen[k][0])[:1024]:
                    del self._seen[old]
            return True, suppressed
        entry[1] += 1
        if entry[1] <= self.burst:
            return True, 0
        entry[2] += 1
        return False, 0

    def __call__(self, _logger: Any, method: str, event: MutableMapping[str, Any]) -> Any:
        """The structlog processor: raises ``structlog.DropEvent`` (caught by
        structlog's loggers) for a repeat past the burst."""
        if method not in ("warning", "warn", "error", "exception", "critical"):
            return event
        key = (
            event.get("logger_name") or event.get("logger"),
            str(event.get("event")),
            event.get("network") or _host(event.get("peer") or event.get("address") or ""),
            str(event.get("where", "")),
            str(event.get("error_type", "")),
        )
        write, suppressed = self.admit(key)
        if not write:
            raise structlog.DropEvent
        if suppressed:
            event["suppressed"] = suppressed
        return event


class PeerCloseFilter(logging.Filter):
    """qh3 warns "Native peer close: ..." whenever a peer closes its connection, a
    clean leave included, and with no name a reader can place; the transport logs
    every link it loses, with the peer and the reason. Its protocol errors pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Native peer close")


class StdlibRateFilter(logging.Filter):
    """The same limit for standard-library records (aioquic, asyncio), as a filter:
    it answers False instead of raising (see the module docstring). Records that
    structlog made have been through the limiter already."""

    def __init__(self, limiter: RateLimiter) -> None:
        super().__init__()
        self.limiter = limiter

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING or isinstance(record.msg, dict):
            return True
        write, suppressed = self.limiter.admit((record.name, str(record.msg), ""))
        if write and suppressed:
            record.suppressed = suppressed
        return write


EventTap = Callable[[dict[str, Any]], None]
_taps: list[EventTap] = []
"""Who hears every event logged in this process (daemon.events: ``ciuic-node monitor``)."""


def add_tap(tap: EventTap) -> None:
    """Hand ``tap`` a copy of every structlog event logged from now on at ``info`` or
    above, whatever ``log.level`` (and debug ones at level ``debug``), secrets redacted,
    before the rate limit. It is called on the thread that logs, and must not block
    nor log."""
    _taps.append(tap)


def remove_tap(tap: EventTap) -> None:
    with contextlib.suppress(ValueError):
        _taps.remove(tap)


def _tap(_logger: Any, method: str, event: MutableMapping[str, Any]) -> Any:
    if _taps:
        copy = {"level": "warning" if method == "warn" else method, **event}
        for tap in list(_taps):
            tap(copy)
    return event


class LevelGate:
    """Drops events below ``log.level``: structlog's own filter is set at ``info`` at
    most, so that the taps hear a node's membership changes at every level."""

    def __init__(self, level: int) -> None:
        self.level = level

    def __call__(self, _logger: Any, method: str, event: MutableMapping[str, Any]) -> Any:
        if _METHOD_LEVELS.get(method, logging.CRITICAL) < self.level:
            raise structlog.DropEvent
        return event


_METHOD_LEVELS = {**_LEVELS, "warn": logging.WARNING, "exception": logging.ERROR,
                  "critical": logging.CRITICAL}  # fmt: skip

_json_output = False
TRAINER_SCOPE = "ciuic"
"""The loggers a training process's set-up covers (every logger of this project)."""


def announce(logger: Any, event: str, text: str, **fields: Any) -> None:
    """A milestone a person starting the daemon wants to see (listening, joined):
    one plain line on stdout in a terminal, an ``info`` event when the output is JSON
    lines (journald and log shippers read every line as JSON)."""
    if _json_output:
        logger.info(event, **fields)
    else:
        print(f"ciuic-node: {text}", flush=True)


def configure_logging(
    section: LogSection | None = None, stream: TextIO | None = None, scope: str | None = None
) -> None:
    """Configure structlog and the ``logging`` root once for this process. ``scope``
    (a training process: "ciuic") puts the handler on that logger only, so that the
    application's own logging is left as it set it."""
    section = section or LogSection()
    out = stream if stream is not None else sys.stderr
    level = _LEVELS[section.level]
    limiter = RateLimiter(section.rate_limit_burst, section.rate_limit_window_s)
    # Standard-library records get the limit from a filter on the handler, never
    # from a processor that raises (see the module docstring).
    stamp = [
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    context = structlog.contextvars.merge_contextvars
    shared: list[Any] = [context, redact_secrets, _tap, LevelGate(level), limiter, *stamp]
    foreign: list[Any] = [
        context,
        structlog.stdlib.ExtraAdder(allow=["suppressed"]),
        redact_secrets,
        *stamp,
    ]
    renderer: Any
    global _json_output  # noqa: PLW0603 (one process-wide logging set-up)
    _json_output = wants_json(section.format, out)
    if _json_output:
        renderer = structlog.processors.JSONRenderer()
        shared.append(structlog.processors.format_exc_info)
        foreign.append(structlog.processors.format_exc_info)
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=False)

    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=foreign,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
    )
    handler = logging.StreamHandler(out)
    handler.setFormatter(formatter)
    handler.addFilter(StdlibRateFilter(limiter))
    root = logging.getLogger(scope)
    root.handlers[:] = [handler]
    root.setLevel(level)
    if scope is not None:
        root.propagate = False  # not twice, when the application logs to the root too
    else:  # the whole process now: a training set-up made before is undone
        scoped = logging.getLogger(TRAINER_SCOPE)
        scoped.handlers.clear()
        scoped.propagate = True
        scoped.setLevel(logging.NOTSET)
    # aioquic logs every connection's handshake steps at INFO under "quic": at info
    # level that would drown the node's own events.
    quic = logging.getLogger("quic")
    quic.setLevel(max(level, logging.WARNING))
    if not any(isinstance(f, PeerCloseFilter) for f in quic.filters):
        quic.addFilter(PeerCloseFilter())

    structlog.configure(
        processors=[
            *shared,
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.make_filtering_bound_logger(min(level, logging.INFO)),
        cache_logger_on_first_use=False,
    )


def configure_trainer_logging(section: LogSection) -> bool:
    """In a training process: the project's set-up (rate-limited; JSON when stderr is
    not a terminal) for the ``ciuic`` loggers, unless the application configured
    structlog itself (then its choice stands). Whether it configured."""
    if structlog.is_configured():
        return False
    configure_logging(section, scope=TRAINER_SCOPE)
    return True


def get_logger(name: str, **context: Any) -> Any:
    """A structlog logger named ``name`` with initial context (peer, stream, step...).
    Lazy: it follows the configuration in force when it logs, not when it was made."""
    return structlog.get_logger(name, logger_name=name, **context)
