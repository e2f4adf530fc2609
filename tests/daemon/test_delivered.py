"""The resume point a daemon saves when it stops (daemon.delivered): taken once, and
a file that is not what the daemon writes (a disk that lied, an edit, a copy from
another version) is ignored as if there were none, never trusted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ciuic_p2p.core.mesh.broadcast import MAX_ABOVE
from ciuic_p2p.daemon.delivered import FILE, save_delivered, take_delivered

NOW = 1_800_000_000.0


def test_what_was_saved_is_taken_once(tmp_path: Path) -> None:
    origins = {"ciuicaaaa": (5, (7, 9)), "ciuicbbbb": ((3 << 40) + 12, ())}
    assert save_delivered(tmp_path, origins, NOW)
    assert take_delivered(tmp_path, NOW + 5, 120) == origins
    assert not (tmp_path / FILE).exists()
    assert take_delivered(tmp_path, NOW + 6, 120) == {}  # one start resumes, not two


def test_a_resume_point_older_than_what_the_origins_keep_is_not_used(tmp_path: Path) -> None:
    save_delivered(tmp_path, {"ciuicaaaa": (5, ())}, NOW)
    assert take_delivered(tmp_path, NOW + 121, 120) == {}
    save_delivered(tmp_path, {"ciuicaaaa": (5, ())}, NOW)
    assert take_delivered(tmp_path, NOW - 60, 120) == {}  # from the future: a clock jump


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"\xff\xfe",
        b"[]",
        b'{"version": 2, "saved_at": 1800000000, "origins": {}}',
        b'{"version": 1, "saved_at": 1800000000, "origins": []}',
        b'{"version": 1, "saved_at": 1800000000, "origins": {"a": [1]}}',
        b'{"version": 1, "saved_at": 1800000000, "origins": {"a": [-1, []]}}',
        b'{"version": 1, "saved_at": 1800000000, "origins": {"a": [true, []]}}',
        b'{"version": 1, "saved_at": 1800000000, "origins": {"a": [1e300, []]}}',
        b'{"version": 1, "saved_at": 1800000000, "origins": {"a": [99999999999999999999, []]}}',
        b'{"version": 1, "saved_at": 1800000000, "origins": {"a": [5, [5]]}}',
        b'{"version": 1, "saved_at": 1800000000, "origins": {"a": [5, "6"]}}',
        b'{"version": 1, "saved_at": 1800000000, "origins": {"": [5, []]}}',
        b'{"version": 1, "saved_at": "now", "origins": {"a": [5, []]}}',
        json.dumps(
            {"version": 1, "saved_at": NOW, "origins": {"a": [0, list(range(1, MAX_ABOVE + 2))]}}
        ).encode(),
        json.dumps({"version": 1, "saved_at": NOW, "origins": {"x" * 129: [1, []]}}).encode(),
    ],
)
def test_a_file_not_as_the_daemon_writes_it_is_ignored(tmp_path: Path, body: bytes) -> None:
    (tmp_path / FILE).write_bytes(body)
    assert take_delivered(tmp_path, NOW + 1, 120) == {}
    assert not (tmp_path / FILE).exists()


def test_a_disk_that_refuses_the_write_stops_nothing(tmp_path: Path) -> None:
    missing = tmp_path / "not-a-dir"
    missing.write_text("")
    assert not save_delivered(missing, {"a": (1, ())}, NOW)
