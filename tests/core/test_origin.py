from __future__ import annotations

import pytest

from ciuic_p2p.core.codec.bucket import BucketEncoder, BucketSpec, ChunkSource
from ciuic_p2p.core.codec.chunk import (
    FLAG_SIGNED_DIGEST,
    ChunkHeader,
    Codec,
    IndexCode,
    parse_chunk,
    set_signature,
    signed_region,
)
from ciuic_p2p.core.codec.origin import (
    ChunkFilter,
    ReplayWindow,
    sign_chunk,
    signed_by,
    verify_chunk,
)
from ciuic_p2p.errors import CodecError, ReplayedChunkError, SignatureError
from ciuic_p2p.identity import NodeKey
from tests.core.helpers import heavy_tailed, reseal


def signed_chunks(key: NodeKey, step: int = 1) -> list[bytearray]:
    source = ChunkSource(b"r" * 16, key.public_key, incarnation=1, layout_id=5)
    spec = BucketSpec(codec=Codec.SPARSE_INT8, density=0.05, chunk_payload_bytes=4096)
    chunks = BucketEncoder(0, 100_000, spec, source).encode(heavy_tailed(100_000, step), step)
    for c in chunks:
        sign_chunk(c, key)
    return chunks


def test_signed_chunk_verifies_and_any_alteration_is_caught() -> None:
    key = NodeKey.generate()
    chunk = signed_chunks(key)[0]
    assert verify_chunk(chunk).origin == key.public_key
    for pos in (0, 20, 40, 70, 100, 119, 184, len(chunk) - 1):
        altered = bytearray(chunk)
        altered[pos] ^= 0x01
        with pytest.raises(CodecError):  # framing, checksum or signature: all typed
            verify_chunk(altered)


def test_relay_cannot_forge_a_chunk_with_a_valid_checksum() -> None:
    key = NodeKey.generate()
    chunk = signed_chunks(key)[0]
    forged = bytearray(chunk)
    forged[-1] ^= 0xFF  # change the payload, then fix the checksum like a relay could
    reseal(forged)
    parse_chunk(forged)  # framing is valid...
    with pytest.raises(SignatureError):
        verify_chunk(forged)  # ...but the origin's signature is not


def test_chunks_signed_over_their_bytes_still_verify_and_the_scheme_bit_is_bound() -> None:
    """Chunks are signed over the SHA-256 of what the signature covers (flags bit 1);
    an older signer's signature over the bytes themselves still verifies, and flipping
    the bit (the flags byte is not signed) makes either fail, never pass."""
    key = NodeKey.generate()
    chunk = signed_chunks(key)[0]
    assert verify_chunk(chunk).signed_over_digest
    old = bytearray(chunk)
    set_signature(old, key.sign(*signed_region(old)), over_digest=False)
    assert not verify_chunk(old).signed_over_digest
    for signed in (chunk, old):
        flipped = bytearray(signed)
        flipped[5] ^= FLAG_SIGNED_DIGEST
        with pytest.raises(SignatureError):
            verify_chunk(flipped)


def test_unsigned_chunk_and_foreign_origin_are_refused() -> None:
    key = NodeKey.generate()
    chunk = signed_chunks(key)[0]
    with pytest.raises(SignatureError):
        sign_chunk(chunk, NodeKey.generate())
    unsigned = bytearray(chunk)
    unsigned[5] = 0
    with pytest.raises(SignatureError, match="not signed"):
        verify_chunk(unsigned)


def header(
    step: int, start: int = 0, incarnation: int = 1, origin: bytes = b"o" * 32
) -> ChunkHeader:
    return ChunkHeader(
        codec=Codec.DENSE_FP32,
        index_code=IndexCode.NONE,
        rice_bits=0,
        block_size=0,
        run_id=b"r" * 16,
        origin=origin,
        incarnation=incarnation,
        step=step,
        layout_id=0,
        bucket=0,
        range_start=start,
        range_len=1,
        count=1,
    )


def test_replay_window_drops_duplicates_and_stale_chunks() -> None:
    window = ReplayWindow(window_steps=10)
    window.check_and_record(header(5))
    window.check_and_record(header(5, start=100))
    with pytest.raises(ReplayedChunkError, match="already"):
        window.check_and_record(header(5))
    window.check_and_record(header(20))
    with pytest.raises(ReplayedChunkError, match="older"):
        window.check_and_record(header(5))
    window.check_and_record(header(3, incarnation=2))  # restart resets the window
    with pytest.raises(ReplayedChunkError, match="incarnation"):
        window.check_and_record(header(25, incarnation=1))
    window.check_and_record(header(5, origin=b"p" * 32))  # other origins are separate


def test_replay_window_memory_is_bounded() -> None:
    window = ReplayWindow(window_steps=1_000_000, max_entries=100)
    for step in range(1000):
        window.check_and_record(header(step))
    with pytest.raises(ReplayedChunkError):
        window.check_and_record(header(10))  # forgotten, hence refused, never accepted twice


def test_filter_refuses_origins_that_are_not_members_and_bounds_origins() -> None:
    members = {NodeKey.generate() for _ in range(2)}
    keys = {k.public_key for k in members}
    inbox = ChunkFilter(is_member=keys.__contains__)
    stranger = NodeKey.generate()
    assert inbox.admit(signed_chunks(stranger)[0]) is None and inbox.unknown_origin == 1
    assert inbox.admit(signed_chunks(next(iter(members)))[0]) is not None
    window = ReplayWindow(max_origins=3)
    for i in range(10):
        window.check_and_record(header(1, origin=bytes([i]) * 32))
    assert len(window._origins) == 3


def test_a_chunk_signed_into_a_copy_is_the_chunk_signed_in_place() -> None:
    """The daemon signs a published chunk into the one copy it prefixes anyway: the
    bytes are those of signing in place (Ed25519 is deterministic), and it verifies."""
    key = NodeKey.generate()
    source = ChunkSource(b"r" * 16, key.public_key, incarnation=1, layout_id=5)
    spec = BucketSpec(codec=Codec.SPARSE_INT8, density=0.05, chunk_payload_bytes=4096)
    (unsigned, *_) = BucketEncoder(0, 100_000, spec, source).encode(heavy_tailed(100_000, 1), 1)
    header, _ = parse_chunk(unsigned)
    copy = signed_by(memoryview(bytes(unsigned)), key, header, prefix=b"ENV!")
    sign_chunk(unsigned, key)
    assert copy == b"ENV!" + bytes(unsigned)
    assert verify_chunk(copy[4:]).origin == key.public_key
    with pytest.raises(SignatureError):  # only its own chunks
        signed_by(unsigned, NodeKey.generate(), header)
