"""A byte ring in memory shared by a node and one of its lane processes, one way.

Through a pipe a 1 MiB frame costs about 0.7 ms of CPU per hop (a copy into the
kernel, one out, and Python's buffering), and a chunk through a lane makes two hops
more than one through the node's link (bench/lanes.py). Through the ring it is one
copy in and one out. One writer thread puts payloads in, in order; the pipe carries
where each lies; the one reader copies each out in the same order and then
publishes how far it has read, so the writer may reuse the space. When the ring has
no room the payload goes through the pipe as before: nobody waits on the ring.

The ring is a ``memfd`` (Linux) mapped by both processes: header (the reader's
consumed count, 8 bytes, aligned) then the data area.
"""

from __future__ import annotations

import mmap
import os
import struct

HEADER_BYTES = 64
_CONSUMED = struct.Struct("<Q")


class LaneRing:
    """One end of a ring: :meth:`put` on the writer's, :meth:`take` on the reader's."""

    def __init__(self, fd: int, size: int) -> None:
        """``fd``: the ring's memory (this end keeps its own mapping; the caller
        closes the descriptor when it likes)."""
        self._map = mmap.mmap(fd, size)
        self._view = memoryview(self._map)
        self.capacity = size - HEADER_BYTES
        self._head = 0
        """Writer only: bytes put in, in all (wasted tails included)."""

    @classmethod
    def create(cls, size: int) -> tuple[LaneRing, int]:
        """A new ring and its descriptor (to pass to the other process). Raises
        OSError where there is no ``memfd_create``."""
        fd = os.memfd_create("ciuic-lane", getattr(os, "MFD_CLOEXEC", 0))
        try:
            os.ftruncate(fd, size)
            return cls(fd, size), fd
        except OSError:
            os.close(fd)
            raise

    def _consumed(self) -> int:
        return int(_CONSUMED.unpack_from(self._map, 0)[0])

    def put(self, payload: bytes) -> tuple[int, int, int] | None:
        """Copy ``payload`` in; (offset, length, consumed-after) for the reader, or
        None when there is no room now (send it another way)."""
        n = len(payload)
        if n > self.capacity // 2:
            return None
        pos = self._head % self.capacity
        skip = self.capacity - pos if pos + n > self.capacity else 0
        if self.capacity - (self._head - self._consumed()) < skip + n:
            return None
        start = 0 if skip else pos
        self._view[HEADER_BYTES + start : HEADER_BYTES + start + n] = payload
        self._head += skip + n
        return start, n, self._head

    def take(self, offset: int, length: int, consumed: int) -> bytes:
        """Copy a payload out and free its space (and any tail skipped before it).
        Raises ValueError for a place outside the ring."""
        if not (offset >= 0 and length >= 0 and offset + length <= self.capacity):
            raise ValueError(f"ring place {offset}+{length} outside {self.capacity}")
        data = bytes(self._view[HEADER_BYTES + offset : HEADER_BYTES + offset + length])
        _CONSUMED.pack_into(self._map, 0, consumed)
        return data

    def close(self) -> None:
        self._view.release()
        self._map.close()
