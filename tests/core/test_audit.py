"""The audit chain and its checker (core.audit): every kind of tampering is found and
located; bad lines raise AuditFormatError only; traffic is summed per interval."""

from __future__ import annotations

import contextlib
import itertools
import json
from collections.abc import Callable

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given
from hypothesis import strategies as st

from ciuic_p2p.core.audit import (
    MAX_LINE_BYTES,
    MAX_ORIGINS_PER_ENTRY,
    SIG_CONTEXT,
    ZERO_DIGEST,
    AuditChain,
    AuditError,
    AuditFormatError,
    TrafficTally,
    VerifyReport,
    digest,
    encode,
    parse_entry,
    verify,
)
from ciuic_p2p.identity import NodeKey, verify_signature

KEY = NodeKey(Ed25519PrivateKey.from_private_bytes(bytes(range(32))))
OTHER = NodeKey(Ed25519PrivateKey.from_private_bytes(bytes(range(1, 33))))
Lines = list[tuple[str, int, str]]


def checker(key: NodeKey = KEY) -> Callable[[bytes, bytes], bool]:
    return lambda message, sig: verify_signature(key.public_key, sig, message)


def make_chain(n: int, key: NodeKey = KEY) -> list[str]:
    chain = AuditChain(key.peer_id, key.sign)
    return [
        chain.entry("admitted", {"peer": f"p{i}", "address": "10.0.0.1:7946"}, 100.0 + i)
        for i in range(n)
    ]


