from __future__ import annotations

import io
import json
import logging

import pytest

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
