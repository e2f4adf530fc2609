"""Wire format of one update chunk (version 1).

A chunk is one self-describing message: a fixed little-endian header followed by a
codec-specific payload. It can be sent, relayed, applied or lost on its own, in any
order. Layout of the v1 header (184 bytes)::

    off size field
      0    4 magic          b"CIUC"
      4    1 version        1
      5    1 flags          bit 0: the signature slot holds the origin's signature;
                            bit 1: that signature is over the SHA-256 digest of what
                            it covers (signed_digest), not over the bytes themselves
      6    2 header_len     bytes before the payload; >= 184 (later versions append)
      8    1 codec          Codec (below)
      9    1 index_code     IndexCode (below)
     10    1 rice_bits      Rice parameter of the index stream (0 for dense codecs)
     11    1 reserved       0
     12    2 block_size     values per INT8 scale (0 when the codec has no scales)
     14    2 reserved       0
     16   16 run_id         training run; two runs on one mesh never mix
     32   32 origin         the origin node's public key (Ed25519)
     64    8 incarnation    the origin's epoch, bumped on every restart
     72    8 step           the origin's local step this update belongs to
     80    8 layout_id      fingerprint of the parameter layout (core.codec.layout)
     88    8 range_start    first element of the bucket this chunk covers
     96    8 range_len      number of elements covered
    104    4 bucket         bucket index within the layout
    108    4 count          values carried (== range_len for dense codecs)
    112    4 payload_len    bytes after the header
    116    4 checksum       CRC-32 of the header and payload, flags and signature excluded
    120   64 signature      Ed25519 signature slot, filled by core.codec.origin.sign_chunk

Appended fields (a v1 reader that predates them skips them; they are covered by the
checksum and the signature)::

    184    4 replicas       the origin's count of training replicas when it sent this
                            update: every replica weights it 1/replicas, so all of them
                            add the same amount whenever membership changes (0: not
                            stated; header_len is then 184 and a receiver uses its own)

The checksum and the signature both skip the flags byte and the signature slot, so
that the origin can sign (and mark signed) a chunk after it was built, and a relay
forwards the bytes untouched. The signature covers the checksum. Since bit 1 (this
version's signer sets it), the Ed25519 signature is over ``SIGNED_DIGEST_TAG`` and the
SHA-256 of the covered bytes: Ed25519 hashes what it signs twice with SHA-512 (3.4 ms
for 1 MiB here) and verifies with one more pass (1.9 ms), where SHA-256 takes 0.6 ms;
its security is then SHA-256's collision resistance. A reader that predates bit 1
refuses such a chunk (unknown flags): a mesh upgrades its signers together. Chunks
signed over their bytes (bit 0 alone) are still read.

The numeric values of ``Codec`` and ``IndexCode`` are part of the protocol: only
append to them. Fields are only ever appended to the header, so a v1 reader skips
header bytes past 184 (they are covered by the checksum).

Decoding trusts nothing: every size is checked against the hard limits below before
anything is allocated, and every failure is a typed :class:`ChunkDecodeError`.
"""

from __future__ import annotations

import enum
import hashlib
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

from ciuic_p2p.errors import (
    BadMagicError,
    ChecksumMismatchError,
    InconsistentChunkError,
    OversizeChunkError,
    TruncatedChunkError,
    UnsupportedVersionError,
)

MAGIC = b"CIUC"
VERSION = 1
HEADER_V1_LEN = 184
#: With the appended ``replicas`` field.
HEADER_REPLICAS_LEN = 188
MAX_REPLICAS = 1 << 16
#: Hard limits. A chunk larger than this is refused before its payload is looked at.
MAX_HEADER_LEN = 1024
MAX_PAYLOAD_BYTES = 1 << 20
MAX_CHUNK_BYTES = MAX_HEADER_LEN + MAX_PAYLOAD_BYTES
#: Largest bucket (elements) a range may address: indices fit a signed 32-bit int.
MAX_RANGE_LEN = (1 << 31) - 1
MAX_BLOCK_SIZE = 4096
MAX_RICE_BITS = 32

