from __future__ import annotations

import contextlib
import io
import json
import logging

import pytest
import structlog

from ciuic_p2p.config import LogSection
from ciuic_p2p.logsetup import configure_logging, get_logger, wants_json


def test_json_lines_when_output_is_not_a_terminal() -> None:
    out = io.StringIO()
    configure_logging(LogSection(format="auto"), stream=out)
    get_logger("test", peer="abc").info("chunk_sent", step=3)
    logging.getLogger("aioquic").warning("from stdlib")
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert lines[0]["event"] == "chunk_sent" and lines[0]["peer"] == "abc"
    assert lines[0]["step"] == 3 and lines[0]["level"] == "info" and "timestamp" in lines[0]
    assert lines[1]["event"] == "from stdlib" and lines[1]["level"] == "warning"


def test_console_format_and_level_filter() -> None:
    out = io.StringIO()
    configure_logging(LogSection(format="console", level="warning"), stream=out)
    log = get_logger("test")
    log.info("hidden")
    log.warning("shown", peer="p1")
    text = out.getvalue()
    assert "hidden" not in text and "shown" in text and "peer=p1" in text
    with pytest.raises(json.JSONDecodeError):
        json.loads(text.splitlines()[0])


def test_journald_means_json(monkeypatch: pytest.MonkeyPatch) -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.delenv("JOURNAL_STREAM", raising=False)
    assert not wants_json("auto", Tty())
    monkeypatch.setenv("JOURNAL_STREAM", "8:1234")
    assert wants_json("auto", Tty())


def test_no_secret_or_raw_bytes_reaches_the_log() -> None:
    from ciuic_p2p.identity import NodeKey  # noqa: PLC0415

    out = io.StringIO()
    configure_logging(LogSection(format="json"), stream=out)
    key = NodeKey.generate()
    pem = key.to_pem().decode()
    get_logger("test").warning(
        "loaded", private_key=pem, password="hunter2", sig=b"\x01" * 64, node_key=key
    )
    line = json.loads(out.getvalue().splitlines()[-1])
    assert line["private_key"] == "[redacted]" and line["password"] == "[redacted]"
    assert line["sig"] == "<64 bytes>"
    assert "hunter2" not in out.getvalue() and "PRIVATE KEY" not in out.getvalue()
    assert pem.splitlines()[1] not in out.getvalue()


def test_repeated_warnings_are_rate_limited_per_peer() -> None:
    from ciuic_p2p.logsetup import RateLimiter  # noqa: PLC0415

    now = [0.0]
    limiter = RateLimiter(burst=3, window_s=10.0, clock=lambda: now[0])
    written = []
    for i in range(20):
        now[0] = i * 0.1
        for peer in ("a", "b"):
            with contextlib.suppress(structlog.DropEvent):
                written.append(limiter(None, "warning", {"event": "refused", "peer": peer}))
    assert [e["peer"] for e in written] == ["a", "b"] * 3
    # Info passes untouched; after the window, the next warning says what was dropped.
    assert limiter(None, "info", {"event": "refused", "peer": "a"}) is not None
    now[0] = 20.0
    again = limiter(None, "warning", {"event": "refused", "peer": "a"})
    assert again["suppressed"] == 17


def test_context_bound_in_a_task_names_its_events_and_no_others() -> None:
    import asyncio  # noqa: PLC0415

    out = io.StringIO()
    configure_logging(LogSection(format="json"), stream=out)
    log = get_logger("test")

    async def session(n: int) -> None:
        structlog.contextvars.bind_contextvars(trainer_session=n)
        log.info("frame")

    async def main() -> None:
        await asyncio.gather(session(1), session(2))
        log.info("outside")

    asyncio.run(main())
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert sorted(e["trainer_session"] for e in lines if e["event"] == "frame") == [1, 2]
    assert "trainer_session" not in next(e for e in lines if e["event"] == "outside")


def test_a_peers_clean_close_is_not_a_warning_but_a_protocol_error_is() -> None:
    out = io.StringIO()
    configure_logging(LogSection(format="json"), stream=out)
    quic = logging.getLogger("quic")
    quic.warning("Native peer close: %r", ("peer_closed", True, 0, None, b"node shutting down"))
    quic.warning("Native protocol error: %r", ("protocol_error", 10))
    text = out.getvalue()
    assert "Native peer close" not in text
    assert "Native protocol error" in text
