"""Wire format of mesh messages: membership, link state and chunk dissemination.

One message per GOSSIP frame (or per datagram on the simulator). Layout::

    version u8 (2) | kind u8 | sender id (str8) | body

``str8`` is a u8 length and UTF-8 bytes; ``bytes16``/``bytes32`` a u16/u32 length and
bytes; ``sig`` 64 bytes (Ed25519); all integers little-endian. Bodies by kind:

- ``PING``: seq u32, target str8, coordinate, links digest u32, updates
- ``ACK``: seq u32, coordinate, links digest u32, updates
- ``PING_REQ``: seq u32, target str8, target address str8 (ignored since version 2:
  the helper probes the address the target itself signed)
- ``NACK``: seq u32
- ``GOSSIP``: updates
- ``SYNC``: reply u8, updates (the sender's whole member table, as ALIVE/SUSPECT/DEAD/
  LEFT updates with each member's CREDENTIAL, plus link state)
- ``CHUNK``: origin str8, seq u64, hops u8, payload bytes32, sig
- ``ROUTED_CHUNK``: origin str8, seq u64, hops u8, route u8, payload bytes32, sig: a
  chunk that names how it spreads (``route``, 1 to ``MAX_ROUTE``: the strategy of
  core.mesh.linkcosts.STRATEGIES by its code; a ``CHUNK`` is route 0, ``tree``)
- ``PLANNED_CHUNK``: origin str8, seq u64, hops u8, route u8 (0 to ``MAX_ROUTE``), plan
  count u8 (1 to ``MAX_PLAN_NODES``), then per planned node: node str8, parent u8 (0:
  the origin; i: the i-th planned node, which comes before it), payload bytes32 (at least
  ``MIN_PLANNED_PAYLOAD_BYTES``), sig: a
  chunk that carries the tree its origin planned for it, so that every relay forwards
  it by one plan, not by the trees of the published state each holds when it arrives
- ``HEADS``: count u16, then per origin: origin str8, high u64 (highest seq held)
- ``WANT``: origin str8, count u16, seqs u64 each

``updates`` is a u16 count, then per update a u8 type and its fields:
ALIVE (id, incarnation u64, address str8, region str8, sig), NAMED_ALIVE (the same
with the node's name str8, of at most ``MAX_NAME_BYTES`` of printable ASCII,
before the sig), SUSPECT / DEAD (id,
incarnation u64, by str8), LEFT (id, incarnation u64, sig), LINKS (origin str8, version
u32, u16 count, then peer str8, rtt_us u32, loss_permille u16 each, sig), RATED_LINKS
(the same with rate_kbps u32 after each entry's loss, at most 10^9), CREDENTIAL
(id, credential bytes16: the member's node certificate, DER). A coordinate is eight
f32 components, height f32 and error f32.

What each signature covers (:func:`signed_bytes`; domain-separated, so that no
signature of one kind is valid as another, nor as any other message the node key
signs): an ALIVE, a LEFT and a LINKS (or RATED_LINKS) by the node they are about (only
a node may say where it is, that it left, or what its links measure); a CHUNK by its
origin, over the origin, the sequence number (and so its session) and the payload's
BLAKE2b-256; a ROUTED_CHUNK the same and its route, so that no relay can send it
down another strategy's trees; a PLANNED_CHUNK the same, its route and its plan, so
that no relay can change who forwards it to whom. The
accusations SUSPECT and DEAD are any member's word and are signed by nobody: a node
takes them only at the incarnation its subject signed (core.mesh.membership).

Version 2 added the signatures, CREDENTIAL and the incarnation bound; a version-1
message is refused with the version named. Kinds and update types are append-only.
Decoding trusts nothing: every length is checked against what remains and against the
hard limits before use, every value is range-checked (an incarnation above
``MAX_INCARNATION``, a loss above 1000 permille, a non-finite coordinate), and every
failure is a :class:`MeshDecodeError`.
"""

from __future__ import annotations

import enum
import hashlib
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass, field

from ciuic_p2p.core.binary import U16, Reader, Writer
from ciuic_p2p.core.codec.chunk import MAX_CHUNK_BYTES
from ciuic_p2p.errors import CiuicError

