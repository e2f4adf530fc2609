"""docs/reference/ is what docs/generate_reference.py makes from the code now: a new
flag, setting, metric or stats key without its regenerated page fails here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ciuic_p2p.train.stats import STATS_DOC, SyncStats

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.processes
def test_the_reference_pages_are_current() -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "docs" / "generate_reference.py"), "--check"],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_stats_key_is_documented() -> None:
    assert list(STATS_DOC) == list(SyncStats.__annotations__)
    assert all(text.strip() for text in STATS_DOC.values())


def test_the_stats_types_read_as_written() -> None:
    """Under ``from __future__ import annotations`` a TypedDict holds its field types
    as ``ForwardRef`` objects, whose repr is no type a reader knows."""
    api = (REPO / "docs" / "reference" / "api.md").read_text(encoding="utf-8")
    assert "ForwardRef" not in api
    assert "| `step` | `int` |" in api and "| `restored` | `dict[str, Any]` |" in api