def located(lines: list[str], per_file: int = 0) -> Lines:
    """(file, line number, text); ``per_file`` > 0 spreads them over several files."""
    out = []
    for i, text in enumerate(lines):
        f, n = (i // per_file + 1, i % per_file + 1) if per_file else (1, i + 1)
        out.append((f"audit-{f:06d}.jsonl", n, text))
    return out


def check(lines: list[str], key: NodeKey = KEY) -> VerifyReport:
    return verify(located(lines), checker(key))


def resigned(line: str, key: NodeKey, **changes: object) -> str:
    """The entry with ``changes``, canonically encoded and signed by ``key``."""
    obj = json.loads(line)
    obj.update(changes)
    del obj["sig"]
    obj["sig"] = key.sign(SIG_CONTEXT + encode(obj)).hex()
    return encode(obj).decode()


def test_chain_links_each_entry_to_the_previous_line() -> None:
    lines = make_chain(4)
    entries = [parse_entry(t) for t in lines]
    assert [e.seq for e in entries] == [1, 2, 3, 4]
    assert entries[0].prev == ZERO_DIGEST
    for before, after in itertools.pairwise(entries):
        assert after.prev == digest(before.line)
    report = check(lines)
    assert report.ok and report.entries == 4
    assert (report.first_seq, report.last_seq, report.head) == (1, 4, digest(lines[-1]))
    assert report.summary() == f"ok: 4 entries in 1 file, seq 1..4, head {digest(lines[-1])}"


def test_lines_are_canonical_json() -> None:
    line = make_chain(1)[0]
    obj = json.loads(line)
    assert line == json.dumps(obj, sort_keys=True, separators=(",", ":"))
    assert obj["v"] == 1 and obj["node"] == KEY.peer_id and obj["kind"] == "admitted"


def test_resume_continues_the_chain_after_the_last_line() -> None:
    first = make_chain(3)
    chain = AuditChain(KEY.peer_id, KEY.sign)
    chain.resume(first[-1])
    assert (chain.next_seq, chain.head) == (4, digest(first[-1]))
    more = [chain.entry("stopped", {"reason": "test"}, 200.0)]
    assert check(first + more).ok


def test_a_draft_that_is_not_committed_leaves_no_gap() -> None:
    chain = AuditChain(KEY.peer_id, KEY.sign)
    chain.draft("admitted", {"peer": "lost"}, 1.0)  # never stored
    line = chain.entry("admitted", {"peer": "kept"}, 2.0)
    assert parse_entry(line).seq == 1


def test_oversize_entry_is_refused_and_the_chain_does_not_move() -> None:
    chain = AuditChain(KEY.peer_id, KEY.sign)
    with pytest.raises(AuditFormatError, match="over the limit"):
        chain.entry("refused", {"reason": "x" * MAX_LINE_BYTES}, 1.0)
    with pytest.raises(AuditFormatError):
        chain.entry("refused", {"score": float("nan")}, 1.0)
    assert chain.next_seq == 1


def test_edited_entry_is_found_by_its_signature() -> None:
    lines = make_chain(6)
    obj = json.loads(lines[3])
    obj["data"]["peer"] = "mallory"
    lines[3] = encode(obj).decode()  # canonical, but not re-signed
    report = check(lines)
    assert report.broken is not None
    assert (report.broken.line, report.last_seq) == (4, 3)
    assert "entry 4 was edited" in report.broken.reason and "bad signature" in report.broken.reason
    assert report.summary().startswith("BROKEN at audit-000001.jsonl:4: entry 4 was edited")


def test_entry_signed_by_another_key_is_a_forgery() -> None:
    lines = make_chain(5)
    lines[2] = resigned(lines[2], OTHER, data={"peer": "mallory"})
    report = check(lines)
    assert report.broken is not None and report.broken.line == 3
    assert "bad signature" in report.broken.reason
    # The same chain, written whole by the other key, is not this node's either.
    assert check(make_chain(2, OTHER)).broken is not None


def test_deleted_entry_leaves_a_gap() -> None:
    lines = make_chain(6)
    del lines[2]
    report = check(lines)
    assert report.broken is not None and report.broken.line == 3
    assert "entry 3 is missing before entry 4" in report.broken.reason
    assert report.last_seq == 2


def test_deleted_first_entries_are_found() -> None:
    report = check(make_chain(5)[2:])
    assert report.broken is not None and report.broken.line == 1
    assert "entries 1..2 are missing" in report.broken.reason


def test_inserted_copy_of_an_old_entry_is_out_of_order() -> None:
    lines = make_chain(5)
    lines.insert(4, lines[1])
    report = check(lines)
    assert report.broken is not None and report.broken.line == 5
    assert "entry 2 comes after entry 4" in report.broken.reason


def test_inserted_new_entry_cannot_be_signed() -> None:
    lines = make_chain(5)
    fake = resigned(lines[2], OTHER, data={"peer": "mallory"})
    lines.insert(3, fake)
    report = check(lines)
    assert report.broken is not None and report.broken.line == 4
    assert "bad signature" in report.broken.reason


def test_reordered_entries_are_found() -> None:
    lines = make_chain(6)
    lines[2], lines[3] = lines[3], lines[2]
    report = check(lines)
    assert report.broken is not None and report.broken.line == 3
    assert "entry 3 is missing before entry 4" in report.broken.reason


def test_entry_from_another_chain_of_the_same_key_does_not_follow() -> None:
    lines = make_chain(5)
    # Same key, same seq, valid signature, but it chains to a different history.
    lines[2] = resigned(lines[2], KEY, prev="ab" * 32)
    report = check(lines)
    assert report.broken is not None and report.broken.line == 3
    assert "does not follow entry 2" in report.broken.reason


def test_missing_middle_file_breaks_at_the_next_file() -> None:
    located_lines = located(make_chain(9), per_file=3)
    without_second = [x for x in located_lines if x[0] != "audit-000002.jsonl"]
    report = verify(without_second, checker())
    assert report.broken is not None
    assert (report.broken.file, report.broken.line) == ("audit-000003.jsonl", 1)
    assert "entries 4..6 are missing" in report.broken.reason
    assert verify(located_lines, checker()).files == 3


def test_cut_tail_verifies_and_shows_in_last_seq_and_head() -> None:
    lines = make_chain(6)
    report = check(lines[:4])  # not detectable from the chain itself (see verify)
    assert report.ok and report.last_seq == 4 and report.head == digest(lines[3])


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("", "empty"),
        ("not json", "not JSON"),
        ("[1, 2]", "not a JSON object"),
        ('{"v":1}', "wrong fields"),
        ("{" * 40_000, "not JSON"),
        ("x" * (MAX_LINE_BYTES + 1), "over the"),
        (b"\xff\xfe{}", "not JSON"),
        ("\ud800", "UTF-8"),
    ],
)
def test_bad_lines_raise_a_format_error(text: str | bytes, match: str) -> None:
    with pytest.raises(AuditFormatError, match=match):
        parse_entry(text)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda o: o.update(v=2), "unsupported version"),
        (lambda o: o.update(seq=0), "seq"),
        (lambda o: o.update(seq=True), "seq"),
        (lambda o: o.update(prev="AB" * 32), "prev"),
        (lambda o: o.update(time="noon"), "time"),
        (lambda o: o.update(node=""), "node"),
        (lambda o: o.update(kind=7), "kind"),
        (lambda o: o.update(data=[]), "data"),
        (lambda o: o.update(sig="00"), "sig"),
        (lambda o: o.update(extra=1), "unexpected"),
    ],
)
def test_wrong_fields_raise_a_format_error(
    change: Callable[[dict[str, object]], None], match: str
) -> None:
    obj = json.loads(make_chain(1)[0])
    change(obj)
    with pytest.raises(AuditFormatError, match=match):
        parse_entry(encode(obj))