VERSION = 2
MAX_NAME_BYTES = 64
"""A node's name on the wire (UTF-8)."""
MAX_MESSAGE_BYTES = 64 * 1024 - 16
"""Control messages fit one GOSSIP frame (core.link.frames)."""
MAX_PLAN_NODES = 64
"""Nodes a carried plan names, at most (an origin with a larger view sends no plan)."""
MAX_PLAN_BYTES = 4096
"""A carried plan's bytes on the wire, at most: 64 names of up to 61 bytes."""
MIN_PLANNED_PAYLOAD_BYTES = 64 * 1024 + 1
"""Only a large piece carries a plan (core.mesh.planners' ``LARGE_PIECE_BYTES``; a test
holds the two together): a plan on a small chunk would cost more than its payload and
is refused."""
MAX_CHUNK_MESSAGE_BYTES = MAX_CHUNK_BYTES + 512 + MAX_PLAN_BYTES
MAX_ROUTE = 2
"""The highest route code a ROUTED_CHUNK may name: core.mesh.linkcosts' last (a test
holds the two together)."""
MAX_ID_BYTES = 128
MAX_UPDATES = 4096
MAX_LINKS = 1024
MAX_RATE_KBPS = 1_000_000_000
"""1 Tbit/s: a link rate claimed above it is refused (the field is a u32)."""
MAX_HEADS = 4096
MAX_WANT = 256
MAX_CREDENTIAL_BYTES = 2048
COORD_DIMENSIONS = 8
SIGNATURE_BYTES = 64
MAX_INCARNATION = (1 << 40) - 1
"""A node raises its incarnation by one per refutation and per restart: 2^40 is more
than it can use, and whatever carries it (the dissemination session, the trainer's
incarnation times 2^20) has room. A larger number on the wire is an error."""


class MeshDecodeError(CiuicError):
    """Bytes that are not a valid mesh message; the message says what was wrong."""


class MeshKind(enum.IntEnum):
    PING = 1
    ACK = 2
    PING_REQ = 3
    NACK = 4
    GOSSIP = 5
    SYNC = 6
    CHUNK = 7
    HEADS = 8
    WANT = 9
    ROUTED_CHUNK = 10
    PLANNED_CHUNK = 11


class UpdateType(enum.IntEnum):
    ALIVE = 1
    SUSPECT = 2
    DEAD = 3
    LEFT = 4
    LINKS = 5
    CREDENTIAL = 6
    NAMED_ALIVE = 7
    """An ALIVE with the node's name (appended in version 2 of the package's wire)."""
    RATED_LINKS = 8
    """A LINKS whose entries also carry the rate measured from each peer (appended)."""


@dataclass(frozen=True, slots=True)
class Coordinate:
    """A Vivaldi network coordinate (core.mesh.vivaldi); seconds."""

    vec: tuple[float, ...] = (0.0,) * COORD_DIMENSIONS
    height_s: float = 1e-5
    error: float = 1.5


@dataclass(frozen=True, slots=True)
class Alive:
    """A node's own word that it lives at ``address`` with ``incarnation``, signed by
    it (``signature``, over :func:`signed_bytes`)."""

    node: str
    incarnation: int
    address: str
    region: str = ""
    signature: bytes = b""
    name: str = ""
    """The name its operator gave it (``node.name``), shown beside its peer ID; sent
    as NAMED_ALIVE when set."""


@dataclass(frozen=True, slots=True)
class Suspect:
    node: str
    incarnation: int
    by: str


@dataclass(frozen=True, slots=True)
class Dead:
    node: str
    incarnation: int
    by: str


@dataclass(frozen=True, slots=True)
class Left:
    """A node's own word that it left for good, signed by it."""

    node: str
    incarnation: int
    signature: bytes = b""


@dataclass(frozen=True, slots=True)
class Credential:
    """The node certificate (DER) that binds ``node`` to its public key; carried with
    a member's first signed Alive, so that a node that never linked to it can check
    what it signs."""

    node: str
    credential: bytes


