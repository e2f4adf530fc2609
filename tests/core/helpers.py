"""Test helpers built only on the documented wire layout (core/codec/chunk.py docstring)."""

from __future__ import annotations

import struct
import zlib

import torch

from ciuic_p2p.core.codec.bucket import BucketEncoder, BucketSpec, ChunkSource
from ciuic_p2p.core.codec.chunk import Codec

SOURCE = ChunkSource(run_id=bytes(range(16)), origin=bytes(range(32)), incarnation=3, layout_id=99)


def reseal(chunk: bytearray) -> bytearray:
    """Recompute the CRC-32 of a (mutated) chunk as the format documents it: over the
    header without the flags byte (5), the checksum (116..120) and the signature slot
    (120..184), then the rest."""
    crc = zlib.crc32(bytes(chunk[:5]))
    crc = zlib.crc32(bytes(chunk[6:116]), crc)
    crc = zlib.crc32(bytes(chunk[184:]), crc)
    struct.pack_into("<I", chunk, 116, crc)
    return chunk


def heavy_tailed(n: int, seed: int, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Student-t with 3 degrees of freedom as a ratio of normals and chi-square.
    z = torch.randn(n, generator=g)
    chi = torch.randn(n, 3, generator=g).pow(2).sum(dim=1)
    return (z / (chi / 3).sqrt()).to(device)


def encoder(
    n: int,
    codec: Codec = Codec.SPARSE_INT8,
    device: str = "cpu",
    **spec: object,
) -> BucketEncoder:
    return BucketEncoder(0, n, BucketSpec(codec=codec, **spec), SOURCE, device=device)  # type: ignore[arg-type]