def test_non_canonical_spellings_are_refused() -> None:
    line = make_chain(1)[0]
    obj = json.loads(line)
    for variant in (
        json.dumps(obj, sort_keys=True),  # spaces
        json.dumps(dict(reversed(obj.items())), separators=(",", ":")),  # key order
        line.replace('"time":100.0', '"time":1.0e2'),
        line[:-1] + ',"v":1}',  # duplicate key
        line.replace('"time":100.0', '"time":NaN'),
    ):
        with pytest.raises(AuditFormatError):
            parse_entry(variant)
    assert parse_entry(line + "\n").line == line.encode()


def test_a_bad_line_in_the_chain_is_a_located_break_not_a_crash() -> None:
    lines = make_chain(4)
    lines[1] = "{garbage"
    report = check(lines)
    assert report.broken is not None and report.broken.line == 2
    assert report.broken.reason.startswith("not a valid audit entry: not JSON")


@given(st.binary(max_size=512))
def test_random_bytes_are_a_format_error_or_an_entry(data: bytes) -> None:
    with contextlib.suppress(AuditFormatError):
        parse_entry(data)


CHAIN = make_chain(5)


@given(st.integers(0, 4), st.integers(0, 10_000), st.integers(1, 255))
def test_any_changed_byte_in_any_entry_breaks_the_chain(line: int, pos: int, xor: int) -> None:
    raw = bytearray(CHAIN[line].encode())
    raw[pos % len(raw)] ^= xor
    lines: list[tuple[str, int, bytes | str]] = [("a", i + 1, t) for i, t in enumerate(CHAIN)]
    lines[line] = ("a", line + 1, bytes(raw))
    report = verify(lines, checker())
    assert report.broken is not None and report.broken.line == line + 1
    assert report.entries == line


def test_chain_refuses_a_bad_node_name_and_a_bad_signer() -> None:
    with pytest.raises(AuditError):
        AuditChain("", KEY.sign)
    with pytest.raises(AuditError, match="signer"):
        AuditChain(KEY.peer_id, lambda _m: b"short").entry("x", {}, 1.0)


# --- traffic tally ---------------------------------------------------------------------


def test_tally_sums_per_origin_and_direction_over_an_interval() -> None:
    tally = TrafficTally(interval_s=60.0, now=1000.0)
    for _ in range(3):
        tally.add("received", "alice", 100)
    tally.add("forwarded", "alice", 100)
    tally.add("received", "bob", 7)
    assert not tally.due(1059.9)
    assert tally.due(1060.0)
    assert tally.flush(1060.0) == [
        {
            "from": 1000.0,
            "to": 1060.0,
            "received": {"alice": {"chunks": 3, "bytes": 300}, "bob": {"chunks": 1, "bytes": 7}},
            "forwarded": {"alice": {"chunks": 1, "bytes": 100}},
            "part": 1,
            "parts": 1,
        }
    ]
    assert tally.empty and not tally.due(1119.0) and tally.due(1120.0)


def test_tally_without_traffic_flushes_nothing_and_restarts_the_interval() -> None:
    tally = TrafficTally(interval_s=10.0, now=0.0)
    assert tally.flush(10.0) == []
    tally.add("received", "alice", 1)
    assert tally.flush(25.0)[0]["from"] == 10.0


def test_tally_with_many_origins_splits_into_entries_that_fit() -> None:
    tally = TrafficTally(interval_s=1.0, now=0.0)
    origins = [f"ciuic{i:032d}" + "x" * 91 for i in range(MAX_ORIGINS_PER_ENTRY * 2 + 1)]
    for origin in origins:
        tally.add("received", origin, 2**63)
        tally.add("forwarded", origin, 2**63)
    parts = tally.flush(1.0)
    assert [p["parts"] for p in parts] == [3, 3, 3]
    assert sum(len(p["received"]) for p in parts) == len(origins)
    chain = AuditChain(KEY.peer_id, KEY.sign)
    assert check([chain.entry("traffic", p, 1.0) for p in parts]).ok


def test_tally_refuses_bad_input() -> None:
    tally = TrafficTally(interval_s=1.0, now=0.0)
    with pytest.raises(ValueError):
        tally.add("dropped", "alice", 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        tally.add("received", "alice", -1)
    with pytest.raises(ValueError):
        TrafficTally(interval_s=0.0, now=0.0)
