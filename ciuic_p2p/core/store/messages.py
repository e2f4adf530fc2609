"""Wire format of the shared store: named, versioned objects that members fetch from
each other in pieces (core.store.fetch), between daemons.

Control messages and offers that fit travel in ``STORE_CONTROL`` frames (the control
stream), pieces and large offers in ``STORE_DATA`` frames (bulk, credit flow
control). Layout (version 1)::

    magic b"CS" | version u8 (1) | kind u8 | body

``str8`` is a u8 length and UTF-8; integers little-endian. Bodies by kind:

- ``QUERY``:  name str8, min_version u64, token u32
- ``NONE``:   name str8, token u32                    (no version >= min held here)
- ``OFFER``:  token u32, load u16, manifest (below)
- ``GET``:    name str8, version u64, root (32), count u16, piece index u32 each
- ``PIECE``:  name str8, version u64, root (32), index u32, data (rest)
- ``BUSY``:   name str8, version u64, root (32)       (every upload slot is taken)
- ``HOLD``:   name str8, version u64, root (32)       (please fetch and hold it)
- ``HELD``:   name str8, version u64, root (32)       (holding it now)
- ``FINISHED``: name str8, version u64, root (32)     (fetched: free the upload slot)
- ``GONE``:   name str8, version u64, root (32)       (not held here any more)

A manifest is: name str8, version u64, total_bytes u64, piece_bytes u32, compat (32),
count u32, then a 32-byte BLAKE2b digest per piece, then (version 2) the writer's
Ed25519 public key (32) and its signature (64) over ``SIGN_CONTEXT`` and the root. The
root (BLAKE2b-256 of the encoded manifest without the signature, the writer's key
included) names one exact content of one writer; ``compat`` says which other contents
a piece may be mixed with (see core.store.fetch). An object's writer is the peer ID of
that key: a name's versions are kept per writer (core.store.holder), so a member can
replace only its own objects. Versions are below ``MAX_VERSION``.

Version 1 messages are read where their layout is version 2's without the appended
fields (a QUERY then asks for any writer); a version 1 OFFER, whose manifest is
unsigned, is refused. Kinds are append-only. Decoding trusts nothing: every length is
checked against what remains and the hard limits, and every failure is a
:class:`StoreWireError`.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Callable
from dataclasses import dataclass, replace

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from ciuic_p2p.core.binary import U64, Reader, Writer
from ciuic_p2p.core.link.keys import peer_id_of
from ciuic_p2p.errors import CiuicError

MAGIC = b"CS"
VERSION = 2
OLDEST_VERSION = 1
"""Read too (see the module docstring); every message is written at VERSION."""
KEY_LEN = 32
SIGNATURE_LEN = 64
UNSIGNED_KEY = bytes(KEY_LEN)
"""The writer key of a manifest nobody signed (core tests): no daemon takes it."""
SIGN_CONTEXT = b"ciuic-store-object-v2\0"
MAX_VERSION = 1 << 48
"""Versions are below this: a run's state is versioned by its step, an object by its
writer's count of puts; none comes near it, and a u64 at its end is no version."""
ANY_VERSION = MAX_VERSION - 1
ANY_ROOT = bytes(32)
MAX_WRITER_BYTES = 64
DIGEST_LEN = 32
MAX_NAME_BYTES = 200
MAX_PIECE_BYTES = 1 << 20
MIN_PIECE_BYTES = 4096
MAX_PIECES = 32768
MAX_OBJECT_BYTES = 8 << 30
MAX_GET_PIECES = 256
MAX_CONTROL_BYTES = 64 * 1024 - 16
"""Any message may travel in a STORE_CONTROL frame when it fits this."""
MAX_DATA_BYTES = MAX_PIECE_BYTES + 512 + MAX_NAME_BYTES
"""An OFFER's manifest (at most MAX_PIECES digests) and a PIECE both fit this."""


class StoreWireError(CiuicError):
    """Bytes that are not a valid store message; the message says what was wrong."""


class StoreKind(enum.IntEnum):
    QUERY = 1
    NONE = 2
    OFFER = 3
    GET = 4
    PIECE = 5
    BUSY = 6
    HOLD = 7
    HELD = 8
    FINISHED = 9
    GONE = 10


DATA_KINDS = frozenset({StoreKind.OFFER, StoreKind.PIECE})


def digest(data: bytes | bytearray | memoryview) -> bytes:
    return hashlib.blake2b(data, digest_size=DIGEST_LEN).digest()


