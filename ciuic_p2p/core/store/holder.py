"""This node's side of the shared store: the objects it holds and its uploads. Pure:
no clock, no I/O (``now`` comes in, messages come out; the daemon's adapter is
daemon.store).

:class:`Holder` keeps this node's objects (for each name and writer, the newest
version, and an older one while an upload still reads it) and answers queries and
piece requests. A name's versions are kept per writer (the peer whose key signed the
manifest, core.store.messages): a member that writes a name at a higher version
displaces only its own versions of it, never another writer's, and this node's own
copies are never dropped for another writer's. A version more than
``store.max_version_jump`` above the newest held of a name is not taken from others
(:meth:`Holder.jump_refused`): nobody publishes "the newest forever". It
serves ``upload_slots`` fetchers at a time and answers the rest BUSY, so that several
joiners at once spread over several donors instead of choking one (the failure
hivemind's state download has, its issue #169). A GET's indices are taken once each,
and at most ``max_upload_queue_bytes`` of pieces not yet sent wait for one peer (the
rest is answered BUSY): a member that asks for everything, again and again, gets what
one honest fetcher would.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass

from ciuic_p2p.config.sections import StoreSection
from ciuic_p2p.core.link.keys import peer_id_of
from ciuic_p2p.core.store.messages import (
    ANY_ROOT,
    UNSIGNED_KEY,
    Get,
    Manifest,
    NoneHeld,
    Offer,
    Piece,
    Query,
    Ref,
    StoreKind,
)


@dataclass(slots=True)
class Held:
    manifest: Manifest
    data: bytes
    root: bytes
    offered_s: float = float("-inf")
    """When this version was last offered: kept a while for the fetcher that asked."""


OFFER_HOLD_S = 30.0
"""An offered version stays held this long after its offer, though a newer one came
(a fetcher asks for what it was offered)."""
MAX_VERSIONS = 3


@dataclass(slots=True)
class _Upload:
    root: bytes
    last_s: float


class Holder:
    """This node's objects and its side of uploads."""

    def __init__(
        self,
        settings: StoreSection,
        public_key: bytes = UNSIGNED_KEY,
        sign: Callable[[bytes], bytes] | None = None,
    ) -> None:
        """``public_key`` and ``sign``: this node's, for the objects it writes (none:
        unsigned manifests, which no daemon takes; core tests only)."""
        self.settings = settings
        self.public_key = public_key
        self._sign = sign
        self.writer = "" if public_key == UNSIGNED_KEY else peer_id_of(public_key)
        """This node's peer ID as a writer ("" when it does not sign)."""
        self.objects: dict[str, list[Held]] = {}
        self.uploads: dict[str, _Upload] = {}
        self.counters: collections.Counter[str] = collections.Counter()

    def put(
        self,
        name: str,
        version: int,
        data: bytes,
        compat: bytes | None = None,
        now: float | None = None,
    ) -> Manifest:
        """Hold ``data`` as ``name`` at ``version`` (replacing older versions once no
        upload reads them and no recent offer named them)."""
        manifest = Manifest.build(name, version, data, self.settings.piece_bytes, compat)
        if self._sign is not None:
            manifest = manifest.signed(self.public_key, self._sign)
        self._keep(Held(manifest, bytes(data), manifest.root), now)
        return manifest

    def put_held(self, manifest: Manifest, data: bytes, now: float | None = None) -> bool:
        """Hold another writer's exact object: ``data`` must be what ``manifest`` (its
        writer's, checked by the caller) describes, piece by piece; False if it is not."""
        view = memoryview(data)
        if len(view) != manifest.total_bytes or not all(
            manifest.check_piece(i, view[slice(*manifest.piece_span(i))])
            for i in range(manifest.pieces)
        ):
            return False
        self._keep(Held(manifest, bytes(data), manifest.root), now)
        return True

    def _keep(self, held: Held, now: float | None) -> None:
        m = held.manifest
        versions = [
            h
            for h in self.objects.get(m.name, [])
            if h.manifest.version != m.version or h.manifest.writer != m.writer
        ]
        self.objects[m.name] = [*versions, held]
        self._trim(m.name, now)

    def remove(self, name: str, writer: str) -> int:
        """Drop every version of ``name`` that ``writer`` wrote held here; how many.
        Another writer's are kept (one writer's versions never touch another's). A
        fetcher reading one is answered GONE at its next request, and tries a donor
        that still holds it."""
        versions = self.objects.get(name, [])
        kept = [h for h in versions if h.manifest.writer != writer]
        if kept:
            self.objects[name] = kept
        else:
            self.objects.pop(name, None)
        return len(versions) - len(kept)

    def bytes_held(self) -> int:
        return sum(len(h.data) for versions in self.objects.values() for h in versions)

    def newest(
        self, name: str, writer: str | None = None, max_version: int | None = None
    ) -> Held | None:
        """The newest version of ``name`` held here: of ``writer`` (None: any writer,
        this node's own first among equals), at most ``max_version``."""
        versions = [
            h
            for h in self.objects.get(name, ())
            if (writer is None or h.manifest.writer == writer)
            and (max_version is None or h.manifest.version <= max_version)
        ]
        mine = self.writer
        return (
            max(versions, key=lambda h: (h.manifest.version, h.manifest.writer == mine))
            if versions
            else None
        )

    def jump_refused(self, name: str, version: int) -> bool:
        """Whether ``version`` of ``name``, someone else's, is more than
        ``store.max_version_jump`` above the newest version of it held here."""
        newest = self.newest(name)
        return (
            newest is not None
            and version > newest.manifest.version + self.settings.max_version_jump
        )

    def find_root(self, name: str, root: bytes) -> Held | None:
        for held in self.objects.get(name, ()):
            if held.root == root:
                return held
        return None

    def find(self, name: str, version: int, root: bytes) -> Held | None:
        for held in self.objects.get(name, ()):
            if held.manifest.version == version and held.root == root:
                return held
        return None

    def load(self, now: float) -> int:
        self._expire(now)
        return len(self.uploads)

    def on_query(self, query: Query, now: float) -> Offer | NoneHeld:
        """The object asked for (its root), or the newest version of the writer asked
        for within the query's versions; for any writer, this node's own (it answers
        for what it wrote), else the newest of all."""
        if query.root != ANY_ROOT:
            held = self.find_root(query.name, query.root)
        elif query.writer:
            held = self.newest(query.name, query.writer, query.max_version)
        else:
            held = self.newest(query.name, self.writer, query.max_version) if self.writer else None
            if held is None or held.manifest.version < query.min_version:
                held = self.newest(query.name, None, query.max_version)
        self.counters["queries"] += 1
        if held is None or held.manifest.version < query.min_version:
            return NoneHeld(query.name, query.token)
        held.offered_s = now
        return Offer(query.token, self.load(now), held.manifest)

    def on_get(self, peer: str, get: Get, now: float, queued_bytes: int = 0) -> list[Piece] | Ref:
        """The pieces asked for, each once, while ``queued_bytes`` (what waits for
        ``peer`` already) plus them stays within ``max_upload_queue_bytes``; BUSY when
        none fits or every upload slot is taken; GONE for a version not held (any
        more) or an index out of range."""
        held = self.find(get.name, get.version, get.root)
        self._expire(now)
        upload = self.uploads.get(peer)
        busy = Ref(StoreKind.BUSY, get.name, get.version, get.root)
        if held is None or any(i >= held.manifest.pieces for i in get.indices):
            self.counters["gets_unknown"] += 1
            return Ref(StoreKind.GONE, get.name, get.version, get.root)
        if upload is None and len(self.uploads) >= self.settings.upload_slots:
            self.counters["gets_busy"] += 1
            return busy
        indices = list(dict.fromkeys(get.indices))
        self.counters["get_repeats"] += len(get.indices) - len(indices)
        view = memoryview(held.data)
        pieces: list[Piece] = []
        room = self.settings.max_upload_queue_bytes - queued_bytes
        for i in indices:
            start, end = held.manifest.piece_span(i)
            if end - start > room:
                self.counters["get_over_queue"] += len(indices) - len(pieces)
                break
            room -= end - start
            pieces.append(Piece(get.name, get.version, get.root, i, view[start:end]))
        if not pieces:
            return busy
        self.uploads[peer] = _Upload(held.root, now)
        self.counters["pieces_served"] += len(pieces)
        return pieces

    def finished(self, peer: str) -> None:
        self.uploads.pop(peer, None)

    def _expire(self, now: float) -> None:
        idle = self.settings.upload_idle_s
        for peer in [p for p, u in self.uploads.items() if now - u.last_s > idle]:
            del self.uploads[peer]
        for name in list(self.objects):
            self._trim(name, now)

    def _trim(self, name: str, now: float | None = None) -> None:
        """For each writer of ``name``: keep its newest version, those an upload reads,
        and (up to MAX_VERSIONS of that writer) those offered in the last
        OFFER_HOLD_S. One writer's versions never push out another's."""
        by_writer: dict[str, list[Held]] = {}
        for h in self.objects[name]:
            by_writer.setdefault(h.manifest.writer, []).append(h)
        reading = {u.root for u in self.uploads.values()}
        kept: list[Held] = []
        for held in by_writer.values():
            versions = sorted(held, key=lambda h: -h.manifest.version)
            keep = [versions[0]] + [h for h in versions[1:] if h.root in reading]
            for h in versions[1:]:
                recent = now is not None and now - h.offered_s <= OFFER_HOLD_S
                if h not in keep and recent and len(keep) < MAX_VERSIONS:
                    keep.append(h)
            kept += keep
        self.objects[name] = kept
