"""bench/copytrace.py's count of second copies: which came over the link that had
carried the first, and which of those were sent while the first was on its way."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _copytrace() -> ModuleType:
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("copytrace", BENCH / "copytrace.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_second_copies_are_told_apart_by_link_and_by_when_they_were_sent() -> None:
    ct = _copytrace()
    events = [
        # b gets a's chunk 1 from a twice: the second sent before the first arrived.
        ("S", 0.0, "a", "b", "a", 1, 0, 0),
        ("S", 1.0, "a", "b", "a", 1, 255, 0),
        ("R", 2.0, "b", "a", "a", 1, 0, 0),
        ("R", 3.0, "b", "a", "a", 1, 255, 0),
        # c gets it from a, then a repair from b: a duplicate over another link.
        ("S", 0.0, "a", "c", "a", 1, 0, 0),
        ("R", 1.5, "c", "a", "a", 1, 0, 0),
        ("S", 2.0, "b", "c", "a", 1, 255, 0),
        ("R", 2.5, "c", "b", "a", 1, 255, 0),
        # d gets it twice from a, the second sent after the first had come.
        ("S", 0.0, "a", "d", "a", 1, 0, 0),
        ("R", 1.0, "d", "a", "a", 1, 0, 0),
        ("S", 4.0, "a", "d", "a", 1, 255, 0),
        ("R", 5.0, "d", "a", "a", 1, 255, 0),
        # round 1: its last delivery came by repair.
        ("S", 10.0, "a", "b", "a", 2, 0, 1),
        ("R", 14.0, "b", "a", "a", 2, 255, 1),
    ]
    got = ct.analyse(events)
    assert got["deliveries"] == 4 and got["duplicate_arrivals"] == 3
    assert got["same_link_duplicates"] == 2
    assert got["same_link_duplicates_sent_in_flight"] == 1
    assert got["rounds"] == [
        {"round": 0, "end_s": 2.0, "p95_s": 1.5, "last_by": "tree"},
        {"round": 1, "end_s": 4.0, "p95_s": 4.0, "last_by": "repair"},
    ]
