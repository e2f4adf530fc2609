"""The chunks a node holds for repair, and how long it holds them.

A delivered chunk is kept for ``chunk_retain_s`` so that a member whose relay died can
still fetch it (core.mesh.broadcast's repair); its origin keeps its own for
``own_chunk_retain_s`` (a round of large pieces on slow links outlasts 30 s, and the
origin is where a late ask always ends up). All of it within ``chunk_retain_bytes``:
this node's own chunks in at most half of it (a node publishing faster than that
bound over ``own_chunk_retain_s`` would otherwise hold nobody else's chunks to repair
from), and past the bound others' go first (their origins keep them). The order is
when a chunk was kept: asking for a chunk keeps it no longer (a member's asks would
pin chunks and push honest ones out).
"""

from __future__ import annotations

from collections import OrderedDict

from ciuic_p2p.config.sections import MeshSection
from ciuic_p2p.core.mesh.messages import Chunk, Plan

Kept = tuple[bytes, bytes, float, int, Plan]
"""A held chunk: (payload, its origin's signature, when kept, route, the plan it
carried), all a repair answer needs to send it as its origin signed it."""
Key = tuple[str, int]
"""(origin, sequence number)."""
ENTRY_OVERHEAD_BYTES = 512
"""What one held chunk costs besides its payload and plan (its key, tuple and
signature): counted against ``chunk_retain_bytes`` so that empty chunks are bounded
too."""


def held_size(payload: bytes, plan: Plan) -> int:
    """The bytes one held chunk counts for: payload, the plan's names, the overhead."""
    return len(payload) + sum(2 + len(node) for node, _ in plan) + ENTRY_OVERHEAD_BYTES


class ChunkStore:
    """One node's held chunks: others' and its own, each oldest first."""

    def __init__(self, node: str, settings: MeshSection) -> None:
        self.node = node
        self.settings = settings
        self.others: OrderedDict[Key, Kept] = OrderedDict()
        """Others' chunks, the oldest first."""
        self.own: OrderedDict[Key, Kept] = OrderedDict()
        """This node's chunks, kept for ``own_chunk_retain_s``."""
        self.held_bytes = 0
        """What ``others`` and ``own`` hold, each chunk counted by :func:`held_size`."""
        self._others_bytes = 0

    def __bool__(self) -> bool:
        return bool(self.others or self.own)

    def kept(self, origin: str, seq: int) -> Kept | None:
        """The chunk (origin, seq) as held here, if it still is."""
        return self._of(origin).get((origin, seq))

    def _of(self, origin: str) -> OrderedDict[Key, Kept]:
        return self.own if origin == self.node else self.others

    def keep(self, chunk: Chunk, now: float) -> None:
        """Hold a signed chunk as its origin sent it (hops aside)."""
        store = self._of(chunk.origin)
        key = (chunk.origin, chunk.seq)
        if key in store:
            self._drop(store, key)
        store[key] = (chunk.payload, chunk.signature, now, chunk.route, chunk.plan)
        size = held_size(chunk.payload, chunk.plan)
        self.held_bytes += size
        if store is self.others:
            self._others_bytes += size
        self.evict(now)

    def evict(self, now: float) -> None:
        """Chunks past their retain time go, then the bounds (see the module docstring)."""
        s = self.settings
        own_retain_s = max(s.chunk_retain_s, s.own_chunk_retain_s)
        for store, retain_s in ((self.others, s.chunk_retain_s), (self.own, own_retain_s)):
            while store:
                key, (_, _, at, _, _) = next(iter(store.items()))
                if now - at <= retain_s:
                    break
                self._drop(store, key)
        own_bytes = self.held_bytes - self._others_bytes
        while self.own and own_bytes > s.chunk_retain_bytes // 2:
            own_bytes -= self._drop(self.own, next(iter(self.own)))
        for store in (self.others, self.own):
            while store and self.held_bytes > s.chunk_retain_bytes:
                self._drop(store, next(iter(store)))

    def _drop(self, store: OrderedDict[Key, Kept], key: Key) -> int:
        payload, _, _, _, plan = store.pop(key)
        size = held_size(payload, plan)
        self.held_bytes -= size
        if store is self.others:
            self._others_bytes -= size
        return size
