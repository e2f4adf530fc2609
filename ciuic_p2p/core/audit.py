"""The tamper-evident audit log's entry format, hash chain, traffic tally and checker.

Pure: no files and no clock (``now`` is an argument); ``daemon/auditlog.py`` owns the
files. What a node may later have to account for (peers admitted or refused, whose
chunks it received and forwarded, what state it served to whom, checkpoints written,
starts and stops) is appended as one line of JSON per entry, version 1::

    {"data":{...},"kind":"admitted","node":"ciuic...","prev":"<64 hex>","seq":7,
     "sig":"<128 hex>","time":1712345678.25,"v":1}

- Canonical encoding: keys sorted, no whitespace, UTF-8, no NaN or Infinity. A line
  that is not byte for byte the canonical encoding of what it parses to is refused, so
  an entry has exactly one byte string, one digest and one signed message.
- ``seq`` counts 1, 2, 3, ... without gaps, across rotated files.
- ``prev`` is the BLAKE2b-256 (hex) of the previous entry's whole line (without its
  newline); 64 zeros for entry 1. This is the hash chain.
- ``sig`` is the node key's Ed25519 signature over ``SIG_CONTEXT`` followed by the
  canonical encoding of the entry without ``sig``. The context string keeps an audit
  signature from being valid as any other message the node key signs (chunks, proofs
  of possession), and the other way round.
- ``time`` is the writer's unix time in seconds: informative only, clocks step back.

What a check proves: an edited or forged entry fails its signature; a deleted entry
leaves a gap in ``seq``; an inserted copy of an old entry or a reordering puts ``seq``
out of order; a spliced-in entry from another chain of the same key fails ``prev``.
What it cannot prove: that nothing was cut off the end. Removing the newest entries
(or the newest files) leaves a shorter, valid chain, since nothing after the cut
vouches for what was there. That is why :class:`VerifyReport` gives ``last_seq`` and
``head``: compare them with what the running daemon reports, or with a head copied
off the node earlier. Whoever holds the node key can also rewrite the whole log.

Decoding trusts nothing: lines are size-limited and every bad line raises
:class:`AuditFormatError`, never anything else.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

from ciuic_p2p.errors import CiuicError

VERSION = 1
MAX_LINE_BYTES = 64 * 1024
"""Longest line (without its newline) a writer produces or a reader accepts."""
ZERO_DIGEST = "0" * 64
"""``prev`` of entry 1."""
MAX_SEQ = 2**64 - 1
MAX_KIND_CHARS = 64
MAX_NODE_CHARS = 128
SIGNATURE_BYTES = 64
SIG_CONTEXT = b"ciuic-p2p audit entry v1\x00"
MAX_ORIGINS_PER_ENTRY = 128
"""A traffic entry names at most this many origins (each at most MAX_ORIGIN_CHARS),
which keeps it well under MAX_LINE_BYTES; more origins make more entries."""
MAX_ORIGIN_CHARS = 128

_FIELDS = frozenset({"v", "seq", "prev", "time", "node", "kind", "data", "sig"})
_HEX_DIGEST = re.compile(r"[0-9a-f]{64}")
_HEX_SIG = re.compile(r"[0-9a-f]{128}")

Direction = Literal["received", "forwarded"]
SignFn = Callable[[bytes], bytes]
VerifySigFn = Callable[[bytes, bytes], bool]
"""``verify_sig(message, signature) -> bool`` with the node's public key bound in."""


class AuditError(CiuicError):
    """The audit log cannot be written, continued or checked; the message says why."""


class AuditFormatError(AuditError):
    """A line is not a valid version-1 audit entry (raised for every bad line)."""


def encode(obj: dict[str, Any]) -> bytes:
    """The canonical encoding. Raises ValueError for NaN, Infinity or lone surrogates."""
    text = json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    )
    return text.encode("utf-8")


def digest(line: bytes | str) -> str:
    """BLAKE2b-256 (hex) of a whole line without its newline: the next entry's ``prev``."""
    raw = line.encode("utf-8") if isinstance(line, str) else line
    return hashlib.blake2b(raw, digest_size=32).hexdigest()


