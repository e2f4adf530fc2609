"""One exception hierarchy for the whole project.

Every error that a caller may want to handle derives from :class:`CiuicError`, so an
I/O edge can map "anything of ours" to a log line, a refused peer or a clean exit
without catching programming errors (``TypeError`` and friends) by accident.
"""

from __future__ import annotations


class CiuicError(Exception):
    """Base class of every error raised on purpose by ciuic-p2p."""


class TransientError(CiuicError):
    """A failure that may pass by itself (a port still held by a process that is
    exiting): the command exits with status 1, which systemd retries, not 2."""


class ConfigError(CiuicError):
    """A configuration value or file is invalid; the message names the key and why."""


# --- codec and wire format -------------------------------------------------------------


class CodecError(CiuicError):
    """Encoding or decoding an update chunk failed."""


class NonFiniteUpdateError(CodecError):
    """An update handed to the encoder holds NaN or Inf; nothing was sent or changed."""


class ChunkDecodeError(CodecError):
    """Bytes received as a chunk are not a valid chunk. Never raised for valid input."""


class TruncatedChunkError(ChunkDecodeError):
    """The bytes end before the header or the payload the header announces."""


class OversizeChunkError(ChunkDecodeError):
    """A size in the chunk (total, payload, count or range) exceeds a hard limit."""


class BadMagicError(ChunkDecodeError):
    """The bytes do not start with the chunk magic: not a chunk at all."""


class UnsupportedVersionError(ChunkDecodeError):
    """The chunk was written by an incompatible wire-format version."""


class ChecksumMismatchError(ChunkDecodeError):
    """The integrity check over header and payload does not match: corrupted bytes."""


class InconsistentChunkError(ChunkDecodeError):
    """Fields disagree with each other or with the payload: wrong lengths, indices out of
    range or not increasing, k > n, an unknown codec, a non-finite scale or value."""


class ChunkMismatchError(CodecError):
    """A valid chunk does not fit the receiver's model: another run, another parameter
    layout, or a range outside the bucket."""


# --- identity, admission and transport ---------------------------------------------------


class IdentityError(CiuicError):
    """A node key cannot be created, read or used; the message says which file and why."""


class AdmissionError(CiuicError):
    """A peer's credential does not admit it to this cluster (wrong CA, expired,
    revoked, another cluster, bad proof of possession)."""


class SignatureError(CodecError):
    """A chunk's origin signature is missing or does not verify."""


class ReplayedChunkError(CodecError):
    """A chunk already received from its origin arrived again."""


class LayoutMismatchError(CiuicError):
    """The replicas this one hears of its run train another model (parameter names,
    shapes or order), and none trains its own: it would only ever train alone."""
