"""The other ranks of a sharded trainer: where the daemon writes what they are owed.

A node that shards its model inside (FSDP2: each local rank holds a part of every
tensor, train.sharded) trains one replica with several processes, and each rank talks
to the daemon itself: it publishes its own shard's chunks and needs every delivery of
the run (it applies what falls on its shard). The first rank attaches as usual and
says how many ranks the node has; each other rank then attaches naming its rank and
the first rank's incarnation (its chunks are the same replica's, and must carry the
same one). This module holds those ranks' writers, and for a rank not attached yet
what came since the first rank did (bounded as the first rank's own held deliveries
are), so that no rank misses a chunk its peers applied.

Only the first rank speaks for the replica (JOIN, DONE, its state, checkpoints);
another rank's session ending says nothing to the mesh. The first rank's session
ending mid-run ends the others' (their chunks are its replica's); after its DONE, they
keep theirs until they leave: a rank may still be in the last round.
"""

from __future__ import annotations

import asyncio
import collections

from ciuic_p2p.core.replica.messages import MAX_NODE_RANKS
from ciuic_p2p.logsetup import get_logger

__all__ = ["MAX_RANKS", "RankWriters"]

MAX_RANKS = MAX_NODE_RANKS
"""Ranks a trainer may say it has: each is held up to the bounds below while it is not
attached."""
log = get_logger("ciuic.trainer")

Parts = tuple[bytes | memoryview, ...]


class RankWriters:
    """Writers of a sharded trainer's ranks 1..R-1, and what is held for those not
    attached yet."""

    def __init__(
        self,
        max_write_buffer: int,
        max_held: int,
        max_held_bytes: int,
        counters: collections.Counter[str],
    ) -> None:
        """``counters``: the daemon's (``rank_deliveries_dropped``)."""
        self.counters = counters
        self.max_write_buffer = max_write_buffer
        self.max_held = max_held
        self.max_held_bytes = max_held_bytes
        self.ranks = 1
        self.incarnation = -1
        self.writers: dict[int, asyncio.StreamWriter] = {}
        self._held: dict[int, collections.deque[tuple[bool, Parts]]] = {}
        self._held_bytes: dict[int, int] = {}
        self.dropped = 0
        """Deliveries a rank did not get: its buffer was full, or more was held for
        it than the bounds before it attached."""

    def expect(self, ranks: int, incarnation: int) -> None:
        """A first rank attached, with ``ranks`` ranks in all, under ``incarnation``:
        hold what comes for the others until they attach."""
        self.close()
        self.ranks = ranks
        self.incarnation = incarnation
        for rank in range(1, ranks):
            self._held[rank] = collections.deque()
            self._held_bytes[rank] = 0

    def expecting(self) -> bool:
        return self.ranks > 1

    def admit(self, rank: object, incarnation: object) -> str | None:
        """Why a rank that says it is ``rank`` of the trainer attached under
        ``incarnation`` cannot attach, or None."""
        if type(rank) is not int or not 1 <= rank < self.ranks:
            return f"rank must be in [1, {self.ranks - 1}] (the first rank said {self.ranks})"
        if type(incarnation) is not int or incarnation != self.incarnation:
            return "not the incarnation of the first rank attached here (it restarted?)"
        if rank in self.writers and not self.writers[rank].is_closing():
            return f"rank {rank} is attached already"
        return None

    def attach(self, rank: int, writer: asyncio.StreamWriter) -> None:
        """``rank`` attached on ``writer``: what was held for it goes first."""
        self.writers[rank] = writer
        held = self._held.get(rank, collections.deque())
        while held:
            _, parts = held.popleft()
            writer.writelines(parts)
        self._held_bytes[rank] = 0

    def detach(self, rank: int, writer: asyncio.StreamWriter) -> bool:
        """``rank``'s session ended; whether it was that rank's attached one."""
        if self.writers.get(rank) is writer:
            del self.writers[rank]
            return True
        return False

    def write(self, *parts: bytes | memoryview, droppable: bool = False) -> None:
        """To every other rank: attached, or held for it."""
        for rank in range(1, self.ranks):
            writer = self.writers.get(rank)
            if writer is None:
                self._hold(rank, droppable, parts)
            elif writer.is_closing():
                continue
            elif droppable and writer.transport.get_write_buffer_size() > self.max_write_buffer:
                self.dropped += 1
                self.counters["rank_deliveries_dropped"] += 1
            else:
                writer.writelines(parts)

    def _hold(self, rank: int, droppable: bool, parts: Parts) -> None:
        held = self._held.get(rank)
        if held is None:
            return
        held.append((droppable, parts))
        self._held_bytes[rank] += sum(len(p) for p in parts)
        while len(held) > self.max_held or self._held_bytes[rank] > self.max_held_bytes:
            _, dropped = held.popleft()
            self._held_bytes[rank] -= sum(len(p) for p in dropped)
            self.dropped += 1
            self.counters["rank_deliveries_dropped"] += 1

    def close(self) -> None:
        """The first rank's session ended: the others' go with it (their chunks are
        its replica's)."""
        for writer in self.writers.values():
            writer.close()
        self.writers.clear()
        self._held.clear()
        self._held_bytes.clear()
        self.ranks = 1
        self.incarnation = -1
