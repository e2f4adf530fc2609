"""Little-endian binary fields, read with bounds checks and written with range checks:
what the variable-length wire formats (core.mesh.messages, core.store.messages) are
built of. Fixed layouts (the chunk header, the trainer socket's frames) are one
``struct`` each and need none of this.

A :class:`Reader` never reads past its view and raises the format's own typed error
(``error``) for every shortfall, so a decoder built on it turns any byte sequence
into a message or that error: never an ``IndexError``, a ``struct.error`` or a slice
that silently comes back short. A :class:`Writer` refuses a value its field cannot
hold with a ``ValueError`` (a bug of ours, not the peer's doing).
"""

from __future__ import annotations

import struct

from ciuic_p2p.errors import CiuicError

U16 = struct.Struct("<H")
U32 = struct.Struct("<I")
U64 = struct.Struct("<Q")


class Reader:
    def __init__(self, data: bytes | bytearray | memoryview, error: type[CiuicError]) -> None:
        self.data = memoryview(data).cast("B")
        self.pos = 0
        self.error = error

    @property
    def left(self) -> int:
        return len(self.data) - self.pos

    def take(self, n: int) -> memoryview:
        if n < 0 or n > self.left:
            raise self.error(f"truncated at byte {self.pos} (wanted {n} more)")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def u8(self) -> int:
        return self.take(1)[0]

    def u16(self) -> int:
        return int(U16.unpack(self.take(2))[0])

    def u32(self) -> int:
        return int(U32.unpack(self.take(4))[0])

    def u64(self) -> int:
        return int(U64.unpack(self.take(8))[0])

    def raw(self, n: int) -> bytes:
        return bytes(self.take(n))

    def str8(self, max_bytes: int, what: str) -> str:
        """A UTF-8 string of at most ``max_bytes``, its length in one byte."""
        n = self.u8()
        if n > max_bytes:
            raise self.error(f"{what} of {n} bytes exceeds {max_bytes}")
        try:
            return bytes(self.take(n)).decode("utf-8")
        except UnicodeDecodeError:
            raise self.error(f"{what} is not UTF-8") from None

    def count(self, limit: int, what: str) -> int:
        """A u16 count of items that follow, at most ``limit``."""
        n = self.u16()
        if n > limit:
            raise self.error(f"{n} {what} exceed the limit of {limit}")
        return n

    def rest(self) -> memoryview:
        return self.take(self.left)

    def end(self, what: str) -> None:
        if self.left:
            raise self.error(f"{self.left} trailing bytes after {what}")


class Writer:
    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def u8(self, v: int) -> None:
        if not 0 <= v <= 0xFF:
            raise ValueError(f"{v} does not fit a u8")
        self.parts.append(bytes((v,)))

    def u16(self, v: int) -> None:
        self.parts.append(_pack(U16, v))

    def u32(self, v: int) -> None:
        self.parts.append(_pack(U32, v))

    def u64(self, v: int) -> None:
        self.parts.append(_pack(U64, v))

    def raw(self, data: bytes | bytearray | memoryview) -> None:
        self.parts.append(bytes(data))

    def str8(self, s: str, max_bytes: int, what: str) -> None:
        encoded = s.encode()
        if len(encoded) > max_bytes:
            raise ValueError(f"{what} of {len(encoded)} bytes exceeds {max_bytes}")
        self.parts.append(bytes((len(encoded),)) + encoded)

    def getvalue(self) -> bytes:
        return b"".join(self.parts)


def _pack(field: struct.Struct, v: int) -> bytes:
    try:
        return field.pack(v)
    except struct.error:
        raise ValueError(f"{v} does not fit {field.format}") from None