@dataclass(frozen=True, slots=True)
class AuditEntry:
    """One parsed entry; ``signed`` is what ``sig`` signs, ``line`` the bytes read."""

    seq: int
    prev: str
    time: float
    node: str
    kind: str
    data: dict[str, Any]
    sig: bytes
    line: bytes
    signed: bytes

    @property
    def digest(self) -> str:
        return digest(self.line)


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise ValueError("duplicate key")
    return obj


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


def _is_int(value: object) -> bool:
    return type(value) is int  # bool is an int subclass, and never a valid seq


def parse_entry(text: bytes | str) -> AuditEntry:
    """Parse and check one line (a trailing newline is allowed). The signature and the
    chain are checked by :class:`ChainVerifier`, which knows the key and the past."""
    raw = _line_bytes(text)
    obj = _json_object(raw)
    _check_fields(obj)
    try:
        canonical = encode(obj)
        sig = obj.pop("sig")
        signed = SIG_CONTEXT + encode(obj)
    except (ValueError, RecursionError):
        raise AuditFormatError("holds a value with no canonical encoding") from None
    if canonical != raw:
        raise AuditFormatError("not in canonical form (sorted keys, no spaces)")
    return AuditEntry(
        obj["seq"],
        obj["prev"],
        obj["time"],
        obj["node"],
        obj["kind"],
        obj["data"],
        bytes.fromhex(sig),
        raw,
        signed,
    )


def _line_bytes(text: bytes | str) -> bytes:
    try:
        raw = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    except UnicodeEncodeError:
        raise AuditFormatError("the line is not valid UTF-8") from None
    if raw.endswith(b"\n"):
        raw = raw[:-1]
    if len(raw) > MAX_LINE_BYTES:
        raise AuditFormatError(f"the line is over the {MAX_LINE_BYTES}-byte limit")
    if not raw:
        raise AuditFormatError("the line is empty")
    return raw


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(
            raw.decode("utf-8"), object_pairs_hook=_no_duplicate_keys, parse_constant=_no_constant
        )
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise AuditFormatError(f"not JSON ({str(exc)[:120]})") from None
    if not isinstance(obj, dict):
        raise AuditFormatError("not a JSON object")
    if set(obj) != _FIELDS:
        missing, extra = sorted(_FIELDS - set(obj)), sorted(set(obj) - _FIELDS)
        raise AuditFormatError(f"wrong fields (missing {missing}, unexpected {extra})"[:200])
    return obj


def _check_fields(obj: dict[str, Any]) -> None:
    if not _is_int(obj["v"]) or obj["v"] != VERSION:
        raise AuditFormatError(f"unsupported version {str(obj['v'])[:20]} (this reader: 1)")
    seq, prev, when = obj["seq"], obj["prev"], obj["time"]
    node, kind, data, sig = obj["node"], obj["kind"], obj["data"], obj["sig"]
    if not _is_int(seq) or not 1 <= seq <= MAX_SEQ:
        raise AuditFormatError("seq is not an integer from 1 to 2^64-1")
    if not isinstance(prev, str) or not _HEX_DIGEST.fullmatch(prev):
        raise AuditFormatError("prev is not 64 lower-case hex digits")
    if type(when) not in (int, float) or not math.isfinite(when):
        raise AuditFormatError("time is not a finite number")
    if not isinstance(node, str) or not 0 < len(node) <= MAX_NODE_CHARS:
        raise AuditFormatError(f"node is not a string of 1 to {MAX_NODE_CHARS} characters")
    if not isinstance(kind, str) or not 0 < len(kind) <= MAX_KIND_CHARS:
        raise AuditFormatError(f"kind is not a string of 1 to {MAX_KIND_CHARS} characters")
    if not isinstance(data, dict):
        raise AuditFormatError("data is not an object")
    if not isinstance(sig, str) or not _HEX_SIG.fullmatch(sig):
        raise AuditFormatError("sig is not 128 lower-case hex digits")