FLAG_SIGNED = 0x01
FLAG_SIGNED_DIGEST = 0x02
_KNOWN_FLAGS = FLAG_SIGNED | FLAG_SIGNED_DIGEST
SIGNED_DIGEST_TAG = b"ciuic chunk sha256\x00"
"""What an origin signs before the digest (bit 1): domain separation from every other
message signed with a node key."""

_HEADER = struct.Struct("<4sBBHBBBBHH16s32sQQQQQIIII64s")
assert _HEADER.size == HEADER_V1_LEN
_CHECKSUM_OFFSET = 116
_SIGNATURE_OFFSET = 120
_SIGNATURE_END = 184
_REPLICAS = struct.Struct("<I")
SIGNATURE_LEN = 64
RUN_ID_LEN = 16
ORIGIN_LEN = 32
_U64_MAX = (1 << 64) - 1


class Codec(enum.IntEnum):
    """How a chunk's values are encoded. Append only: the numbers are on the wire."""

    DENSE_FP32 = 1
    DENSE_FP16 = 2
    DENSE_BF16 = 3
    DENSE_INT8 = 4
    """Every element, INT8 with one fp32 scale per ``block_size`` elements."""
    SPARSE_INT8 = 5
    """Selected elements: INT8 values with one fp32 scale per block, indices coded."""
    SPARSE_FP16 = 6
    """Selected elements: fp16 values, indices coded."""
    SPARSE_INT4 = 7
    """Selected elements: 4-bit codes packed two a byte, one fp32 scale per block."""
    SPARSE_INT2 = 8
    """Selected elements: 2-bit codes packed four a byte, one fp32 scale per block."""

    @property
    def is_sparse(self) -> bool:
        return self in _SPARSE

    @property
    def has_scales(self) -> bool:
        return self in _SCALED

    @property
    def value_bits(self) -> int:
        return _VALUE_BITS[self]

    @property
    def value_bytes(self) -> int:
        """Bytes per value of a whole-byte codec (the dense ones, INT8, fp16)."""
        if self.value_bits % 8:
            raise ValueError(f"{self.name} packs {self.value_bits}-bit values")
        return self.value_bits // 8


_SPARSE = frozenset({Codec.SPARSE_INT8, Codec.SPARSE_FP16, Codec.SPARSE_INT4, Codec.SPARSE_INT2})
_SCALED = frozenset({Codec.DENSE_INT8, Codec.SPARSE_INT8, Codec.SPARSE_INT4, Codec.SPARSE_INT2})
_VALUE_BITS = {
    Codec.DENSE_FP32: 32,
    Codec.DENSE_FP16: 16,
    Codec.DENSE_BF16: 16,
    Codec.DENSE_INT8: 8,
    Codec.SPARSE_INT8: 8,
    Codec.SPARSE_FP16: 16,
    Codec.SPARSE_INT4: 4,
    Codec.SPARSE_INT2: 2,
}

SCALE_BYTES = 4  # fp32 scales


class IndexCode(enum.IntEnum):
    """How a sparse chunk's positions are coded. Append only."""

    NONE = 0
    """Dense codecs: every element of the range, in order."""
    RICE_SPLIT = 1
    """Gaps between sorted positions, Golomb-Rice coded as two bit streams: the
    ``rice_bits`` low bits of each gap packed at fixed width, then the quotients in
    unary (a one ends each). See core.codec.indexcode."""


@dataclass(frozen=True, slots=True)
class ChunkHeader:
    """The decoded header of a chunk. Field meanings: see the module docstring."""

    codec: Codec
    index_code: IndexCode
    rice_bits: int
    block_size: int
    run_id: bytes
    origin: bytes
    incarnation: int
    step: int
    layout_id: int
    bucket: int
    range_start: int
    range_len: int
    count: int
    flags: int = 0
    signature: bytes = bytes(SIGNATURE_LEN)
    header_len: int = HEADER_V1_LEN
    payload_len: int = 0
    replicas: int = 0

    @property
    def signed(self) -> bool:
        return bool(self.flags & FLAG_SIGNED)

    @property
    def signed_over_digest(self) -> bool:
        """The signature is over :func:`signed_digest` (flags bit 1)."""
        return bool(self.flags & FLAG_SIGNED_DIGEST)


