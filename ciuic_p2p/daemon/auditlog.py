"""The audit log's files: core.audit's chain appended to disk, rotated, read back.

``AuditLog`` is the daemon's end: one method per thing worth recording, each writing
one signed entry (``traffic`` is the exception: chunks are summed per origin by
``TrafficTally`` and written once per ``interval_s``). Entry kinds and their data:

- ``started``: public_key, version     - ``stopped``: reason
- ``admitted``: peer, address
- ``refusals``: from, to, total, reasons ({reason: count}), networks ({/24 or /56:
  count}, the busiest 32), distinct_networks: every connection refused and datagram
  dropped before any state, summed per interval (a flood is one entry a minute)
- ``traffic``: from, to, received and forwarded ({origin: {chunks, bytes}}), part, parts
- ``served_state``: name, version, to, bytes
- ``checkpoint``: path, step, digest
- ``origin_set_aside``: origin, until_step, run: this node's trainer set an origin
  aside after repeated refusals (core.replica.influence)
- ``repaired``: file, offset, dropped_bytes, dropped_blake2b (a torn line cut at open)
- ``pruned``: files, through_seq, head: the oldest files were deleted to keep the
  directory under ``max_dir_bytes``; the chain now starts after ``through_seq``, whose
  digest was ``head`` (``audit verify`` accepts a start past entry 1 only with it)

Files are ``audit-000001.jsonl``, ``audit-000002.jsonl``, ... in one directory (0700,
files 0600). A file past ``rotate_bytes`` is fsynced and closed, and the next entry
opens the next number; the chain goes on, so the first entry of a file has the last
digest of the file before as ``prev``. Each entry is one ``os.write`` of the whole
line (no user-space buffer to lose); fsync happens on rotation, ``flush()`` and
``close()``. A crash can leave a torn last line: opening the log cuts it off, keeping
its digest in a ``repaired`` entry, and continues the chain from the last whole line.

A write that fails (a full disk: ENOSPC) never stops the daemon: the entry is not
chained (``draft``/``commit``), ``write_errors`` and ``error`` say so in ``status``,
one line a minute says so in the log, and the next entry tries again.

Not thread-safe: call it from the daemon's loop thread. Writes block briefly (page
cache); only rotation, ``flush`` and ``close`` wait for the disk.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from ciuic_p2p import __version__
from ciuic_p2p.addresses import network_of
from ciuic_p2p.core.audit import (
    MAX_LINE_BYTES,
    AuditChain,
    AuditError,
    AuditFormatError,
    ChainVerifier,
    Direction,
    RefusalTally,
    TrafficTally,
    VerifyReport,
    digest,
    parse_entry,
)
from ciuic_p2p.identity import PUBLIC_KEY_LEN, NodeKey, peer_id_of, verify_signature
from ciuic_p2p.logsetup import get_logger

FILE_PATTERN = re.compile(r"audit-(\d{6,})\.jsonl")
MAX_TEXT_CHARS = 1024
"""Longer strings (a refusal reason, a path) are cut, so an entry stays small."""
log = get_logger("ciuic.audit")


def file_name(number: int) -> str:
    return f"audit-{number:06d}.jsonl"


def audit_files(directory: Path) -> list[tuple[int, Path]]:
    """The directory's audit files, by number."""
    try:
        names = os.listdir(directory)
    except OSError as exc:
        raise AuditError(f"{directory}: cannot list the audit directory: {exc.strerror}") from None
    found = [(int(m.group(1)), directory / n) for n in names if (m := FILE_PATTERN.fullmatch(n))]
    return sorted(found)


def _clip(text: object) -> str:
    return str(text)[:MAX_TEXT_CHARS]


def _address(address: str | tuple[Any, ...]) -> str:
    if isinstance(address, tuple) and len(address) >= 2:
        return _clip(f"{address[0]}:{address[1]}")
    return _clip(address)


def _origin(origin: str | bytes) -> str:
    if isinstance(origin, bytes):
        return peer_id_of(origin) if len(origin) == PUBLIC_KEY_LEN else origin.hex()[:128]
    return origin[:128]


def _tail(fd: int, size: int, nbytes: int) -> bytes:
    start = max(0, size - nbytes)
    return os.pread(fd, size - start, start)


