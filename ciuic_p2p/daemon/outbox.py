"""One destination's queue of frames waiting for the transport.

Mesh messages and store pieces share a destination's bulk stream but not its queue:
pieces wait in ``side`` and are taken in turn with ``queue``, so a joiner's state
does not wait behind a backlog of updates and repairs (nor starve them). A second
sender on the stream would not do: the one with a backlog takes all the credit.

A chunk (origin, seq) is queued at most once per destination: a peer re-asks for a
chunk still queued here whenever our backlog outlasts its repair timer, and a second
copy would only lengthen the queue that made it ask: a backlog would feed itself.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from ciuic_p2p.core.link.frames import FrameType

MAX_OUTBOX = 4096
"""Messages in ``queue`` past which the oldest is dropped (membership repeats what
matters, and chunks are repaired)."""

ChunkKey = tuple[str, int]
"""A mesh chunk's (origin, seq)."""


@dataclass
class Outbox:
    queue: collections.deque[tuple[FrameType, bytes, ChunkKey | None]] = field(
        default_factory=collections.deque
    )
    chunks: set[ChunkKey] = field(default_factory=set)
    """(origin, seq) of the chunks in ``queue``."""
    side: collections.deque[tuple[FrameType, bytes]] = field(default_factory=collections.deque)
    """Store pieces, taken in turn with ``queue``."""
    turn: bool = False
    queued_bytes: int = 0
    """Bytes in ``queue``."""
    side_bytes: int = 0
    """Bytes in ``side`` (bounded per fetcher by the store: core.store.holder's Holder)."""
    already_queued: int = 0
    dropped: int = 0

    def push(self, ftype: FrameType, data: bytes, chunk: ChunkKey | None = None) -> bool:
        """Queue a frame; False if it is a chunk already queued for this destination."""
        if ftype is FrameType.STORE_DATA:
            self.side.append((ftype, data))
            self.side_bytes += len(data)
            return True
        if chunk is not None:
            if chunk in self.chunks:
                self.already_queued += 1
                return False
            self.chunks.add(chunk)
        if len(self.queue) >= MAX_OUTBOX:
            _, old, old_chunk = self.queue.popleft()
            self._taken(old, old_chunk)
            self.dropped += 1
        self.queue.append((ftype, data, chunk))
        self.queued_bytes += len(data)
        return True

    def pop(self) -> tuple[FrameType, bytes]:
        """The next frame to send (the queues must not both be empty)."""
        self.turn = not self.turn
        if self.side and (self.turn or not self.queue):
            ftype, data = self.side.popleft()
            self.side_bytes -= len(data)
            return ftype, data
        ftype, data, chunk = self.queue.popleft()
        self._taken(data, chunk)
        return ftype, data

    def clear(self) -> int:
        """Drop everything (the destination is unreachable); returns how many frames."""
        count = len(self.queue) + len(self.side)
        self.queue.clear()
        self.chunks.clear()
        self.side.clear()
        self.queued_bytes = 0
        self.side_bytes = 0
        return count

    def __bool__(self) -> bool:
        return bool(self.queue or self.side)

    def _taken(self, data: bytes, chunk: ChunkKey | None) -> None:
        self.queued_bytes -= len(data)
        if chunk is not None:
            self.chunks.discard(chunk)