class AuditChain:
    """The writer's end of the chain: the next seq and the previous line's digest.

    ``entry`` signs and returns the next line and moves on. A writer that may fail to
    store the line uses ``draft`` and, once the line is stored, ``commit``: a line that
    never reached the file must not leave a gap in the chain.
    """

    def __init__(self, node: str, sign: SignFn) -> None:
        if not 0 < len(node) <= MAX_NODE_CHARS:
            raise AuditError(f"a node name is 1 to {MAX_NODE_CHARS} characters")
        self._node = node
        self._sign = sign
        self._next_seq = 1
        self._head = ZERO_DIGEST

    @property
    def next_seq(self) -> int:
        return self._next_seq

    @property
    def last_seq(self) -> int:
        """0 before the first entry."""
        return self._next_seq - 1

    @property
    def head(self) -> str:
        """Digest of the newest line (zeros before the first): the next entry's ``prev``."""
        return self._head

    def resume(self, last_line: bytes | str) -> None:
        """Continue the chain after an existing line (the newest one written)."""
        last = parse_entry(last_line)
        if last.seq >= MAX_SEQ:
            raise AuditError("the chain has reached the last seq")
        self._next_seq, self._head = last.seq + 1, last.digest

    def draft(self, kind: str, data: dict[str, Any], now: float) -> str:
        """The signed next line (no newline), without moving the chain on."""
        if not 0 < len(kind) <= MAX_KIND_CHARS:
            raise AuditFormatError(f"kind is 1 to {MAX_KIND_CHARS} characters")
        if not math.isfinite(now):
            raise AuditFormatError("time is not a finite number")
        body: dict[str, Any] = {
            "v": VERSION,
            "seq": self._next_seq,
            "prev": self._head,
            "time": float(now),
            "node": self._node,
            "kind": kind,
            "data": data,
        }
        try:
            unsigned = encode(body)
        except ValueError:
            raise AuditFormatError("data holds NaN, Infinity or a lone surrogate") from None
        sig = self._sign(SIG_CONTEXT + unsigned)
        if len(sig) != SIGNATURE_BYTES:
            raise AuditError(f"the signer returned {len(sig)} bytes, not an Ed25519 signature")
        line = encode({**body, "sig": sig.hex()})
        if len(line) > MAX_LINE_BYTES:
            raise AuditFormatError(f"a {kind} entry of {len(line)} bytes is over the limit")
        return line.decode("utf-8")

    def commit(self, line: bytes | str) -> None:
        """The drafted ``line`` is stored: the next entry follows it."""
        self._next_seq += 1
        self._head = digest(line)

    def entry(self, kind: str, data: dict[str, Any], now: float) -> str:
        line = self.draft(kind, data, now)
        self.commit(line)
        return line


class TrafficTally:
    """Chunks received and forwarded, counted and summed per origin over one interval,
    so the log holds one entry per interval rather than one per chunk."""

    def __init__(self, interval_s: float, now: float) -> None:
        if not interval_s > 0:
            raise ValueError("interval_s must be > 0")
        self._interval_s = interval_s
        self._start = now
        self._counts: dict[Direction, dict[str, list[int]]] = {"received": {}, "forwarded": {}}

    @property
    def empty(self) -> bool:
        return not any(self._counts.values())

    @property
    def start(self) -> float:
        """When the interval being summed began."""
        return self._start

    def add(self, direction: Direction, origin: str, nbytes: int) -> None:
        if direction not in self._counts:
            raise ValueError(f"direction is 'received' or 'forwarded', not {direction!r}")
        if nbytes < 0 or not 0 < len(origin) <= MAX_ORIGIN_CHARS:
            raise ValueError("nbytes must be >= 0 and origin 1 to 128 characters")
        count = self._counts[direction].setdefault(origin, [0, 0])
        count[0] += 1
        count[1] += nbytes

    def due(self, now: float) -> bool:
        """The interval that began at the last flush has ended."""
        return now >= self._start + self._interval_s

    def flush(self, now: float) -> list[dict[str, Any]]:
        """The ``data`` of the traffic entries for the interval ending ``now`` (none when
        no chunk moved), and a new interval starts."""
        origins = sorted(set(self._counts["received"]) | set(self._counts["forwarded"]))
        parts = [
            origins[i : i + MAX_ORIGINS_PER_ENTRY]
            for i in range(0, len(origins), MAX_ORIGINS_PER_ENTRY)
        ]
        out: list[dict[str, Any]] = []
        for number, part in enumerate(parts, 1):
            data: dict[str, Any] = {"from": self._start, "to": now}
            for direction, counts in self._counts.items():
                data[direction] = {
                    o: {"chunks": counts[o][0], "bytes": counts[o][1]} for o in part if o in counts
                }
            out.append({**data, "part": number, "parts": len(parts)})
        self._counts = {"received": {}, "forwarded": {}}
        self._start = now
        return out