@dataclass(frozen=True, slots=True)
class LinkEntry:
    peer: str
    rtt_us: int
    loss_permille: int = 0
    rate_kbps: int = 0
    """The rate ``peer``'s bytes reach the origin, kbit/s (core.link.throughput);
    0: not measured. Any entry with a rate makes the update a RATED_LINKS."""


@dataclass(frozen=True, slots=True)
class Links:
    """One node's measured links (link state), newest ``version`` wins."""

    origin: str
    version: int
    entries: tuple[LinkEntry, ...]
    signature: bytes = b""


Update = Alive | Suspect | Dead | Left | Links | Credential


@dataclass(frozen=True, slots=True)
class Ping:
    seq: int
    target: str
    coordinate: Coordinate
    links_digest: int = 0
    """CRC-32 of the sender's link-state versions: a mismatch makes the two exchange
    their link state (core.mesh.membership), so that every node's map converges."""
    updates: tuple[Update, ...] = ()


@dataclass(frozen=True, slots=True)
class Ack:
    seq: int
    coordinate: Coordinate
    links_digest: int = 0
    updates: tuple[Update, ...] = ()


@dataclass(frozen=True, slots=True)
class PingReq:
    seq: int
    target: str
    target_address: str


@dataclass(frozen=True, slots=True)
class Nack:
    seq: int


@dataclass(frozen=True, slots=True)
class Gossip:
    updates: tuple[Update, ...]


@dataclass(frozen=True, slots=True)
class Sync:
    reply: bool
    updates: tuple[Update, ...]


Plan = tuple[tuple[str, int], ...]
"""A dissemination tree as an origin carries it: (node, parent) in order, where parent
0 is the origin and i the i-th node of the plan, which comes earlier (so a plan has no
cycle and names every node once)."""


@dataclass(frozen=True, slots=True)
class Chunk:
    """One disseminated payload; ``signature`` is its origin's (:func:`signed_bytes`),
    checked by every node before it delivers, forwards or counts the chunk as held."""

    origin: str
    seq: int
    hops: int
    payload: bytes
    signature: bytes = b""
    route: int = 0
    """How it spreads: the code of its strategy (core.mesh.strategy), 0 ``tree``."""
    plan: Plan = ()
    """The tree its origin planned for it (:data:`Plan`); empty: every relay forwards it
    by its own trees of ``route``."""


@dataclass(frozen=True, slots=True)
class Heads:
    heads: tuple[tuple[str, int], ...]


@dataclass(frozen=True, slots=True)
class Want:
    origin: str
    seqs: tuple[int, ...]


Body = Ping | Ack | PingReq | Nack | Gossip | Sync | Chunk | Heads | Want


@dataclass(frozen=True, slots=True)
class Message:
    sender: str
    body: Body
    kind: MeshKind = field(init=False)

    def __post_init__(self) -> None:
        body = self.body
        kind = None
        if isinstance(body, Chunk) and body.plan:
            kind = MeshKind.PLANNED_CHUNK
        elif isinstance(body, Chunk) and body.route:
            kind = MeshKind.ROUTED_CHUNK
        object.__setattr__(self, "kind", kind or _KIND_OF[type(body)])


_KIND_OF: dict[type, MeshKind] = {
    Ping: MeshKind.PING,
    Ack: MeshKind.ACK,
    PingReq: MeshKind.PING_REQ,
    Nack: MeshKind.NACK,
    Gossip: MeshKind.GOSSIP,
    Sync: MeshKind.SYNC,
    Chunk: MeshKind.CHUNK,
    Heads: MeshKind.HEADS,
    Want: MeshKind.WANT,
}
_COORD = struct.Struct(f"<{COORD_DIMENSIONS + 2}f")


# -- encoding ---------------------------------------------------------------------------


