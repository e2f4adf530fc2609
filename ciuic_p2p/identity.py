"""Node identity: an Ed25519 key pair per node, and the peer ID derived from it.

The private key lives in a PEM (PKCS#8) file that only its owner may read: loading a
key file that the group or others can read fails, as ssh does, because a copied node
key lets its holder act as that node until the node is revoked.

The peer ID is ``ciuic`` followed by the lower-case base32 of the first 20 bytes of
SHA-256 over the raw 32-byte public key: 37 characters, safe in file names, URLs and
shells, and easy to copy. Within this module's callers a node is identified by its
raw public key; the peer ID is for people and logs.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ciuic_p2p.core.link.keys import (
    PEER_ID_PREFIX,
    PUBLIC_KEY_LEN,
    SIGNATURE_LEN,
    peer_id_of,
    raw_public_key,
    verify_signature,
)
from ciuic_p2p.errors import IdentityError

__all__ = [
    "PEER_ID_PREFIX",
    "PUBLIC_KEY_LEN",
    "SIGNATURE_LEN",
    "NodeKey",
    "peer_id_of",
    "raw_public_key",
    "verify_signature",
]


@dataclass(frozen=True)
class NodeKey:
    """A node's Ed25519 key pair."""

    private_key: Ed25519PrivateKey

    @classmethod
    def generate(cls) -> NodeKey:
        return cls(Ed25519PrivateKey.generate())

    @property
    def public_key(self) -> bytes:
        """The raw 32-byte public key."""
        return raw_public_key(self.private_key.public_key())

    @property
    def peer_id(self) -> str:
        return peer_id_of(self.public_key)

    def sign(self, *message: bytes | memoryview) -> bytes:
        # join takes the views as they are: one copy of a chunk, not two.
        return self.private_key.sign(message[0] if len(message) == 1 else b"".join(message))

    def to_pem(self) -> bytes:
        return self.private_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    def save(self, path: str | Path, *, overwrite: bool = False) -> None:
        """Write the key, readable and writable by the owner only (mode 0600). The
        file is created with that mode, never widened afterwards."""
        p = Path(path)
        flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if overwrite else os.O_EXCL)
        try:
            fd = os.open(p, flags, 0o600)
        except FileExistsError as exc:
            raise IdentityError(f"{p}: already exists; refusing to overwrite a key") from exc
        except OSError as exc:
            raise IdentityError(f"{p}: cannot create key file: {exc.strerror}") from exc
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o600)
            f.write(self.to_pem())

    @classmethod
    def load(cls, path: str | Path) -> NodeKey:
        """Read a key file; refuse one that others can read, or that is not an
        Ed25519 private key."""
        p = Path(path)
        try:
            mode = p.stat().st_mode
            data = p.read_bytes()
        except OSError as exc:
            raise IdentityError(f"{p}: cannot read key file: {exc.strerror}") from exc
        if stat.S_IMODE(mode) & 0o077:
            raise IdentityError(
                f"{p}: permissions {stat.S_IMODE(mode):04o} are too open; the key must be "
                f"readable by its owner only (chmod 600 {p})"
            )
        try:
            key = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError) as exc:
            raise IdentityError(f"{p}: not a PEM private key (malformed or encrypted)") from exc
        if not isinstance(key, Ed25519PrivateKey):
            raise IdentityError(f"{p}: not an Ed25519 key ({type(key).__name__})")
        return cls(key)