MAX_REASONS_PER_ENTRY = 64
"""Distinct refusal reasons one ``refusals`` entry names; the rest count as other (a
reason can quote a stranger's certificate, so their number is the stranger's to set)."""
MAX_NETWORKS_PER_ENTRY = 32
"""Source networks one ``refusals`` entry names (the busiest); all are counted."""
MAX_NETWORKS_TRACKED = 4096
OTHER = "(other)"


class RefusalTally:
    """Refusals (connections refused, datagrams dropped before any state) counted per
    reason and source network over one interval: a flood of a million forged Initials
    is one entry a minute, not a million (the audit log's size is not a stranger's to
    choose), yet says how many, why and from where."""

    def __init__(self) -> None:
        self._reasons: dict[str, int] = {}
        self._networks: dict[str, int] = {}
        self._other_networks = 0
        self.total = 0

    def _reset(self) -> None:
        self._reasons, self._networks = {}, {}
        self._other_networks = self.total = 0

    @property
    def empty(self) -> bool:
        return self.total == 0

    def add(self, network: str, reason: str) -> None:
        self.total += 1
        reason = reason[:200]
        if reason in self._reasons or len(self._reasons) < MAX_REASONS_PER_ENTRY:
            self._reasons[reason] = self._reasons.get(reason, 0) + 1
        else:
            self._reasons[OTHER] = self._reasons.get(OTHER, 0) + 1
        if network in self._networks or len(self._networks) < MAX_NETWORKS_TRACKED:
            self._networks[network] = self._networks.get(network, 0) + 1
        else:
            self._other_networks += 1

    def flush(self, start: float, now: float) -> dict[str, Any] | None:
        """The ``data`` of one ``refusals`` entry for the interval (None when nothing
        was refused), and a new interval starts."""
        if self.empty:
            return None
        busiest = sorted(self._networks.items(), key=lambda kv: (-kv[1], kv[0]))
        data: dict[str, Any] = {
            "from": start,
            "to": now,
            "total": self.total,
            "reasons": dict(sorted(self._reasons.items())),
            "networks": dict(busiest[:MAX_NETWORKS_PER_ENTRY]),
            "distinct_networks": len(self._networks) + (1 if self._other_networks else 0),
        }
        self._reset()
        return data


@dataclass(frozen=True, slots=True)
class ChainBreak:
    """Where the first break is (file name, 1-based line) and what it looks like."""

    file: str
    line: int
    reason: str


@dataclass(frozen=True, slots=True)
class VerifyReport:
    """What a check found. ``entries``, ``first_seq``, ``last_seq`` and ``head`` cover
    the intact entries before the first break (all of them when ``broken`` is None)."""

    entries: int
    files: int
    first_seq: int | None
    last_seq: int | None
    head: str
    broken: ChainBreak | None

    @property
    def ok(self) -> bool:
        return self.broken is None

    def summary(self) -> str:
        """One line: ``ok: ...`` or ``BROKEN at FILE:LINE: reason; ...``."""
        span = f"seq {self.first_seq}..{self.last_seq}" if self.entries else "no entries"
        files = f"{self.files} file" + ("" if self.files == 1 else "s")
        intact = f"{self.entries} entries in {files}, {span}, head {self.head}"
        if self.broken is None:
            return f"ok: {intact}"
        b = self.broken
        return f"BROKEN at {b.file}:{b.line}: {b.reason}; intact before it: {intact}"