class _Writer(Writer):
    """The mesh's fields on top of core.binary's."""

    def str8(self, s: str, max_bytes: int = MAX_ID_BYTES, what: str = "identifier") -> None:
        super().str8(s, max_bytes, what)

    def coord(self, c: Coordinate) -> None:
        self.parts.append(_COORD.pack(*c.vec, c.height_s, c.error))

    def sig(self, signature: bytes) -> None:
        if len(signature) != SIGNATURE_BYTES:
            raise ValueError(f"a signature is {SIGNATURE_BYTES} bytes, not {len(signature)}")
        self.parts.append(bytes(signature))

    def bytes16(self, data: bytes, limit: int) -> None:
        if len(data) > limit:
            raise ValueError(f"{len(data)} bytes exceed the limit of {limit}")
        self.parts.append(U16.pack(len(data)) + bytes(data))

    def updates(self, updates: tuple[Update, ...]) -> None:
        self.u16(len(updates))
        for u in updates:
            self.parts.append(encode_update(u))

    def plan(self, plan: Plan) -> None:
        if not 0 < len(plan) <= MAX_PLAN_NODES:
            raise ValueError(f"a plan names 1 to {MAX_PLAN_NODES} nodes, not {len(plan)}")
        start = len(self.parts)
        self.u8(len(plan))
        for i, (node, parent) in enumerate(plan):
            if not 0 <= parent <= i:
                raise ValueError(f"plan entry {i + 1} names parent {parent}, not 0..{i}")
            self.str8(node)
            self.u8(parent)
        size = sum(len(p) for p in self.parts[start:])
        if size > MAX_PLAN_BYTES:
            raise ValueError(f"a plan of {size} bytes exceeds {MAX_PLAN_BYTES}")


def _signed_part(u: Alive | Left | Links) -> _Writer:
    """An update's fields without its signature (what the signature covers)."""
    w = _Writer()
    if isinstance(u, Alive):
        w.str8(u.node)
        w.u64(u.incarnation)
        w.str8(u.address)
        w.str8(u.region)
        if u.name:
            w.str8(u.name, MAX_NAME_BYTES, "name")
    elif isinstance(u, Left):
        w.str8(u.node)
        w.u64(u.incarnation)
    else:
        w.str8(u.origin)
        w.u32(u.version)
        w.u16(len(u.entries))
        rated = _rated(u)
        for e in u.entries:
            w.str8(e.peer)
            w.u32(min(e.rtt_us, 0xFFFFFFFF))
            w.u16(min(e.loss_permille, 1000))
            if rated:
                w.u32(min(max(0, e.rate_kbps), MAX_RATE_KBPS))
    return w


def _rated(u: Links) -> bool:
    return any(e.rate_kbps > 0 for e in u.entries)


_DOMAINS = {
    Alive: b"ciuic-mesh-alive-v2\0",
    Left: b"ciuic-mesh-left-v2\0",
    Links: b"ciuic-mesh-links-v2\0",
    Chunk: b"ciuic-mesh-chunk-v2\0",
}


NAMED_ALIVE_DOMAIN = b"ciuic-mesh-alive-named-v2\0"
RATED_LINKS_DOMAIN = b"ciuic-mesh-links-rated-v2\0"
ROUTED_CHUNK_DOMAIN = b"ciuic-mesh-chunk-routed-v2\0"
PLANNED_CHUNK_DOMAIN = b"ciuic-mesh-chunk-planned-v2\0"
CHUNK_KINDS = frozenset({MeshKind.CHUNK, MeshKind.ROUTED_CHUNK, MeshKind.PLANNED_CHUNK})
"""The kinds that carry a chunk (MESH_CHUNK frames, their own size limit)."""


def payload_digest(payload: bytes | bytearray | memoryview) -> bytes:
    return hashlib.blake2b(payload, digest_size=32).digest()


def signed_bytes(u: Alive | Left | Links | Chunk, digest: bytes | None = None) -> bytes:
    """What the signature of ``u`` covers (see the module docstring). For a chunk,
    ``digest`` may pass the payload's BLAKE2b-256 when it is known already."""
    if isinstance(u, Chunk):
        w = _Writer()
        w.str8(u.origin)
        w.u64(u.seq)
        if u.plan:
            w.u8(u.route)
            w.plan(u.plan)
            domain = PLANNED_CHUNK_DOMAIN
        elif u.route:
            w.u8(u.route)
            domain = ROUTED_CHUNK_DOMAIN
        else:
            domain = _DOMAINS[Chunk]
        return domain + b"".join(w.parts) + (digest or payload_digest(u.payload))
    if isinstance(u, Alive) and u.name:
        domain = NAMED_ALIVE_DOMAIN
    elif isinstance(u, Links) and _rated(u):
        domain = RATED_LINKS_DOMAIN
    else:
        domain = _DOMAINS[type(u)]
    return domain + b"".join(_signed_part(u).parts)


