"""Alternative codings of sorted positions, measured beside ciuic's split Rice code.

Each coder takes sorted int64 positions (numpy) and returns bytes; its decoder
returns the positions. They exist to justify the choice in core/codec/indexcode.py with
numbers from the same run, and each one round-trips (the benchmark checks).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import numpy as np
import torch

from ciuic_p2p.core.codec import indexcode


def _gaps(pos: np.ndarray) -> np.ndarray:
    return np.diff(pos, prepend=-1) - 1


def _positions(gaps: np.ndarray) -> np.ndarray:
    return np.cumsum(gaps + 1) - 1


def raw32_encode(pos: np.ndarray) -> bytes:
    return pos.astype("<u4").tobytes()


def raw32_decode(data: bytes, k: int) -> np.ndarray:
    return np.frombuffer(data, dtype="<u4", count=k).astype(np.int64)


def varint_encode(pos: np.ndarray) -> bytes:
    """LEB128 of the gaps (7 bits a byte, high bit = more), vectorized."""
    gaps = _gaps(pos).astype(np.uint64)
    nbytes = np.ones(gaps.size, dtype=np.int64)
    for shift in (7, 14, 21, 28, 35):
        nbytes += gaps >= (1 << shift)
    out = np.empty(int(nbytes.sum()), dtype=np.uint8)
    starts = np.cumsum(nbytes) - nbytes
    for j in range(int(nbytes.max(initial=0))):
        sel = nbytes > j
        byte = (gaps[sel] >> np.uint64(7 * j)) & np.uint64(0x7F)
        more = (nbytes[sel] > j + 1).astype(np.uint8) << 7
        out[starts[sel] + j] = byte.astype(np.uint8) | more
    return out.tobytes()


def varint_decode(data: bytes, k: int) -> np.ndarray:
    buf = np.frombuffer(data, dtype=np.uint8)
    ends = np.flatnonzero((buf & 0x80) == 0)
    starts = np.concatenate(([0], ends[:-1] + 1))
    gaps = np.zeros(k, dtype=np.uint64)
    lengths = ends - starts + 1
    for j in range(int(lengths.max(initial=0))):
        sel = lengths > j
        gaps[sel] |= (buf[starts[sel] + j] & np.uint64(0x7F)).astype(np.uint64) << np.uint64(7 * j)
    return _positions(gaps.astype(np.int64))


def bitpack_encode(pos: np.ndarray) -> bytes:
    """Gaps at the fixed width of the largest one (one width byte first)."""
    gaps = _gaps(pos)
    width = max(1, int(gaps.max(initial=0)).bit_length())
    wide = gaps.astype(">u8").view(np.uint8).reshape(-1, 8)
    bits = np.unpackbits(wide, axis=1)[:, 64 - width :]
    return bytes([width]) + np.packbits(bits.reshape(-1)).tobytes()


def bitpack_decode(data: bytes, k: int) -> np.ndarray:
    width = data[0]
    bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8, offset=1), count=k * width)
    full = np.zeros((k, 64), dtype=np.uint8)
    full[:, 64 - width :] = bits.reshape(k, width)
    return _positions(np.packbits(full, axis=1).view(">u8").reshape(k).astype(np.int64))


def zlib_encode(pos: np.ndarray) -> bytes:
    """zlib (DEFLATE: LZ77 + Huffman) over the int32 gaps."""
    return zlib.compress(_gaps(pos).astype("<u4").tobytes(), 6)


def zlib_decode(data: bytes, k: int) -> np.ndarray:
    return _positions(np.frombuffer(zlib.decompress(data), dtype="<u4", count=k).astype(np.int64))


def rice_encode(pos: np.ndarray) -> bytes:
    gaps = indexcode.gaps_from_positions(torch.from_numpy(pos))
    r = indexcode.choose_rice_bits(gaps)
    rem, unary = indexcode.rice_encode(gaps, r)
    return bytes([r]) + rem.numpy().tobytes() + unary.numpy().tobytes()


def rice_decode(data: bytes, k: int) -> np.ndarray:
    r = data[0]
    raw = torch.frombuffer(bytearray(data[1:]), dtype=torch.uint8)
    n_rem = indexcode.remainder_bytes(k, r)
    out = indexcode.rice_decode(raw[:n_rem], raw[n_rem:], k, r, 2**31 - 1)
    return out.numpy()


CODERS: dict[str, tuple[Callable[[np.ndarray], bytes], Callable[[bytes, int], np.ndarray]]] = {
    "raw_int32": (raw32_encode, raw32_decode),
    "varint_gaps": (varint_encode, varint_decode),
    "bitpack_gaps": (bitpack_encode, bitpack_decode),
    "zlib_gaps": (zlib_encode, zlib_decode),
    "rice_split (ciuic)": (rice_encode, rice_decode),
}