class AuditLog:
    """The daemon's audit log in ``directory``; opening it continues the chain there."""

    def __init__(
        self,
        directory: Path,
        key: NodeKey,
        *,
        peer_id: str,
        interval_s: float,
        rotate_bytes: int,
        max_dir_bytes: int = 0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``max_dir_bytes``: past it the oldest files are deleted at a rotation (a
        ``pruned`` entry records it); 0 keeps every file."""
        if rotate_bytes <= 0:
            raise ValueError("rotate_bytes must be > 0")
        if max_dir_bytes and max_dir_bytes < 2 * rotate_bytes:
            raise ValueError("max_dir_bytes must hold at least two files (2 x rotate_bytes)")
        self._dir = Path(directory)
        self._key = key
        self._clock = clock
        self._rotate_bytes = rotate_bytes
        self._max_dir_bytes = max_dir_bytes
        self._chain = AuditChain(peer_id, key.sign)
        self._tally = TrafficTally(interval_s, clock())
        self._refusals = RefusalTally()
        self._fd: int | None = None
        self._closed = False
        self.write_errors = 0
        """Entries that could not be written (not chained: the chain stays whole)."""
        self.error = ""
        """The last write failure, until a write succeeds again."""
        self.pruned_files = 0
        if not self._dir.is_dir():
            self._dir.mkdir(mode=0o700, parents=True)
            os.chmod(self._dir, 0o700)  # mkdir's mode passes through the umask
        # Two writers would fork the chain: hold a lock on the directory while open.
        self._lock_fd = os.open(self._dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise AuditError(f"{self._dir}: another process is writing this audit log") from None
        try:
            self._number, self._size, repaired = self._resume()
        except BaseException:
            os.close(self._lock_fd)
            raise
        if repaired is not None:
            self._write("repaired", repaired)

    @property
    def last_seq(self) -> int:
        """The newest entry's seq (0 when empty). Report it with ``head``: a cut-off
        tail can only be seen by comparing them with ``audit verify``'s."""
        return self._chain.last_seq

    @property
    def head(self) -> str:
        return self._chain.head

    @property
    def path(self) -> Path:
        """The file the next entry goes to."""
        return self._dir / file_name(self._number)

    # --- what is recorded -------------------------------------------------------------

    def started(self) -> None:
        self._write("started", {"public_key": self._key.public_key.hex(), "version": __version__})

    def stopped(self, reason: str) -> None:
        """The last entry: the sums still open go before it, so that a reader can
        take ``stopped`` as the end of what this run recorded."""
        self._flush_pending()
        self._write("stopped", {"reason": _clip(reason)})

    def admitted(self, peer: str, address: str | tuple[Any, ...]) -> None:
        self._write("admitted", {"peer": _clip(peer), "address": _address(address)})

    def refused(self, address: str | tuple[Any, ...], reason: str) -> None:
        """A connection refused or a datagram dropped before any state: summed per
        source network and reason, written once per interval (``refusals``)."""
        if self._closed:
            raise AuditError("the audit log is closed")
        host = address[0] if isinstance(address, tuple) else str(address).rsplit(":", 1)[0]
        self._refusals.add(network_of(str(host)), str(reason))
        self.tick()

    def received(self, origin: str | bytes, nbytes: int) -> None:
        """A chunk of ``origin`` (peer ID or raw public key) arrived; summed, not written."""
        self._traffic("received", origin, nbytes)

    def forwarded(self, origin: str | bytes, nbytes: int) -> None:
        self._traffic("forwarded", origin, nbytes)

    def served_state(self, name: str, version: int, to_peer: str, nbytes: int) -> None:
        data = {"name": _clip(name), "version": version, "to": _clip(to_peer), "bytes": nbytes}
        self._write("served_state", data)

    def checkpoint(self, path: str | Path, step: int, digest: str | bytes) -> None:
        hex_digest = digest.hex() if isinstance(digest, bytes) else _clip(digest)
        self._write("checkpoint", {"path": _clip(path), "step": step, "digest": hex_digest})

    def origin_set_aside(self, origin: str, until_step: int, run: str) -> None:
        data = {"origin": _clip(origin), "until_step": until_step, "run": _clip(run)}
        self._write("origin_set_aside", data)

    def tick(self) -> None:
        """Write the traffic of an interval that has ended (the daemon's timer calls it;
        ``received`` and ``forwarded`` call it too)."""
        now = self._clock()
        if self._tally.due(now):
            start = self._tally_start
            for data in self._tally.flush(now):
                self._write("traffic", data)
            self._flush_refusals(start, now)

    def flush(self) -> None:
        """Make every entry written so far durable (fsync). Traffic still being summed
        waits for its interval to end, or for ``close``."""
        if self._fd is not None:
            try:
                os.fsync(self._fd)
            except OSError as exc:
                self._failed(exc)

    def close(self) -> None:
        """Write the traffic summed so far, fsync and close. Call it last: later
        calls raise :class:`AuditError`."""
        if self._closed:
            return
        self._flush_pending()
        self._closed = True
        try:
            if self._fd is not None:
                fd, self._fd = self._fd, None
                try:
                    os.fsync(fd)
                except OSError as exc:
                    self._failed(exc)
                finally:
                    os.close(fd)
        finally:
            os.close(self._lock_fd)

    # --- files ---------------------------------------------------------------------------

    def _traffic(self, direction: Direction, origin: str | bytes, nbytes: int) -> None:
        if self._closed:
            raise AuditError("the audit log is closed")
        self._tally.add(direction, _origin(origin), nbytes)
        self.tick()

    @property
    def _tally_start(self) -> float:
        return self._tally.start

    def _flush_pending(self) -> None:
        now = self._clock()
        start = self._tally_start
        if not self._tally.empty:
            for data in self._tally.flush(now):
                self._write("traffic", data)
        self._flush_refusals(start, now)

    def _flush_refusals(self, start: float, now: float) -> None:
        data = self._refusals.flush(start, now)
        if data is not None:
            self._write("refusals", data)

    def _write(self, kind: str, data: dict[str, Any]) -> None:
        if self._closed:
            raise AuditError("the audit log is closed")
        line = self._chain.draft(kind, data, round(self._clock(), 6)).encode("utf-8")
        try:
            self._store(line)
        except OSError as exc:
            self._failed(exc)
            return
        self.error = ""
        if self._fd is None and self._max_dir_bytes:  # just rotated
            self._prune()

    def _store(self, line: bytes) -> None:
        if self._fd is None:
            self._fd = self._open_file(self._number)
        payload = memoryview(line + b"\n")
        try:
            written = 0
            while written < len(payload):
                written += os.write(self._fd, payload[written:])
        except OSError:
            # Leave no half line behind it: the chain stays where it was.
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self._size)
            raise
        self._chain.commit(line)
        self._size += len(payload)
        if self._size >= self._rotate_bytes:
            fd, self._fd = self._fd, None
            self._number, self._size = self._number + 1, 0
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def _failed(self, exc: OSError) -> None:
        self.write_errors += 1
        self.error = f"{self._dir}: {exc.strerror or exc}"
        log.error("audit_write_failed", error=self.error, write_errors=self.write_errors)

    def _prune(self) -> None:
        """Delete the oldest files while the directory is over ``max_dir_bytes``, then
        say so in the chain (``pruned``), so that ``audit verify`` can tell a bound from
        a deletion."""
        files = audit_files(self._dir)
        sizes = {number: path.stat().st_size for number, path in files}
        total = sum(sizes.values())
        removed: list[int] = []
        last: bytes | None = None
        for number, path in files[:-1]:  # never the newest
            if total <= self._max_dir_bytes:
                break
            last = _last_line(path) or last
            path.unlink()
            total -= sizes[number]
            removed.append(number)
        if not removed or last is None:
            return
        self.pruned_files += len(removed)
        through = parse_entry(last)
        self._write(
            "pruned",
            {
                "files": f"{file_name(removed[0])}..{file_name(removed[-1])}",
                "through_seq": through.seq,
                "head": through.digest,
            },
        )

    def _open_file(self, number: int) -> int:
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
        fd = os.open(self._dir / file_name(number), flags, 0o600)
        os.fchmod(fd, 0o600)
        # The new name must survive a crash too, or the chain would lose a whole file.
        dir_fd = os.open(self._dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        return fd

    def _resume(self) -> tuple[int, int, dict[str, Any] | None]:
        """(number of the file to write, its size, a ``repaired`` entry's data or None),
        with the chain continued from the newest whole line."""
        files = audit_files(self._dir)
        if not files:
            return 1, 0, None
        number, newest = files[-1]
        repaired = _cut_torn_line(newest)
        for _, path in reversed(files):
            last = _last_line(path)
            if last is None:
                continue  # empty: a crash right after the file was created
            try:
                self._chain.resume(last)
            except AuditFormatError as exc:
                raise AuditError(
                    f"{path}: the last entry is not valid ({exc}), so the chain cannot be "
                    f"continued; check it with `ciuic-node audit verify {self._dir}`, and move "
                    "the directory aside to start a new log"
                ) from None
            break
        size = newest.stat().st_size
        if size >= self._rotate_bytes:
            return number + 1, 0, repaired
        return number, size, repaired


def _cut_torn_line(path: Path) -> dict[str, Any] | None:
    """Cut an unterminated last line (a write cut short by a crash) off ``path``."""
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
            return None
        tail = _tail(fd, size, MAX_LINE_BYTES + 2)
        newline = tail.rfind(b"\n")
        if newline < 0 and len(tail) < size:
            raise AuditError(
                f"{path}: ends in a line longer than any entry and without a newline; "
                "not written by ciuic-node: check it with `ciuic-node audit verify`"
            )
        dropped = tail[newline + 1 :]
        offset = size - len(dropped)
        os.ftruncate(fd, offset)
        os.fsync(fd)
    finally:
        os.close(fd)
    return {
        "file": path.name,
        "offset": offset,
        "dropped_bytes": len(dropped),
        "dropped_blake2b": digest(dropped),
    }


def _last_line(path: Path) -> bytes | None:
    """The last line of a file that ends in a newline (None when empty). An over-long
    one comes back over the limit, and fails to parse."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return None
        tail = _tail(fd, size, MAX_LINE_BYTES + 2)
    finally:
        os.close(fd)
    return tail[:-1].rsplit(b"\n", 1)[-1]


def _lines(path: Path, verifier: ChainVerifier) -> Iterator[tuple[int, bytes]]:
    """A file's lines, with no newline; an unterminated last line is a break."""
    with path.open("rb") as f:
        number = 0
        while raw := f.readline(MAX_LINE_BYTES + 2):
            number += 1
            if raw.endswith(b"\n"):
                yield number, raw[:-1]
            elif len(raw) > MAX_LINE_BYTES:
                yield number, raw  # fails as over the limit
            else:
                verifier.fail(
                    path.name,
                    number,
                    "the last line is incomplete: a torn write (the daemon cuts it off "
                    "when it next starts) or a cut file",
                )
                return


def verify_directory(directory: Path, public_key: bytes) -> VerifyReport:
    """Check every audit file in ``directory`` in order against the node's public key.
    A number missing in the sequence of files is a break; a cut-off tail (the newest
    entries or files removed) is not visible here: compare ``last_seq`` and ``head``
    with the daemon's."""
    files = audit_files(Path(directory))
    if not files:
        raise AuditError(f"{directory}: no audit files (audit-NNNNNN.jsonl) there")
    first = files[0][0]
    verifier = ChainVerifier(
        lambda message, sig: verify_signature(public_key, sig, message),
        pruned_start=first > 1,  # removed by the size bound, or deleted: see ``pruned``
        missing=file_name(1) + ("" if first == 2 else f" to {file_name(first - 1)}"),
    )
    expected = first
    for number, path in files:
        if number != expected:
            gone = file_name(expected)
            if number > expected + 1:
                gone += f" to {file_name(number - 1)}"
            verifier.fail(path.name, 1, f"{gone} missing: the files jump to {path.name}")
            break
        expected = number + 1
        for line, text in _lines(path, verifier):
            if not verifier.feed(path.name, line, text):
                break
        if verifier.broken:
            break
    return verifier.report()


def public_key_from(spec: str | Path) -> bytes:
    """The raw public key in a node key file, a node certificate (PEM), or 64 hex
    digits."""
    path = Path(spec)
    if path.is_file():
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise AuditError(f"{path}: cannot read: {exc.strerror}") from None
        if b"PRIVATE KEY" in data:
            return NodeKey.load(path).public_key
        if b"CERTIFICATE" in data:
            try:
                public = x509.load_pem_x509_certificate(data).public_key()
            except ValueError:
                raise AuditError(f"{path}: not a PEM certificate") from None
            if not isinstance(public, Ed25519PublicKey):
                raise AuditError(f"{path}: the certificate is not for an Ed25519 key")
            return public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        raise AuditError(f"{path}: neither a node key nor a certificate (PEM)")
    text = str(spec).strip()
    if re.fullmatch(r"[0-9a-fA-F]{64}", text):
        return bytes.fromhex(text)
    raise AuditError(f"{spec}: no such file, and not a public key in hex (64 digits)")