def encode_update(u: Update) -> bytes:
    w = _Writer()
    if isinstance(u, Alive | Left | Links):
        kind = {Alive: UpdateType.ALIVE, Left: UpdateType.LEFT, Links: UpdateType.LINKS}[type(u)]
        if isinstance(u, Alive) and u.name:
            kind = UpdateType.NAMED_ALIVE
        elif isinstance(u, Links) and _rated(u):
            kind = UpdateType.RATED_LINKS
        w.u8(kind)
        w.parts += _signed_part(u).parts
        w.sig(u.signature)
    elif isinstance(u, Suspect | Dead):
        w.u8(UpdateType.SUSPECT if isinstance(u, Suspect) else UpdateType.DEAD)
        w.str8(u.node)
        w.u64(u.incarnation)
        w.str8(u.by)
    else:
        w.u8(UpdateType.CREDENTIAL)
        w.str8(u.node)
        w.bytes16(u.credential, MAX_CREDENTIAL_BYTES)
    return b"".join(w.parts)


def _write_chunk(w: _Writer, b: Chunk) -> None:
    w.str8(b.origin)
    w.u64(b.seq)
    w.u8(min(b.hops, 255))
    if b.route or b.plan:
        if not (0 if b.plan else 1) <= b.route <= MAX_ROUTE:
            raise ValueError(f"route {b.route} is not one of 1..{MAX_ROUTE}")
        w.u8(b.route)
    if b.plan:
        if len(b.payload) < MIN_PLANNED_PAYLOAD_BYTES:
            raise ValueError(f"a plan rides only on {MIN_PLANNED_PAYLOAD_BYTES}+ bytes")
        w.plan(b.plan)
    w.u32(len(b.payload))
    w.parts.append(bytes(b.payload))
    w.sig(b.signature)


def encode_message(msg: Message) -> bytes:
    w = _Writer()
    w.u8(VERSION)
    w.u8(msg.kind)
    w.str8(msg.sender)
    b = msg.body
    if isinstance(b, Ping):
        w.u32(b.seq)
        w.str8(b.target)
        w.coord(b.coordinate)
        w.u32(b.links_digest)
        w.updates(b.updates)
    elif isinstance(b, Ack):
        w.u32(b.seq)
        w.coord(b.coordinate)
        w.u32(b.links_digest)
        w.updates(b.updates)
    elif isinstance(b, PingReq):
        w.u32(b.seq)
        w.str8(b.target)
        w.str8(b.target_address)
    elif isinstance(b, Nack):
        w.u32(b.seq)
    elif isinstance(b, Gossip):
        w.updates(b.updates)
    elif isinstance(b, Sync):
        w.u8(1 if b.reply else 0)
        w.updates(b.updates)
    elif isinstance(b, Chunk):
        _write_chunk(w, b)
    elif isinstance(b, Heads):
        w.u16(len(b.heads))
        for origin, high in b.heads:
            w.str8(origin)
            w.u64(high)
    else:
        w.str8(b.origin)
        w.u16(len(b.seqs))
        for s in b.seqs:
            w.u64(s)
    data = b"".join(w.parts)
    limit = MAX_CHUNK_MESSAGE_BYTES if isinstance(b, Chunk) else MAX_MESSAGE_BYTES
    if len(data) > limit:
        raise ValueError(f"{msg.kind.name} message of {len(data)} bytes exceeds {limit}")
    return data


def update_size(u: Update) -> int:
    return len(encode_update(u))


# -- decoding ---------------------------------------------------------------------------


