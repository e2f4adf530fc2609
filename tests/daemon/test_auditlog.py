"""The audit log's files (daemon/auditlog.py) and ``ciuic-node audit verify``: rotation
keeps one chain, reopening continues it, a torn line is cut and recorded, a missing
file or an edited entry is named. Virtual time; no sleeps."""

from __future__ import annotations

import datetime as dt
import json
import os
import stat
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ciuic_p2p.admission import ClusterCA, write_pem
from ciuic_p2p.cli import main as cli_main
from ciuic_p2p.core.audit import AuditEntry, AuditError, digest, parse_entry
from ciuic_p2p.daemon.auditlog import AuditLog, public_key_from, verify_directory
from ciuic_p2p.identity import NodeKey

KEY = NodeKey(Ed25519PrivateKey.from_private_bytes(bytes(range(32))))


class Clock:
    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def open_log(directory: Path, clock: Clock, rotate_bytes: int = 1 << 20) -> AuditLog:
    return AuditLog(
        directory,
        KEY,
        peer_id=KEY.peer_id,
        interval_s=60.0,
        rotate_bytes=rotate_bytes,
        clock=clock,
    )


def entries(directory: Path) -> list[AuditEntry]:
    files = sorted(directory.glob("audit-*.jsonl"))
    return [parse_entry(line) for f in files for line in f.read_bytes().splitlines()]


def write_some(directory: Path, n: int, rotate_bytes: int = 1 << 20) -> AuditLog:
    clock = Clock()
    log = open_log(directory, clock, rotate_bytes)
    log.started()
    for i in range(n):
        clock.now += 1
        log.admitted(f"peer{i}", ("10.0.0.2", 7946))
    log.close()
    return log


def test_entries_record_what_happened_with_owner_only_files(tmp_path: Path) -> None:
    directory = tmp_path / "audit"
    clock = Clock()
    log = open_log(directory, clock)
    log.started()
    log.admitted("ciuicpeer", ("10.0.0.2", 7946))
    log.refused("10.0.0.3:7946", "certificate revoked")
    log.served_state("state/run1", 40, "ciuicpeer", 1234)
    log.checkpoint(tmp_path / "ckpt", 40, b"\x01" * 32)
    log.origin_set_aside("ciuicliar", 1040, "run1")
    log.stopped("SIGTERM")
    log.close()
    got = entries(directory)
    # The open sums go before "stopped": it is the last entry.
    assert [e.kind for e in got] == [
        "started", "admitted", "served_state", "checkpoint", "origin_set_aside", "refusals",
        "stopped",
    ]  # fmt: skip
    assert got[4].data == {"origin": "ciuicliar", "until_step": 1040, "run": "run1"}
    del got[4]
    assert got[0].data["public_key"] == KEY.public_key.hex()
    assert got[1].data == {"peer": "ciuicpeer", "address": "10.0.0.2:7946"}
    assert got[2].data == {"name": "state/run1", "version": 40, "to": "ciuicpeer", "bytes": 1234}
    assert got[3].data["digest"] == "01" * 32
    assert got[4].data["total"] == 1 and got[4].data["networks"] == {"10.0.0.0/24": 1}
    assert got[4].data["reasons"] == {"certificate revoked": 1}
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert stat.S_IMODE((directory / "audit-000001.jsonl").stat().st_mode) == 0o600
    report = verify_directory(directory, KEY.public_key)
    assert report.ok and report.last_seq == log.last_seq == 7 and report.head == log.head


