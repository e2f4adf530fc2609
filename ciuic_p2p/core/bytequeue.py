"""A byte stream's unread input, held as the pieces it came in.

A frame reader that appends every piece to one ``bytearray`` and slices each frame
out of it copies every byte three times (the append, the slice, ``bytes`` of the
slice), and a 1 MiB frame comes in hundreds of pieces. :class:`ByteQueue` keeps the
pieces and copies each byte once, into the frame that :meth:`take` returns (and not
at all when a piece is exactly that frame). Small pieces are gathered into one
buffer as they come (``SMALL_PIECE_BYTES``): a peer that sends a frame a byte or two
at a time would otherwise make each byte an object of its own, 20-60 times its size
in memory.
"""

from __future__ import annotations

import collections

SMALL_PIECE_BYTES = 16 * 1024
"""Pieces under this are appended to a gathering buffer (one copy, as a frame reader
with one buffer made of every byte) instead of being kept as they are."""
GATHER_BYTES = 64 * 1024
"""A gathering buffer takes small pieces up to this size; then a new one starts."""


class ByteQueue:
    def __init__(self) -> None:
        self._pieces: collections.deque[bytes | bytearray] = collections.deque()
        self._offset = 0
        """Bytes of the first piece already taken."""
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def append(self, data: bytes | bytearray | memoryview) -> None:
        """Queue ``data``; a ``bytearray`` or view is copied (its owner may reuse it)."""
        n = len(data)
        if not n:
            return
        self._len += n
        if n < SMALL_PIECE_BYTES:
            last = self._pieces[-1] if self._pieces else None
            if type(last) is bytearray and len(last) < GATHER_BYTES:
                last += data
            else:
                self._pieces.append(bytearray(data))
            return
        self._pieces.append(data if type(data) is bytes else bytes(data))

    def peek(self, n: int) -> bytes:
        """The next ``n`` bytes, left queued (``n`` at most ``len(self)``)."""
        if n > self._len:
            raise ValueError(f"peek of {n} bytes, {self._len} queued")
        out = bytearray()
        offset = self._offset
        for piece in self._pieces:
            if len(out) >= n:
                break
            out += piece[offset : offset + n - len(out)]
            offset = 0
        return bytes(out)

    def take(self, n: int) -> bytes:
        """The next ``n`` bytes (``n`` at most ``len(self)``), copied once."""
        if n > self._len:
            raise ValueError(f"take of {n} bytes, {self._len} queued")
        if n <= 0:
            return b""
        self._len -= n
        first = self._pieces[0]
        left = len(first) - self._offset
        if left >= n:
            if type(first) is bytes and self._offset == 0 and n == len(first):
                out = first
            else:
                view = memoryview(first)
                out = bytes(view[self._offset : self._offset + n])
                view.release()
            self._advance(n, left)
            return out
        parts: list[bytes | bytearray | memoryview] = []
        need = n
        while need:
            piece = self._pieces[0]
            left = len(piece) - self._offset
            if self._offset == 0 and left <= need:
                parts.append(piece)  # a whole piece: joined as it is
            else:
                parts.append(memoryview(piece)[self._offset : self._offset + min(left, need)])
            taken = min(left, need)
            self._advance(taken, left)
            need -= taken
        out = b"".join(parts)
        for part in parts:  # a gathering buffer still queued must stay resizable
            if type(part) is memoryview:
                part.release()
        return out

    def skip(self, n: int) -> None:
        """Drop the next ``n`` bytes (``n`` at most ``len(self)``)."""
        if n > self._len:
            raise ValueError(f"skip of {n} bytes, {self._len} queued")
        self._len -= n
        while n:
            left = len(self._pieces[0]) - self._offset
            taken = min(left, n)
            self._advance(taken, left)
            n -= taken

    def _advance(self, taken: int, left: int) -> None:
        """``taken`` bytes of the first piece, which had ``left``, are used."""
        if taken == left:
            self._pieces.popleft()
            self._offset = 0
        else:
            self._offset += taken