class _Reader(Reader):
    """The mesh's fields on top of core.binary's; every failure a MeshDecodeError."""

    def __init__(self, data: bytes) -> None:
        super().__init__(data, MeshDecodeError)

    def str8(self, max_bytes: int = MAX_ID_BYTES, what: str = "identifier") -> str:
        return super().str8(max_bytes, what)

    def coord(self) -> Coordinate:
        values = _COORD.unpack(self.take(_COORD.size))
        if not all(math.isfinite(v) and abs(v) < 1e6 for v in values):
            raise MeshDecodeError("coordinate out of range")
        height, error = values[-2], values[-1]
        if height < 0 or error < 0:
            raise MeshDecodeError("coordinate height or error negative")
        return Coordinate(tuple(values[:-2]), height, error)

    def plan(self, origin: str) -> Plan:
        """A carried plan: each parent earlier than its node, no node twice, the origin
        not among them, within ``MAX_PLAN_BYTES``."""
        start = self.pos
        n = self.u8()
        if not 0 < n <= MAX_PLAN_NODES:
            raise MeshDecodeError(f"a plan names 1 to {MAX_PLAN_NODES} nodes, not {n}")
        entries: list[tuple[str, int]] = []
        seen = {origin}
        for i in range(n):
            node, parent = self.str8(), self.u8()
            if parent > i:
                raise MeshDecodeError(f"plan entry {i + 1} names parent {parent}, not 0..{i}")
            if node in seen:
                raise MeshDecodeError("a plan names a node twice (or its origin)")
            seen.add(node)
            entries.append((node, parent))
            if self.pos - start > MAX_PLAN_BYTES:
                raise MeshDecodeError(f"a plan exceeds {MAX_PLAN_BYTES} bytes")
        return tuple(entries)

    def name(self) -> str:
        """A node's name: shown in terminals and logs, so no control characters."""
        value = self.str8(MAX_NAME_BYTES, "name")
        # ASCII: what is printable in Unicode differs between Python versions' tables,
        # and a name one member accepts must not make another drop its messages.
        if not value or not (value.isascii() and value.isprintable()):
            raise MeshDecodeError("a node name is printable ASCII")
        return value

    def incarnation(self) -> int:
        value = self.u64()
        if value > MAX_INCARNATION:
            raise MeshDecodeError(f"incarnation {value} exceeds {MAX_INCARNATION}")
        return value

    def sig(self) -> bytes:
        return bytes(self.take(SIGNATURE_BYTES))

    def updates(self) -> tuple[Update, ...]:
        return tuple(self.update() for _ in range(self.count(MAX_UPDATES, "updates")))

    def update(self) -> Update:
        t = self.u8()
        if t == UpdateType.ALIVE:
            return Alive(self.str8(), self.incarnation(), self.str8(), self.str8(), self.sig())
        if t == UpdateType.NAMED_ALIVE:
            node, incarnation, address, region = (
                self.str8(), self.incarnation(), self.str8(), self.str8()
            )  # fmt: skip
            name = self.name()
            return Alive(node, incarnation, address, region, self.sig(), name)
        if t == UpdateType.SUSPECT:
            return Suspect(self.str8(), self.incarnation(), self.str8())
        if t == UpdateType.DEAD:
            return Dead(self.str8(), self.incarnation(), self.str8())
        if t == UpdateType.LEFT:
            return Left(self.str8(), self.incarnation(), self.sig())
        if t in (UpdateType.LINKS, UpdateType.RATED_LINKS):
            rated = t == UpdateType.RATED_LINKS
            origin, version = self.str8(), self.u32()
            n = self.count(MAX_LINKS, "link entries")
            entries = []
            for _ in range(n):
                peer, rtt_us, loss = self.str8(), self.u32(), self.u16()
                if loss > 1000:
                    raise MeshDecodeError("loss above 1000 permille")
                rate_kbps = self.u32() if rated else 0
                if rate_kbps > MAX_RATE_KBPS:
                    raise MeshDecodeError(f"link rate {rate_kbps} kbit/s above 1 Tbit/s")
                entries.append(LinkEntry(peer, rtt_us, loss, rate_kbps))
            links = Links(origin, version, tuple(entries), self.sig())
            if rated and not _rated(links):  # one encoding per content: a signature
                raise MeshDecodeError("RATED_LINKS without a rate")  # checks one form
            return links
        if t == UpdateType.CREDENTIAL:
            node, n = self.str8(), self.u16()
            if n > MAX_CREDENTIAL_BYTES:
                raise MeshDecodeError(f"credential of {n} bytes exceeds {MAX_CREDENTIAL_BYTES}")
            return Credential(node, bytes(self.take(n)))
        raise MeshDecodeError(f"unknown update type {t}")