@dataclass(frozen=True, slots=True)
class PayloadLayout:
    """Byte lengths of a payload's sections, in order: scales, values, index stream."""

    scales: int
    values: int
    index: int

    @property
    def total(self) -> int:
        return self.scales + self.values + self.index


def scale_count(codec: Codec, count: int, block_size: int) -> int:
    if not codec.has_scales or count == 0:
        return 0
    return -(-count // block_size)


def fixed_sections(header: ChunkHeader) -> tuple[int, int]:
    """Lengths of the scale and value sections that the header fixes."""
    scales = scale_count(header.codec, header.count, header.block_size) * SCALE_BYTES
    return scales, -(-header.count * header.codec.value_bits // 8)


def build_chunk(header: ChunkHeader, sections: Sequence[memoryview | bytes]) -> bytearray:
    """Serialize a header and its payload sections into one new buffer.

    ``header.payload_len``, ``header_len``, ``flags`` and ``signature`` are taken
    from the arguments: the payload length is the sum of the sections, the chunk
    is unsigned and its checksum is computed here."""
    payload_len = sum(len(s) for s in sections)
    if payload_len > MAX_PAYLOAD_BYTES:
        raise OversizeChunkError(f"payload of {payload_len} bytes exceeds {MAX_PAYLOAD_BYTES}")
    _check_header_fields(header, payload_len)
    header_len = HEADER_REPLICAS_LEN if header.replicas else HEADER_V1_LEN
    buf = bytearray(header_len + payload_len)
    _HEADER.pack_into(
        buf,
        0,
        MAGIC,
        VERSION,
        0,
        header_len,
        int(header.codec),
        int(header.index_code),
        header.rice_bits,
        0,
        header.block_size,
        0,
        header.run_id,
        header.origin,
        header.incarnation,
        header.step,
        header.layout_id,
        header.range_start,
        header.range_len,
        header.bucket,
        header.count,
        payload_len,
        0,
        bytes(SIGNATURE_LEN),
    )
    if header.replicas:
        _REPLICAS.pack_into(buf, HEADER_V1_LEN, header.replicas)
    view = memoryview(buf)
    pos = header_len
    for s in sections:
        n = len(s)
        view[pos : pos + n] = s
        pos += n
    struct.pack_into("<I", buf, _CHECKSUM_OFFSET, _checksum(view))
    return buf


_FLAGS_OFFSET = 5


def _checksum(view: memoryview) -> int:
    crc = zlib.crc32(view[:_FLAGS_OFFSET])
    crc = zlib.crc32(view[_FLAGS_OFFSET + 1 : _CHECKSUM_OFFSET], crc)
    return zlib.crc32(view[_SIGNATURE_END:], crc)


def signed_region(chunk: bytes | bytearray | memoryview) -> tuple[memoryview, ...]:
    """The byte ranges an origin signs, in order: the whole chunk except the flags
    byte and the signature slot (the checksum is included)."""
    view = memoryview(chunk).cast("B")
    return view[:_FLAGS_OFFSET], view[_FLAGS_OFFSET + 1 : _SIGNATURE_OFFSET], view[_SIGNATURE_END:]


def signed_digest(chunk: bytes | bytearray | memoryview) -> bytes:
    """What an origin signs since flags bit 1: ``SIGNED_DIGEST_TAG`` and the SHA-256
    of :func:`signed_region` (hashed in place, no copy)."""
    digest = hashlib.sha256()
    for part in signed_region(chunk):
        digest.update(part)
    return SIGNED_DIGEST_TAG + digest.digest()


def set_signature(chunk: bytearray, signature: bytes, over_digest: bool = True) -> None:
    """Fill the signature slot and mark the chunk signed (``over_digest``: the
    signature is over :func:`signed_digest`; otherwise over the region's bytes)."""
    if len(signature) != SIGNATURE_LEN:
        raise ValueError("an Ed25519 signature is 64 bytes")
    chunk[_SIGNATURE_OFFSET:_SIGNATURE_END] = signature
    chunk[_FLAGS_OFFSET] = (chunk[_FLAGS_OFFSET] & ~FLAG_SIGNED_DIGEST) | FLAG_SIGNED
    if over_digest:
        chunk[_FLAGS_OFFSET] |= FLAG_SIGNED_DIGEST


def signed_copy(
    chunk: bytes | bytearray | memoryview, signature: bytes, prefix: bytes = b""
) -> bytes:
    """``prefix`` then a copy of ``chunk`` with ``signature`` (over
    :func:`signed_digest`) in its slot and its flags saying so: one pass over the
    chunk, where a copy to sign in place and a second one to prefix it were two."""
    if len(signature) != SIGNATURE_LEN:
        raise ValueError("an Ed25519 signature is 64 bytes")
    view = memoryview(chunk).cast("B")
    flags = (view[_FLAGS_OFFSET] & ~FLAG_SIGNED_DIGEST) | FLAG_SIGNED | FLAG_SIGNED_DIGEST
    return b"".join(
        (
            prefix,
            view[:_FLAGS_OFFSET],
            bytes((flags,)),
            view[_FLAGS_OFFSET + 1 : _SIGNATURE_OFFSET],
            signature,
            view[_SIGNATURE_END:],
        )
    )


def parse_chunk(chunk: bytes | bytearray | memoryview) -> tuple[ChunkHeader, memoryview]:
    """Validate a chunk's framing and return its header and payload view.

    Checks, in order: size limits, magic, version, header length, checksum, then
    the consistency of every header field and of the payload length with the
    codec. It does not decode the index stream (core.codec.bucket does)."""
    view = memoryview(chunk).cast("B")
    n = len(view)
    if n > MAX_CHUNK_BYTES:
        raise OversizeChunkError(f"chunk of {n} bytes exceeds the limit of {MAX_CHUNK_BYTES}")
    if n < 8:
        raise TruncatedChunkError(f"{n} bytes is shorter than a chunk's fixed prefix")
    if bytes(view[:4]) != MAGIC:
        raise BadMagicError("not a ciuic chunk (bad magic)")
    if view[4] != VERSION:
        raise UnsupportedVersionError(f"chunk version {view[4]}, this node reads {VERSION}")
    header_len = int.from_bytes(view[6:8], "little")
    if header_len < HEADER_V1_LEN or header_len > MAX_HEADER_LEN:
        raise InconsistentChunkError(f"header length {header_len} outside [184, 1024]")
    if n < header_len:
        raise TruncatedChunkError(f"{n} bytes, header announces {header_len}")
    fields = _HEADER.unpack_from(view, 0)
    (
        _magic,
        _version,
        flags,
        _hl,
        codec_raw,
        index_raw,
        rice_bits,
        reserved1,
        block_size,
        reserved2,
        run_id,
        origin,
        incarnation,
        step,
        layout_id,
        range_start,
        range_len,
        bucket,
        count,
        payload_len,
        checksum,
        signature,
    ) = fields
    if payload_len > MAX_PAYLOAD_BYTES:
        raise OversizeChunkError(f"payload of {payload_len} bytes exceeds {MAX_PAYLOAD_BYTES}")
    if n < header_len + payload_len:
        raise TruncatedChunkError(f"{n} bytes, chunk announces {header_len + payload_len}")
    if n > header_len + payload_len:
        raise InconsistentChunkError(
            f"{n - header_len - payload_len} trailing bytes after the announced payload"
        )
    if _checksum(view) != checksum:
        raise ChecksumMismatchError("checksum over header and payload does not match")
    if flags & ~_KNOWN_FLAGS or reserved1 or reserved2:
        raise InconsistentChunkError("unknown flags or non-zero reserved fields")
    try:
        codec = Codec(codec_raw)
        index_code = IndexCode(index_raw)
    except ValueError as exc:
        raise InconsistentChunkError(
            f"unknown codec {codec_raw} or index code {index_raw}"
        ) from exc
    replicas = 0
    if header_len >= HEADER_REPLICAS_LEN:
        (replicas,) = _REPLICAS.unpack_from(view, HEADER_V1_LEN)
    header = ChunkHeader(
        codec=codec,
        index_code=index_code,
        rice_bits=rice_bits,
        block_size=block_size,
        run_id=bytes(run_id),
        origin=bytes(origin),
        incarnation=incarnation,
        step=step,
        layout_id=layout_id,
        bucket=bucket,
        range_start=range_start,
        range_len=range_len,
        count=count,
        flags=flags,
        signature=bytes(signature),
        header_len=header_len,
        payload_len=payload_len,
        replicas=replicas,
    )
    _check_header_fields(header, payload_len)
    return header, view[header_len:]


def _check_header_fields(h: ChunkHeader, payload_len: int) -> None:
    """Cross-field consistency, shared by the writer (a bug guard) and the reader."""
    if len(h.run_id) != RUN_ID_LEN or len(h.origin) != ORIGIN_LEN:
        raise InconsistentChunkError("run_id must be 16 bytes and origin 32 bytes")
    for name in ("incarnation", "step", "layout_id"):
        if not 0 <= getattr(h, name) <= _U64_MAX:
            raise InconsistentChunkError(f"{name} out of range")
    if h.range_len > MAX_RANGE_LEN or h.range_start > MAX_RANGE_LEN - h.range_len:
        raise OversizeChunkError(
            f"range [{h.range_start}, +{h.range_len}) exceeds the bucket limit"
        )
    if not 0 <= h.replicas <= MAX_REPLICAS:
        raise InconsistentChunkError(f"replicas {h.replicas} outside [0, {MAX_REPLICAS}]")
    if h.range_start < 0 or h.range_len < 0 or h.bucket < 0 or h.count < 0:
        raise InconsistentChunkError("negative field")
    if h.count > h.range_len:
        raise InconsistentChunkError(f"count {h.count} > range length {h.range_len} (k > n)")
    if h.codec.has_scales:
        if not 1 <= h.block_size <= MAX_BLOCK_SIZE:
            raise InconsistentChunkError(f"block size {h.block_size} outside [1, {MAX_BLOCK_SIZE}]")
    elif h.block_size != 0:
        raise InconsistentChunkError("block size set for a codec without scales")
    _check_payload_size(h, payload_len)


def _check_payload_size(h: ChunkHeader, payload_len: int) -> None:
    scales, values = fixed_sections(h)
    if h.codec.is_sparse:
        if h.index_code is not IndexCode.RICE_SPLIT:
            raise InconsistentChunkError("sparse codec without an index code")
        if h.rice_bits > MAX_RICE_BITS:
            raise InconsistentChunkError(f"rice parameter {h.rice_bits} > {MAX_RICE_BITS}")
        # Each position costs rice_bits fixed bits plus at least one unary bit.
        min_index = -(-h.count * h.rice_bits // 8) + (-(-h.count // 8))
        if payload_len < scales + values + min_index:
            raise InconsistentChunkError(
                f"payload of {payload_len} bytes too short for {h.count} sparse values"
            )
    else:
        if h.index_code is not IndexCode.NONE or h.rice_bits != 0:
            raise InconsistentChunkError("dense codec with an index code")
        if h.count != h.range_len:
            raise InconsistentChunkError("dense chunk must carry every element of its range")
        if payload_len != scales + values:
            raise InconsistentChunkError(
                f"dense payload is {payload_len} bytes, expected {scales + values}"
            )
