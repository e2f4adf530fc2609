from __future__ import annotations

import dataclasses
import struct

import pytest

from ciuic_p2p.core.codec import chunk as wire
from ciuic_p2p.core.codec.chunk import ChunkHeader, Codec, IndexCode, build_chunk, parse_chunk
from ciuic_p2p.errors import (
    BadMagicError,
    ChecksumMismatchError,
    ChunkDecodeError,
    InconsistentChunkError,
    OversizeChunkError,
    TruncatedChunkError,
    UnsupportedVersionError,
)
from tests.core.helpers import reseal


def dense_header(count: int = 4, **kw: object) -> ChunkHeader:
    fields: dict[str, object] = dict(
        codec=Codec.DENSE_FP32,
        index_code=IndexCode.NONE,
        rice_bits=0,
        block_size=0,
        run_id=b"r" * 16,
        origin=b"o" * 32,
        incarnation=1,
        step=2,
        layout_id=3,
        bucket=0,
        range_start=8,
        range_len=count,
        count=count,
    )
    fields.update(kw)
    return ChunkHeader(**fields)  # type: ignore[arg-type]


def test_round_trip_keeps_every_header_field() -> None:
    h = dense_header(step=2**64 - 1, incarnation=7, layout_id=2**63)
    chunk = build_chunk(h, [bytes(16)])
    parsed, payload = parse_chunk(bytes(chunk))
    assert len(chunk) == wire.HEADER_V1_LEN + 16
    assert bytes(payload) == bytes(16)
    for name in ("codec", "step", "incarnation", "layout_id", "range_start", "range_len", "count"):
        assert getattr(parsed, name) == getattr(h, name)
    assert parsed.payload_len == 16 and not parsed.signed


def test_signature_slot_and_flag_do_not_break_the_checksum() -> None:
    chunk = build_chunk(dense_header(), [bytes(16)])
    before = b"".join(bytes(p) for p in wire.signed_region(chunk))
    wire.set_signature(chunk, b"\x07" * 64)
    parsed, _ = parse_chunk(chunk)
    assert parsed.signed and parsed.signature == b"\x07" * 64
    assert b"".join(bytes(p) for p in wire.signed_region(chunk)) == before


def test_appended_header_fields_are_skipped_by_a_v1_reader() -> None:
    chunk = build_chunk(dense_header(), [bytes(range(16))])
    # The known appended field (replicas = 3), then 8 bytes of a later version's.
    extended = bytearray(chunk[:184]) + struct.pack("<I", 3) + b"\xaa" * 8 + chunk[184:]
    struct.pack_into("<H", extended, 6, 196)
    parsed, payload = parse_chunk(reseal(extended))
    assert parsed.header_len == 196 and bytes(payload) == bytes(range(16))
    assert parsed.replicas == 3


def test_the_replicas_field_round_trips_and_is_bounded() -> None:
    h = dataclasses.replace(dense_header(), replicas=5)
    chunk = build_chunk(h, [bytes(range(16))])
    assert len(chunk) == wire.HEADER_REPLICAS_LEN + 16
    parsed, payload = parse_chunk(chunk)
    assert parsed.replicas == 5 and bytes(payload) == bytes(range(16))
    # Unstated: the v1 header alone, read as 0.
    assert parse_chunk(build_chunk(dense_header(), [bytes(16)]))[0].replicas == 0
    bad = bytearray(chunk)
    struct.pack_into("<I", bad, 184, wire.MAX_REPLICAS + 1)
    with pytest.raises(InconsistentChunkError, match="replicas"):
        parse_chunk(reseal(bad))
    # A header too short to hold the field reads it as unstated, never past the header.
    short = bytearray(chunk[:184]) + b"\x01\x00" + chunk[188:]
    struct.pack_into("<H", short, 6, 186)
    assert parse_chunk(reseal(short))[0].replicas == 0


@pytest.mark.parametrize(
    ("mutate", "error"),
    [
        (lambda c: c[:100], TruncatedChunkError),
        (lambda c: c[:-1], TruncatedChunkError),
        (lambda c: c + b"\x00", InconsistentChunkError),
        (lambda c: b"XXXX" + c[4:], BadMagicError),
        (lambda c: c[:4] + b"\x02" + c[5:], UnsupportedVersionError),
        (lambda c: c[:190] + bytes([c[190] ^ 1]) + c[191:], ChecksumMismatchError),
        (lambda c: bytes(wire.MAX_CHUNK_BYTES + 1), OversizeChunkError),
        (lambda c: b"", TruncatedChunkError),
    ],
)
def test_bad_framing_gets_a_typed_error(mutate: object, error: type[Exception]) -> None:
    chunk = bytes(build_chunk(dense_header(), [bytes(16)]))
    with pytest.raises(error):
        parse_chunk(mutate(chunk))  # type: ignore[operator]


def _field_mutation(offset: int, fmt: str, value: int) -> bytearray:
    chunk = build_chunk(dense_header(), [bytes(16)])
    struct.pack_into(fmt, chunk, offset, value)
    return reseal(chunk)


@pytest.mark.parametrize(
    ("offset", "fmt", "value", "error"),
    [
        (8, "<B", 99, InconsistentChunkError),  # unknown codec
        (9, "<B", 7, InconsistentChunkError),  # unknown index code
        (11, "<B", 1, InconsistentChunkError),  # reserved
        (108, "<I", 5, InconsistentChunkError),  # count > range_len (k > n)
        (96, "<Q", 2**40, OversizeChunkError),  # range beyond the bucket limit
        (112, "<I", 2**30, OversizeChunkError),  # payload beyond the limit
        (112, "<I", 8, InconsistentChunkError),  # trailing bytes
        (6, "<H", 100, InconsistentChunkError),  # header shorter than v1
        (6, "<H", 5000, InconsistentChunkError),  # header beyond the limit
    ],
)
def test_inconsistent_fields_get_a_typed_error(
    offset: int, fmt: str, value: int, error: type[Exception]
) -> None:
    with pytest.raises(error):
        parse_chunk(_field_mutation(offset, fmt, value))


def test_every_decode_error_shares_one_base() -> None:
    for cls in (TruncatedChunkError, BadMagicError, ChecksumMismatchError, OversizeChunkError):
        assert issubclass(cls, ChunkDecodeError)


def test_writer_refuses_a_payload_beyond_the_limit() -> None:
    n = wire.MAX_PAYLOAD_BYTES // 4 + 1
    with pytest.raises(OversizeChunkError):
        build_chunk(dense_header(count=n), [bytes(4 * n)])
