"""Logging set-up with structlog, shared by the daemon, the CLI and the benchmarks.

Under systemd (``JOURNAL_STREAM`` set) or whenever stderr is not a terminal, each event
is one JSON object per line, which journald, Loki or jq read as is; in a terminal the
output is structlog's readable console form. Standard-library loggers (aioquic logs
through ``logging``) are routed through the same renderer.
"""

from __future__ import annotations

import logging
import os
import sys
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


def configure_logging(section: LogSection | None = None, stream: TextIO | None = None) -> None:
    """Configure structlog and the ``logging`` root once for this process."""
    section = section or LogSection()
    out = stream if stream is not None else sys.stderr
    level = _LEVELS[section.level]
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: Any
    if wants_json(section.format, out):
        renderer = structlog.processors.JSONRenderer()
        shared.append(structlog.processors.format_exc_info)
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=False)

    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
    )
    handler = logging.StreamHandler(out)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # aioquic logs every connection's handshake steps at INFO under "quic": at info
    # level that would drown the node's own events.
    logging.getLogger("quic").setLevel(max(level, logging.WARNING))

    structlog.configure(
        processors=[
            *shared,
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.make_filtering_bound_logger(level),
        cache_logger_on_first_use=False,
    )


def get_logger(name: str, **context: Any) -> Any:
    """A structlog logger named ``name`` with initial context (peer, stream, step...).
    Lazy: it follows the configuration in force when it logs, not when it was made."""
    return structlog.get_logger(name, logger_name=name, **context)