def test_traffic_is_one_entry_per_interval_not_per_chunk(tmp_path: Path) -> None:
    clock = Clock(1000.0)
    log = open_log(tmp_path, clock)
    origin = NodeKey(Ed25519PrivateKey.from_private_bytes(bytes(32)))
    for _ in range(50):
        log.received(origin.public_key, 1000)
        log.forwarded(origin.public_key, 1000)
        clock.now += 1  # 50 s: still inside the first 60 s interval
    log.tick()
    assert entries(tmp_path) == []
    clock.now = 1060.0
    log.tick()
    log.received("ciuicother", 5)  # the next interval, written on close
    log.close()
    traffic = [e.data for e in entries(tmp_path)]
    assert len(traffic) == 2
    assert traffic[0]["received"] == {origin.peer_id: {"chunks": 50, "bytes": 50_000}}
    assert traffic[0]["forwarded"] == {origin.peer_id: {"chunks": 50, "bytes": 50_000}}
    assert (traffic[0]["from"], traffic[0]["to"]) == (1000.0, 1060.0)
    assert traffic[1]["received"] == {"ciuicother": {"chunks": 1, "bytes": 5}}


def test_rotation_keeps_one_chain_across_files(tmp_path: Path) -> None:
    log = write_some(tmp_path, 30, rotate_bytes=1000)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) >= 5 and files[0] == "audit-000001.jsonl"
    got = entries(tmp_path)
    assert [e.seq for e in got] == list(range(1, 32))
    second = parse_entry((tmp_path / "audit-000002.jsonl").read_bytes().splitlines()[0])
    last_of_first = (tmp_path / "audit-000001.jsonl").read_bytes().splitlines()[-1]
    assert second.prev == digest(last_of_first)
    report = verify_directory(tmp_path, KEY.public_key)
    assert report.ok and report.files == len(files) and report.head == log.head


def test_deleted_middle_file_is_named(tmp_path: Path) -> None:
    write_some(tmp_path, 30, rotate_bytes=1000)
    (tmp_path / "audit-000003.jsonl").unlink()
    report = verify_directory(tmp_path, KEY.public_key)
    assert report.broken is not None
    assert (report.broken.file, report.broken.line) == ("audit-000004.jsonl", 1)
    assert "audit-000003.jsonl missing" in report.broken.reason
    (tmp_path / "audit-000001.jsonl").unlink()
    report = verify_directory(tmp_path, KEY.public_key)
    assert report.broken is not None and "audit-000001.jsonl missing" in report.broken.reason


def test_reopening_continues_the_chain(tmp_path: Path) -> None:
    first = write_some(tmp_path, 3)
    clock = Clock(1_800_000_000.0)
    log = open_log(tmp_path, clock)
    assert (log.last_seq, log.head) == (first.last_seq, first.head)
    log.started()
    log.close()
    assert [e.seq for e in entries(tmp_path)] == [1, 2, 3, 4, 5]
    assert verify_directory(tmp_path, KEY.public_key).ok


def test_reopening_a_full_file_starts_the_next(tmp_path: Path) -> None:
    write_some(tmp_path, 1, rotate_bytes=1 << 20)
    log = open_log(tmp_path, Clock(), rotate_bytes=100)  # the file is already past it
    log.started()
    log.close()
    assert len(list(tmp_path.iterdir())) == 2
    assert verify_directory(tmp_path, KEY.public_key).ok


def test_torn_last_line_is_cut_and_recorded(tmp_path: Path) -> None:
    write_some(tmp_path, 3)
    path = tmp_path / "audit-000001.jsonl"
    whole = path.stat().st_size
    with path.open("ab") as f:
        f.write(b'{"data":{"peer":"half')
    report = verify_directory(tmp_path, KEY.public_key)
    assert report.broken is not None and report.broken.line == 5
    assert "torn write" in report.broken.reason
    log = open_log(tmp_path, Clock())
    log.close()
    repaired = entries(tmp_path)[-1]
    assert repaired.kind == "repaired" and repaired.seq == 5
    assert repaired.data["offset"] == whole and repaired.data["dropped_bytes"] == 21
    assert repaired.data["dropped_blake2b"] == digest(b'{"data":{"peer":"half')
    assert verify_directory(tmp_path, KEY.public_key).ok


