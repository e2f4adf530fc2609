"""Origin signatures on chunks, and the per-origin replay window.

Every chunk carries its origin's Ed25519 signature over the SHA-256 of the whole
chunk except the flags byte and the signature slot (core.codec.chunk.signed_region and
signed_digest; chunks signed over those bytes themselves, by older signers, are still
verified), so a relay forwards it untouched and cannot alter or forge it. Receivers
verify before use and drop chunks they have already seen, with a bounded window per
origin:

- a chunk is identified by (incarnation, step, bucket, range_start);
- a higher incarnation (the origin restarted) resets the window;
- a lower incarnation, or a step more than ``window_steps`` behind the newest step
  seen, is refused as stale: it can no longer be told apart from a replay;
- within the window, an identifier seen before is a replay.

Memory per origin is bounded by ``max_entries``; past it, the oldest steps are
forgotten and the low edge of the window moves up.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ciuic_p2p.core.codec.chunk import (
    ChunkHeader,
    parse_chunk,
    set_signature,
    signed_copy,
    signed_digest,
    signed_region,
)
from ciuic_p2p.core.link.keys import Signer, verify_signature
from ciuic_p2p.errors import CodecError, ReplayedChunkError, SignatureError


def sign_chunk(chunk: bytearray, key: Signer, header: ChunkHeader | None = None) -> None:
    """Sign a chunk in place with the origin's key (the chunk's origin field must be
    that key's public key). ``header``: the chunk's, when the caller parsed it already
    (a parse checks the CRC: one pass over the chunk saved)."""
    if header is None:
        header, _ = parse_chunk(chunk)
    if header.origin != key.public_key:
        raise SignatureError("a node signs only chunks whose origin it is")
    set_signature(chunk, key.sign(signed_digest(chunk)))


def signed_by(
    chunk: bytes | bytearray | memoryview, key: Signer, header: ChunkHeader, prefix: bytes = b""
) -> bytes:
    """``prefix`` and the chunk signed with the origin's key, in one copy (``header``:
    the chunk's, parsed by the caller; its origin must be that key's)."""
    if header.origin != key.public_key:
        raise SignatureError("a node signs only chunks whose origin it is")
    return signed_copy(chunk, key.sign(signed_digest(chunk)), prefix)


def verify_chunk(chunk: bytes | bytearray | memoryview) -> ChunkHeader:
    """Parse a chunk and check its origin's signature; return its header."""
    header, _ = parse_chunk(chunk)
    if not header.signed:
        raise SignatureError("chunk is not signed")
    if header.signed_over_digest:
        signed: tuple[bytes | memoryview, ...] = (signed_digest(chunk),)
    else:
        signed = signed_region(chunk)
    if not verify_signature(header.origin, header.signature, *signed):
        raise SignatureError("chunk signature does not verify: altered or forged")
    return header


@dataclass
class _OriginWindow:
    incarnation: int = -1
    newest_step: int = -1
    low_step: int = 0
    seen: dict[int, set[tuple[int, int]]] = field(default_factory=dict)
    entries: int = 0


class ReplayWindow:
    """Per-origin duplicate and replay filter. Pure: no clock, bounded memory."""

    def __init__(
        self, window_steps: int = 1024, max_entries: int = 65_536, max_origins: int = 4096
    ) -> None:
        if window_steps < 1 or max_entries < 1 or max_origins < 1:
            raise ValueError("window_steps, max_entries and max_origins must be positive")
        self.window_steps = window_steps
        self.max_entries = max_entries
        self.max_origins = max_origins
        self._origins: dict[bytes, _OriginWindow] = {}

    def check_and_record(self, header: ChunkHeader) -> None:
        """Accept a chunk's identity once; raise :class:`ReplayedChunkError` after."""
        w = self._origins.get(header.origin)
        if w is None:
            if len(self._origins) >= self.max_origins:
                # Forget the origin least recently started (dicts keep insertion order);
                # the membership layer admits origins, so this bounds memory, not trust.
                del self._origins[next(iter(self._origins))]
            w = self._origins[header.origin] = _OriginWindow()
        if header.incarnation < w.incarnation:
            raise ReplayedChunkError(
                f"chunk of incarnation {header.incarnation}, origin is at {w.incarnation}"
            )
        if header.incarnation > w.incarnation:
            self._origins[header.origin] = w = _OriginWindow(incarnation=header.incarnation)
        step = header.step
        if step < w.low_step or step + self.window_steps <= w.newest_step:
            raise ReplayedChunkError(f"chunk of step {step} is older than the replay window")
        ident = (header.bucket, header.range_start)
        seen = w.seen.setdefault(step, set())
        if ident in seen:
            raise ReplayedChunkError(f"chunk of step {step} already received")
        seen.add(ident)
        w.entries += 1
        if step > w.newest_step:
            w.newest_step = step
            for old in [s for s in w.seen if s + self.window_steps <= step]:
                w.entries -= len(w.seen.pop(old))
            w.low_step = max(w.low_step, step - self.window_steps + 1)
        while w.entries > self.max_entries:
            oldest = min(w.seen)
            w.entries -= len(w.seen.pop(oldest))
            w.low_step = oldest + 1

    def __len__(self) -> int:
        """Origins tracked now (at most ``max_origins``: keep it above the cluster's
        size, since a forgotten origin's replay state is gone)."""
        return len(self._origins)

    def forget(self, origin: bytes) -> None:
        self._origins.pop(origin, None)


@dataclass
class ChunkFilter:
    """What a receiver does with every chunk before using it: verify the origin's
    signature, check the origin is a member (``is_member``, from the membership layer;
    without it any key that signs is accepted), then drop replays. Counts each outcome
    for metrics and tests."""

    window: ReplayWindow = field(default_factory=ReplayWindow)
    is_member: Callable[[bytes], bool] | None = None
    accepted: int = 0
    bad_signature: int = 0
    replayed: int = 0
    malformed: int = 0
    unknown_origin: int = 0

    def admit(self, chunk: bytes | bytearray | memoryview) -> ChunkHeader | None:
        """The chunk's header when it is new and authentic, else None (counted)."""
        try:
            header = verify_chunk(chunk)
        except SignatureError:
            self.bad_signature += 1
            return None
        except CodecError:
            self.malformed += 1
            return None
        if self.is_member is not None and not self.is_member(header.origin):
            self.unknown_origin += 1
            return None
        try:
            self.window.check_and_record(header)
        except ReplayedChunkError:
            self.replayed += 1
            return None
        self.accepted += 1
        return header
