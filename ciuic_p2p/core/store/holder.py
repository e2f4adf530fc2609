"""This node's side of the shared store: the objects it holds and its uploads. Pure:
no clock, no I/O (``now`` comes in, messages come out; the daemon's adapter is
daemon.store).

:class:`Holder` keeps this node's objects (the newest version of each name, and an
older one while an upload still reads it) and answers queries and piece requests. It
serves ``upload_slots`` fetchers at a time and answers the rest BUSY, so that several
joiners at once spread over several donors instead of choking one (the failure
hivemind's state download has, its issue #169). A GET's indices are taken once each,
and at most ``max_upload_queue_bytes`` of pieces not yet sent wait for one peer (the
rest is answered BUSY): a member that asks for everything, again and again, gets what
one honest fetcher would.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from ciuic_p2p.config.sections import StoreSection
from ciuic_p2p.core.store.messages import (
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

    def __init__(self, settings: StoreSection) -> None:
        self.settings = settings
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
        held = Held(manifest, bytes(data), manifest.root)
        versions = [h for h in self.objects.get(name, []) if h.manifest.version != version]
        self.objects[name] = [*versions, held]
        self._trim(name, now)
        return manifest

    def bytes_held(self) -> int:
        return sum(len(h.data) for versions in self.objects.values() for h in versions)

    def newest(self, name: str) -> Held | None:
        versions = self.objects.get(name)
        return max(versions, key=lambda h: h.manifest.version) if versions else None

    def find(self, name: str, version: int, root: bytes) -> Held | None:
        for held in self.objects.get(name, ()):
            if held.manifest.version == version and held.root == root:
                return held
        return None

    def load(self, now: float) -> int:
        self._expire(now)
        return len(self.uploads)

    def on_query(self, query: Query, now: float) -> Offer | NoneHeld:
        held = self.newest(query.name)
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
        """Keep the newest version, those an upload reads, and (up to MAX_VERSIONS in
        all) those offered in the last OFFER_HOLD_S."""
        versions = sorted(self.objects[name], key=lambda h: -h.manifest.version)
        reading = {u.root for u in self.uploads.values()}
        keep = [versions[0]] + [h for h in versions[1:] if h.root in reading]
        for h in versions[1:]:
            recent = now is not None and now - h.offered_s <= OFFER_HOLD_S
            if h not in keep and recent and len(keep) < MAX_VERSIONS:
                keep.append(h)
        self.objects[name] = keep