def _read_sync(r: _Reader) -> Sync:
    flag = r.u8()
    if flag > 1:
        raise MeshDecodeError("SYNC reply flag is not 0 or 1")
    return Sync(flag == 1, r.updates())


def _read_chunk(r: _Reader, routed: bool = False) -> Chunk:
    origin, seq, hops = r.str8(), r.u64(), r.u8()
    route = r.u8() if routed else 0
    if routed and not 0 < route <= MAX_ROUTE:
        raise MeshDecodeError(f"chunk route {route} is not one of 1..{MAX_ROUTE}")
    n = r.u32()
    if n > MAX_CHUNK_BYTES:
        raise MeshDecodeError(f"chunk payload of {n} bytes exceeds {MAX_CHUNK_BYTES}")
    return Chunk(origin, seq, hops, bytes(r.take(n)), r.sig(), route)


def _read_routed_chunk(r: _Reader) -> Chunk:
    return _read_chunk(r, routed=True)


def _read_planned_chunk(r: _Reader) -> Chunk:
    origin, seq, hops, route = r.str8(), r.u64(), r.u8(), r.u8()
    if route > MAX_ROUTE:
        raise MeshDecodeError(f"chunk route {route} is not one of 0..{MAX_ROUTE}")
    plan = r.plan(origin)
    n = r.u32()
    if not MIN_PLANNED_PAYLOAD_BYTES <= n <= MAX_CHUNK_BYTES:
        raise MeshDecodeError(
            f"a planned chunk's payload of {n} bytes is not "
            f"{MIN_PLANNED_PAYLOAD_BYTES}..{MAX_CHUNK_BYTES}"
        )
    return Chunk(origin, seq, hops, bytes(r.take(n)), r.sig(), route, plan)


def _read_heads(r: _Reader) -> Heads:
    n = r.count(MAX_HEADS, "heads")
    return Heads(tuple((r.str8(), r.u64()) for _ in range(n)))


def _read_want(r: _Reader) -> Want:
    origin = r.str8()
    n = r.count(MAX_WANT, "wanted seqs")
    return Want(origin, tuple(r.u64() for _ in range(n)))


# Fields are read left to right, so each tuple below is in wire order.
_BODY_READERS: dict[MeshKind, Callable[[_Reader], Body]] = {
    MeshKind.PING: lambda r: Ping(r.u32(), r.str8(), r.coord(), r.u32(), r.updates()),
    MeshKind.ACK: lambda r: Ack(r.u32(), r.coord(), r.u32(), r.updates()),
    MeshKind.PING_REQ: lambda r: PingReq(r.u32(), r.str8(), r.str8()),
    MeshKind.NACK: lambda r: Nack(r.u32()),
    MeshKind.GOSSIP: lambda r: Gossip(r.updates()),
    MeshKind.SYNC: _read_sync,
    MeshKind.CHUNK: _read_chunk,
    MeshKind.ROUTED_CHUNK: _read_routed_chunk,
    MeshKind.PLANNED_CHUNK: _read_planned_chunk,
    MeshKind.HEADS: _read_heads,
    MeshKind.WANT: _read_want,
}


def decode_message(data: bytes) -> Message:
    """Parse one message or raise :class:`MeshDecodeError`; never anything else."""
    if len(data) > MAX_CHUNK_MESSAGE_BYTES:
        raise MeshDecodeError(f"message of {len(data)} bytes exceeds every limit")
    r = _Reader(data)
    version = r.u8()
    if version != VERSION:
        raise MeshDecodeError(f"unsupported mesh message version {version}")
    raw_kind = r.u8()
    try:
        kind = MeshKind(raw_kind)
    except ValueError:
        raise MeshDecodeError(f"unknown message kind {raw_kind}") from None
    if kind not in CHUNK_KINDS and len(data) > MAX_MESSAGE_BYTES:
        raise MeshDecodeError(f"{kind.name} message of {len(data)} bytes exceeds its limit")
    sender = r.str8()
    body = _BODY_READERS[kind](r)
    r.end(kind.name)
    return Message(sender, body)
