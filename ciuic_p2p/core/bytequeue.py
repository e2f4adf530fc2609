"""A byte stream's unread input, held as the pieces it came in.

A frame reader that appends every piece to one ``bytearray`` and slices each frame
out of it copies every byte three times (the append, the slice, ``bytes`` of the
slice), and a 1 MiB frame comes in hundreds of pieces. :class:`ByteQueue` keeps the
pieces and copies each byte once, into the frame that :meth:`take` returns (and not
at all when a piece is exactly that frame).
"""

from __future__ import annotations

import collections


class ByteQueue:
    def __init__(self) -> None:
        self._pieces: collections.deque[bytes] = collections.deque()
        self._offset = 0
        """Bytes of the first piece already taken."""
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def append(self, data: bytes | bytearray | memoryview) -> None:
        """Queue ``data``; a ``bytearray`` or view is copied (its owner may reuse it)."""
        if not data:
            return
        piece = data if type(data) is bytes else bytes(data)
        self._pieces.append(piece)
        self._len += len(piece)

    def peek(self, n: int) -> bytes:
        """The next ``n`` bytes, left queued (``n`` at most ``len(self)``)."""
        if n > self._len:
            raise ValueError(f"peek of {n} bytes, {self._len} queued")
        if n <= 0:
            return b""
        first = self._pieces[0] if self._pieces else b""
        if len(first) - self._offset >= n:
            return first[self._offset : self._offset + n]
        out = bytearray()
        offset = self._offset
        for piece in self._pieces:
            out += memoryview(piece)[offset : offset + n - len(out)]
            offset = 0
            if len(out) == n:
                break
        return bytes(out)

    def take(self, n: int) -> bytes:
        """The next ``n`` bytes (``n`` at most ``len(self)``), copied once."""
        if n > self._len:
            raise ValueError(f"take of {n} bytes, {self._len} queued")
        if n <= 0:
            return b""
        self._len -= n
        first = self._pieces[0] if self._pieces else b""
        left = len(first) - self._offset
        if left > n:
            out = first[self._offset : self._offset + n]
            self._offset += n
            return out
        if left == n:
            out = first if self._offset == 0 else first[self._offset :]
            self._pieces.popleft()
            self._offset = 0
            return out
        parts: list[memoryview] = []
        need = n
        while need:
            piece = self._pieces[0]
            view = memoryview(piece)[self._offset :]
            if len(view) <= need:
                parts.append(view)
                need -= len(view)
                self._pieces.popleft()
                self._offset = 0
            else:
                parts.append(view[:need])
                self._offset += need
                need = 0
        return b"".join(parts)

    def skip(self, n: int) -> None:
        """Drop the next ``n`` bytes (``n`` at most ``len(self)``)."""
        if n > self._len:
            raise ValueError(f"skip of {n} bytes, {self._len} queued")
        self._len -= n
        while n:
            left = len(self._pieces[0]) - self._offset
            if left <= n:
                self._pieces.popleft()
                self._offset = 0
                n -= left
            else:
                self._offset += n
                n = 0