class ChainVerifier:
    """Checks lines one at a time, in chain order across files, and stops at the
    first break (nothing after a break can be trusted to be in place)."""

    def __init__(
        self, verify_sig: VerifySigFn, *, pruned_start: bool = False, missing: str = ""
    ) -> None:
        """``pruned_start``: the oldest files are not there (``missing`` names them),
        so the chain may begin past entry 1; it is whole only if a ``pruned`` entry,
        signed later in the chain, names where the removed part ended (the log's size
        bound removed them, :meth:`report`)."""
        self._missing = missing or "the files before it"
        self._verify_sig = verify_sig
        self._entries = 0
        self._files: list[str] = []
        self._first_seq: int | None = None
        self._last_seq = 0
        self._head = ZERO_DIGEST
        self._broken: ChainBreak | None = None
        self._pruned_start = pruned_start
        self._anchor: tuple[int, str] | None = None
        """(seq, digest) the first entry follows, before it is vouched for."""
        self._anchor_place: tuple[str, int] = ("", 0)

    @property
    def broken(self) -> bool:
        return self._broken is not None

    def fail(self, file: str, line: int, reason: str) -> None:
        """Record a break found outside the lines (a missing file, a torn line)."""
        if self._broken is None:
            self._broken = ChainBreak(file, line, reason)

    def feed(self, file: str, line: int, text: bytes | str) -> bool:
        """Check the next line; False once the chain is broken (here or before)."""
        if self._broken is not None:
            return False
        try:
            entry = parse_entry(text)
        except AuditFormatError as exc:
            self.fail(file, line, f"not a valid audit entry: {exc}")
            return False
        if self._entries == 0 and self._pruned_start and entry.seq > 1:
            # The part before it was pruned: take its word for where that part ended
            # until a ``pruned`` entry later in the chain confirms it.
            self._anchor = (entry.seq - 1, entry.prev)
            self._anchor_place = (file, line)
            self._last_seq, self._head = entry.seq - 1, entry.prev
        reason = self._misplaced(entry)
        if reason:
            self.fail(file, line, reason)
            return False
        if entry.kind == "pruned" and self._anchor is not None:
            through, head = entry.data.get("through_seq"), entry.data.get("head")
            if (through, head) == self._anchor:
                self._anchor = None
        if not self._files or self._files[-1] != file:
            self._files.append(file)
        self._entries += 1
        self._first_seq = entry.seq if self._first_seq is None else self._first_seq
        self._last_seq, self._head = entry.seq, entry.digest
        return True

    def _misplaced(self, entry: AuditEntry) -> str:
        expected = self._last_seq + 1
        # The signature first: an edit that also changed seq should read as an edit.
        if not self._verify_sig(entry.signed, entry.sig):
            who = (
                f"entry {entry.seq}"
                if entry.seq == expected
                else (f"the line claiming to be entry {entry.seq}")
            )
            return f"{who} was edited, or inserted by someone without this key (bad signature)"
        if entry.seq > expected:
            gap = (
                f"entry {expected} is"
                if entry.seq == expected + 1
                else (f"entries {expected}..{entry.seq - 1} are")
            )
            return f"{gap} missing before entry {entry.seq}: deleted, or moved"
        if entry.seq < expected:
            return (
                f"entry {entry.seq} comes after entry {self._last_seq}: "
                "entries reordered, or an old entry copied in"
            )
        if entry.prev != self._head:
            if entry.seq == 1:
                return "entry 1 does not start a chain (its prev is not zero)"
            return (
                f"entry {entry.seq} does not follow entry {self._last_seq} (prev digest "
                "differs): an entry was replaced, or another chain spliced in"
            )
        return ""

    def report(self) -> VerifyReport:
        if self._anchor is not None:
            # The unvouched start comes first in chain order, before any later break.
            file, line = self._anchor_place
            self._broken = None
            self.fail(
                file,
                line,
                f"{self._missing} missing: the chain starts at entry {self._anchor[0] + 1} "
                "and no pruned entry says the size bound removed the entries before it",
            )
        return VerifyReport(
            entries=self._entries,
            files=len(self._files),
            first_seq=self._first_seq,
            last_seq=self._last_seq if self._entries else None,
            head=self._head,
            broken=self._broken,
        )


def verify(lines: Iterable[tuple[str, int, bytes | str]], verify_sig: VerifySigFn) -> VerifyReport:
    """Check ``(file name, line number, text)`` in order across rotated files.

    The chain must start at entry 1. A cut-off tail is not detectable from the lines
    alone: compare the report's ``last_seq`` and ``head`` with what the daemon says.
    """
    verifier = ChainVerifier(verify_sig)
    for file, line, text in lines:
        if not verifier.feed(file, line, text):
            break
    return verifier.report()