def test_torn_first_line_of_a_new_file_resumes_from_the_file_before(tmp_path: Path) -> None:
    write_some(tmp_path, 2)
    (tmp_path / "audit-000002.jsonl").write_bytes(b'{"da')
    log = open_log(tmp_path, Clock())
    log.close()
    assert [e.seq for e in entries(tmp_path)] == [1, 2, 3, 4]
    assert verify_directory(tmp_path, KEY.public_key).ok


def test_a_damaged_last_entry_stops_the_log_from_opening(tmp_path: Path) -> None:
    write_some(tmp_path, 2)
    with (tmp_path / "audit-000001.jsonl").open("ab") as f:
        f.write(b"garbage\n")
    with pytest.raises(AuditError, match="cannot be continued"):
        open_log(tmp_path, Clock())


def test_a_second_writer_is_refused(tmp_path: Path) -> None:
    log = open_log(tmp_path, Clock())
    with pytest.raises(AuditError, match="another process"):
        open_log(tmp_path, Clock())
    log.close()
    open_log(tmp_path, Clock()).close()


def test_a_closed_log_refuses_entries(tmp_path: Path) -> None:
    log = write_some(tmp_path, 1)
    log.close()  # twice is fine
    with pytest.raises(AuditError, match="closed"):
        log.admitted("late", "10.0.0.9:1")


def test_public_key_from_key_file_certificate_or_hex(tmp_path: Path) -> None:
    KEY.save(tmp_path / "node.key")
    ca = ClusterCA.create("test", dt.datetime.now(dt.UTC))
    write_pem(tmp_path / "node.pem", ca.issue(KEY.public_key, dt.datetime.now(dt.UTC)))
    assert public_key_from(tmp_path / "node.key") == KEY.public_key
    assert public_key_from(str(tmp_path / "node.pem")) == KEY.public_key
    assert public_key_from(KEY.public_key.hex()) == KEY.public_key
    (tmp_path / "junk").write_text("hello")
    for bad in (str(tmp_path / "junk"), "abcd", str(tmp_path / "absent")):
        with pytest.raises(AuditError):
            public_key_from(bad)


# --- ciuic-node audit verify ------------------------------------------------------------


def audit(*argv: str) -> int:
    return cli_main(["audit", *argv])


def test_cli_verify_intact_log_prints_ok_and_exits_0(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ca = ClusterCA.create("test", dt.datetime.now(dt.UTC))
    write_pem(tmp_path / "node.pem", ca.issue(KEY.public_key, dt.datetime.now(dt.UTC)))
    log = write_some(tmp_path / "audit", 30, rotate_bytes=1000)
    assert audit("verify", str(tmp_path / "audit")) == 0  # key from DIR/../node.pem
    out = capsys.readouterr().out
    assert out.startswith("ok: 31 entries in ") and out.endswith(f"seq 1..31, head {log.head}\n")
    assert audit("verify", str(tmp_path / "audit"), "--key", KEY.public_key.hex(), "--json") == 0
    assert json.loads(capsys.readouterr().out)["last_seq"] == 31


def test_cli_verify_edited_log_names_the_line_and_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_some(tmp_path, 30, rotate_bytes=1000)
    path = tmp_path / "audit-000002.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    seq = parse_entry(lines[1]).seq
    lines[1] = lines[1].replace(b"10.0.0.2:7946", b"10.6.6.6:7946")
    path.write_bytes(b"".join(lines))
    assert audit("verify", str(tmp_path), "--key", KEY.public_key.hex()) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"BROKEN at audit-000002.jsonl:2: entry {seq} was edited")
    assert out.count("\n") == 1


def test_cli_user_errors_exit_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert audit("verify", str(tmp_path / "absent"), "--key", KEY.public_key.hex()) == 2
    assert audit("verify", str(tmp_path)) == 2  # no --key and no ../node.pem
    assert audit("verify", str(tmp_path), "--key", "zz") == 2
    assert audit("verify", str(tmp_path), "--key", KEY.public_key.hex()) == 2  # no files
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 4 and all(e.startswith("ciuic-node: error: ") for e in err)
    assert "Traceback" not in "".join(err)
    assert os.listdir(tmp_path) == []
