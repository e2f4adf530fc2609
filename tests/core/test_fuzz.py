"""The decoder against 100,000+ random and mutated byte strings.

Every input must end in a value or a ChunkDecodeError: never another exception, a
hang (the test has a time limit) or an allocation beyond the limits (decoded sizes
are checked against the input's length)."""

from __future__ import annotations

import random
import struct

import pytest
import torch

from ciuic_p2p.core.codec.bucket import decode_chunk
from ciuic_p2p.core.codec.chunk import MAGIC, Codec
from ciuic_p2p.errors import ChunkDecodeError
from tests.core.helpers import encoder, heavy_tailed, reseal

TOTAL = 100_000

# (offset, struct format) of every header field, from the documented layout.
FIELDS = [
    (4, "<B"),
    (5, "<B"),
    (6, "<H"),
    (8, "<B"),
    (9, "<B"),
    (10, "<B"),
    (11, "<B"),
    (12, "<H"),
    (14, "<H"),
    (64, "<Q"),
    (80, "<Q"),
    (88, "<Q"),
    (96, "<Q"),
    (104, "<I"),
    (108, "<I"),
    (112, "<I"),
]
EXTREMES = [0, 1, 2, 7, 8, 31, 32, 33, 63, 64, 127, 128, 255, 256, 4095, 4096, 65535]


def seeds() -> list[bytes]:
    out: list[bytes] = []
    for codec in Codec:
        for n, density in ((1, 1.0), (300, 0.1), (5000, 0.01)):
            enc = encoder(n, codec, density=density, block_size=16)
            out.extend(bytes(c) for c in enc.encode(heavy_tailed(n, n), 0))
    return out


def mutate(rng: random.Random, chunk: bytes) -> bytes:
    buf = bytearray(chunk)
    kind = rng.randrange(6)
    if kind == 0:  # flip bits
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(len(buf))
            buf[i] ^= 1 << rng.randrange(8)
    elif kind == 1:  # overwrite a header field with an extreme value
        off, fmt = rng.choice(FIELDS)
        size = struct.calcsize(fmt)
        value = rng.choice([*EXTREMES, (1 << 8 * size) - 1, rng.randrange(1 << 8 * size)])
        struct.pack_into(fmt, buf, off, value % (1 << (8 * size)))
    elif kind == 2:  # truncate
        del buf[rng.randrange(len(buf)) :]
    elif kind == 3:  # extend
        buf += rng.randbytes(rng.randint(1, 64))
    elif kind == 4:  # randomize a payload slice
        if len(buf) > 185:
            a = rng.randrange(184, len(buf))
            b = min(len(buf), a + rng.randint(1, 32))
            buf[a:b] = rng.randbytes(b - a)
    else:  # shift the payload length and the header length together
        struct.pack_into("<I", buf, 112, rng.randrange(1 << 20))
    # Half the mutants get a valid checksum, so that the payload checks are reached.
    if rng.random() < 0.5 and len(buf) >= 184:
        reseal(buf)
    return bytes(buf)


def check(data: bytes, stats: dict[str, int]) -> None:
    try:
        decoded = decode_chunk(data)
    except ChunkDecodeError as exc:
        stats[type(exc).__name__] = stats.get(type(exc).__name__, 0) + 1
        return
    stats["ok"] = stats.get("ok", 0) + 1
    # A decoded chunk never holds more values than its bytes could describe.
    assert decoded.values.numel() <= 8 * len(data)
    if decoded.positions is not None:
        assert decoded.positions.numel() == decoded.values.numel()
        assert bool((decoded.positions < decoded.header.range_len).all())
        assert decoded.positions.numel() < 2 or bool((decoded.positions.diff() > 0).all())
    assert bool(torch.isfinite(decoded.values).all())


@pytest.mark.timeout(240)
def test_decoder_survives_random_and_mutated_inputs() -> None:
    rng = random.Random(20261130)
    corpus = seeds()
    stats: dict[str, int] = {}
    for i in range(TOTAL):
        mode = i % 10
        if mode == 0:
            data = rng.randbytes(rng.randint(0, 400))
        elif mode == 1:
            data = MAGIC + b"\x01" + rng.randbytes(rng.randint(0, 400))
        else:
            data = mutate(rng, rng.choice(corpus))
        check(data, stats)
    assert sum(stats.values()) == TOTAL
    # The mutants reach deep: checksum-valid inputs fail in the payload checks too,
    # and some mutants are still valid chunks.
    assert stats.get("InconsistentChunkError", 0) > 1000
    assert stats.get("ChecksumMismatchError", 0) > 1000
    assert stats.get("ok", 0) > 100