@dataclass(frozen=True, slots=True)
class Manifest:
    name: str
    version: int
    total_bytes: int
    piece_bytes: int
    compat: bytes
    hashes: tuple[bytes, ...]
    writer_key: bytes = UNSIGNED_KEY
    """The writer's raw Ed25519 public key (its peer ID is :attr:`writer`)."""
    signature: bytes = bytes(SIGNATURE_LEN)
    """The writer's signature over ``SIGN_CONTEXT`` and :attr:`root`."""

    def __post_init__(self) -> None:
        _check_name(self.name)
        _check(0 <= self.version < MAX_VERSION, "version out of range")
        _check(len(self.writer_key) == KEY_LEN, "bad writer key")
        _check(len(self.signature) == SIGNATURE_LEN, "bad signature")
        _check(0 <= self.total_bytes <= MAX_OBJECT_BYTES, "object too large")
        _check(MIN_PIECE_BYTES <= self.piece_bytes <= MAX_PIECE_BYTES, "bad piece size")
        _check(len(self.compat) == DIGEST_LEN, "bad compat digest")
        pieces = -(-self.total_bytes // self.piece_bytes)
        _check(len(self.hashes) == pieces, "piece count does not match the size")
        _check(all(len(h) == DIGEST_LEN for h in self.hashes), "bad piece digest")

    @property
    def pieces(self) -> int:
        return len(self.hashes)

    @property
    def root(self) -> bytes:
        return digest(_unsigned_manifest(self))

    @property
    def writer(self) -> str:
        """The writer's peer ID ("" for an unsigned manifest)."""
        return "" if self.writer_key == UNSIGNED_KEY else peer_id_of(self.writer_key)

    def signed(self, public_key: bytes, sign: Callable[[bytes], bytes]) -> Manifest:
        """This manifest written by the holder of ``public_key`` (``sign``: its key's)."""
        keyed = replace(self, writer_key=public_key, signature=bytes(SIGNATURE_LEN))
        return replace(keyed, signature=sign(SIGN_CONTEXT + keyed.root))

    def verify(self) -> bool:
        """Whether the signature is its writer key's over this manifest."""
        if self.writer_key == UNSIGNED_KEY:
            return False
        try:
            key = Ed25519PublicKey.from_public_bytes(self.writer_key)
            key.verify(self.signature, SIGN_CONTEXT + self.root)
        except (InvalidSignature, ValueError):
            return False
        return True

    def piece_span(self, index: int) -> tuple[int, int]:
        start = index * self.piece_bytes
        return start, min(self.total_bytes, start + self.piece_bytes)

    def check_piece(self, index: int, data: bytes | bytearray | memoryview) -> bool:
        start, end = self.piece_span(index)
        return len(data) == end - start and digest(data) == self.hashes[index]

    @classmethod
    def build(
        cls,
        name: str,
        version: int,
        data: bytes | bytearray | memoryview,
        piece_bytes: int,
        compat: bytes | None = None,
    ) -> Manifest:
        """The manifest of ``data``; ``compat`` None: only this exact content (the
        digest of the piece digests) mixes with it."""
        view = memoryview(data)
        hashes = tuple(digest(view[i : i + piece_bytes]) for i in range(0, len(view), piece_bytes))
        if compat is None:
            compat = digest(b"".join(hashes) + U64.pack(len(view)))
        return cls(name, version, len(view), piece_bytes, compat, hashes)


@dataclass(frozen=True, slots=True)
class Query:
    name: str
    min_version: int
    token: int
    writer: str = ""
    """Only this writer's versions (a peer ID); empty: any writer's."""
    max_version: int = ANY_VERSION
    """No version above this (a joiner's window of the run's steps)."""
    root: bytes = ANY_ROOT
    """Only this exact object (a HOLD's); zeros: any."""


@dataclass(frozen=True, slots=True)
class NoneHeld:
    name: str
    token: int


@dataclass(frozen=True, slots=True)
class Offer:
    token: int
    load: int
    manifest: Manifest


@dataclass(frozen=True, slots=True)
class Get:
    name: str
    version: int
    root: bytes
    indices: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Piece:
    name: str
    version: int
    root: bytes
    index: int
    data: bytes | memoryview


@dataclass(frozen=True, slots=True)
class Ref:
    """BUSY, HOLD, HELD, FINISHED and GONE: one exact object."""

    kind: StoreKind
    name: str
    version: int
    root: bytes


Message = Query | NoneHeld | Offer | Get | Piece | Ref


def is_data(msg: Message) -> bool:
    return isinstance(msg, Offer | Piece)


def encode(msg: Message) -> bytes:
    w = Writer()
    w.raw(MAGIC)
    w.u8(VERSION)
    if isinstance(msg, Query):
        w.u8(StoreKind.QUERY)
        _name(w, msg.name)
        w.u64(msg.min_version)
        w.u32(msg.token)
        w.str8(msg.writer, MAX_WRITER_BYTES, "writer")
        w.u64(msg.max_version)
        _check(len(msg.root) == DIGEST_LEN, "bad root digest")
        w.raw(msg.root)
    elif isinstance(msg, NoneHeld):
        w.u8(StoreKind.NONE)
        _name(w, msg.name)
        w.u32(msg.token)
    elif isinstance(msg, Offer):
        w.u8(StoreKind.OFFER)
        w.u32(msg.token)
        w.u16(min(msg.load, 0xFFFF))
        w.raw(encode_manifest(msg.manifest))
    elif isinstance(msg, Get):
        _check(len(msg.indices) <= MAX_GET_PIECES, "too many pieces in one GET")
        w.u8(StoreKind.GET)
        _ref(w, msg.name, msg.version, msg.root)
        w.u16(len(msg.indices))
        for i in msg.indices:
            w.u32(i)
    elif isinstance(msg, Piece):
        _check(len(msg.data) <= MAX_PIECE_BYTES, "piece too large")
        w.u8(StoreKind.PIECE)
        _ref(w, msg.name, msg.version, msg.root)
        w.u32(msg.index)
        w.raw(msg.data)
    else:
        w.u8(msg.kind)
        _ref(w, msg.name, msg.version, msg.root)
    return w.getvalue()


def encode_manifest(m: Manifest) -> bytes:
    return _unsigned_manifest(m) + m.signature


def _unsigned_manifest(m: Manifest) -> bytes:
    w = Writer()
    _name(w, m.name)
    w.u64(m.version)
    w.u64(m.total_bytes)
    w.u32(m.piece_bytes)
    w.raw(m.compat)
    w.u32(len(m.hashes))
    w.raw(b"".join(m.hashes))
    w.raw(m.writer_key)
    return w.getvalue()


def _name(w: Writer, name: str) -> None:
    w.str8(name, MAX_NAME_BYTES, "object name")


def _read_name(r: Reader) -> str:
    name = r.str8(MAX_NAME_BYTES, "object name")
    _check_name(name)
    return name


def decode(data: bytes | memoryview) -> Message:
    """One store message; :class:`StoreWireError` for anything else."""
    try:
        return _decode(data)
    except ValueError as exc:  # a field out of range (names, sizes)
        raise StoreWireError(f"bad store message: {exc}") from None


def _decode(data: bytes | memoryview) -> Message:
    if len(data) > MAX_DATA_BYTES:
        raise StoreWireError(f"store message of {len(data)} bytes is over the limit")
    r = Reader(data, StoreWireError)
    if bytes(r.take(2)) != MAGIC:
        raise StoreWireError("not a store message (magic)")
    if not OLDEST_VERSION <= (version := r.u8()) <= VERSION:
        raise StoreWireError(f"store message version {version} is not supported")
    try:
        kind = StoreKind(r.u8())
    except ValueError:
        raise StoreWireError("unknown store message kind") from None
    msg: Message
    if kind is StoreKind.QUERY:
        name, min_version, token = _read_name(r), r.u64(), r.u32()
        if version == 1:
            msg = Query(name, min_version, token)
        else:
            writer = r.str8(MAX_WRITER_BYTES, "writer")
            _check(writer.isprintable(), "writers are printable")
            max_version = r.u64()
            msg = Query(name, min_version, token, writer, max_version, r.raw(DIGEST_LEN))
    elif kind is StoreKind.NONE:
        msg = NoneHeld(_read_name(r), r.u32())
    elif kind is StoreKind.OFFER:
        if version == 1:
            raise StoreWireError("a version 1 offer is unsigned: not taken")
        token, load = r.u32(), r.u16()
        msg = Offer(token, load, _manifest(r))
    elif kind is StoreKind.GET:
        name, version, root = _read_name(r), r.u64(), bytes(r.take(DIGEST_LEN))
        count = r.u16()
        if count > MAX_GET_PIECES:
            raise StoreWireError("too many pieces in one GET")
        msg = Get(name, version, root, tuple(r.u32() for _ in range(count)))
    elif kind is StoreKind.PIECE:
        name, version, root = _read_name(r), r.u64(), bytes(r.take(DIGEST_LEN))
        index = r.u32()
        piece = r.rest()
        if len(piece) > MAX_PIECE_BYTES:
            raise StoreWireError("piece too large")
        msg = Piece(name, version, root, index, piece)
    else:
        msg = Ref(kind, _read_name(r), r.u64(), bytes(r.take(DIGEST_LEN)))
    r.end("store message")
    return msg


def _manifest(r: Reader) -> Manifest:
    name, version, total, piece_bytes = _read_name(r), r.u64(), r.u64(), r.u32()
    compat = bytes(r.take(DIGEST_LEN))
    count = r.u32()
    if count > MAX_PIECES:
        raise StoreWireError("too many pieces in a manifest")
    hashes = tuple(bytes(r.take(DIGEST_LEN)) for _ in range(count))
    writer_key, signature = r.raw(KEY_LEN), r.raw(SIGNATURE_LEN)
    try:
        return Manifest(name, version, total, piece_bytes, compat, hashes, writer_key, signature)
    except ValueError as exc:
        raise StoreWireError(f"bad manifest: {exc}") from None


def _ref(w: Writer, name: str, version: int, root: bytes) -> None:
    _check(len(root) == DIGEST_LEN, "bad root digest")
    _name(w, name)
    w.u64(version)
    w.raw(root)


def _check_name(name: str) -> None:
    _check(0 < len(name.encode("utf-8")) <= MAX_NAME_BYTES, "bad object name")
    _check(name.isprintable(), "object names are printable")


def _check(ok: bool, why: str) -> None:
    if not ok:
        raise ValueError(why)
