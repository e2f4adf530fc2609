"""Who a key is: peer IDs and Ed25519 signature checks, pure (ciuic_p2p.identity
holds the node's key and its file).

The peer ID is ``ciuic`` followed by the lower-case base32 of the first 20 bytes of
SHA-256 over the raw 32-byte public key: 37 characters, safe in file names, URLs and
shells, and easy to copy. Within the cores a node is identified by its raw public key
or its peer ID; what signs is any :class:`Signer` (the node key is one).
"""

from __future__ import annotations

import base64
import hashlib
from typing import Protocol

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from ciuic_p2p.errors import IdentityError


class Signer(Protocol):
    """What signs for a node: its raw public key, and Ed25519 signatures over the
    concatenation of message parts."""

    @property
    def public_key(self) -> bytes: ...

    def sign(self, *message: bytes | memoryview) -> bytes: ...


PEER_ID_PREFIX = "ciuic"
PUBLIC_KEY_LEN = 32
SIGNATURE_LEN = 64


def peer_id_of(public_key: bytes) -> str:
    """The printable peer ID of a raw Ed25519 public key."""
    if len(public_key) != PUBLIC_KEY_LEN:
        raise IdentityError("an Ed25519 public key is 32 bytes")
    digest = hashlib.sha256(public_key).digest()[:20]
    return PEER_ID_PREFIX + base64.b32encode(digest).decode().lower()


def raw_public_key(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def verify_signature(public_key: bytes, signature: bytes, *message: bytes | memoryview) -> bool:
    """True when ``signature`` is the key's Ed25519 signature over the concatenation
    of ``message`` parts."""
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(
            signature, message[0] if len(message) == 1 else b"".join(message)
        )
    except (InvalidSignature, ValueError):
        return False
    return True
