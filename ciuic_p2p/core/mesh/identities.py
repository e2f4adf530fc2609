"""Who is who in the mesh: this node's signing key and credential, and the public
keys of the members whose credentials were checked.

Membership and dissemination take nothing on a sender's word about another node:
where a node lives (``Alive``), that it left (``Left``), what its links measure
(``Links``) and every chunk it publishes (``Chunk``) carry that node's own signature
(core.mesh.messages), checked here against the key its credential binds to its name. A
credential is checked once, by the ``check`` function given at construction: in the
daemon, the node certificate against the cluster CA, its validity and revocation,
and its subject against the name (daemon.node); in simulations, the simulator's own
authority (emulator.meshsim). Whoever holds no credential accepted here cannot be a
member, and cannot be spoken for.

Pure: no clock, no I/O. Bounded: at most ``max_known`` credentials are held (members
first); public keys are parsed once per node.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Callable

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from ciuic_p2p.core.mesh.messages import (
    Alive,
    Chunk,
    Credential,
    Left,
    Links,
    payload_digest,
    signed_bytes,
)
from ciuic_p2p.errors import CiuicError

CredentialCheck = Callable[[str, bytes], bytes]
"""``check(node, credential) -> public key`` (raw Ed25519, 32 bytes); raises a
:class:`ciuic_p2p.errors.CiuicError` (``AdmissionError``) when the credential does not
make ``node`` a member."""

Signed = Alive | Left | Links | Chunk


class Identities:
    def __init__(
        self,
        node: str,
        credential: bytes,
        sign: Callable[[bytes], bytes],
        check: CredentialCheck,
        *,
        max_known: int = 8192,
    ) -> None:
        self.node = node
        self.credential = credential
        """This node's own credential (sent with its Alive)."""
        self._sign = sign
        self._check = check
        self.max_known = max_known
        self._credentials: dict[str, bytes] = {}
        self._raw: dict[str, bytes] = {}
        self._keys: dict[str, Ed25519PublicKey] = {}
        """Parsed at the first signature checked (a large simulation learns a million
        credentials it never needs a key object for)."""
        self._refused: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        """Digests of (node, credential) refused lately: checked once, not at every
        repetition (bounded)."""
        self.counters: collections.Counter[str] = collections.Counter()
        """``credentials_refused``, ``bad_signatures``, ``unknown_signers``."""
        self.learn(node, credential)

    # -- credentials ------------------------------------------------------------------------

    def learn(
        self, node: str, credential: bytes, keep: Callable[[str], bool] | None = None
    ) -> bool:
        """Check ``credential`` for ``node`` and hold it; False (counted) if refused. A
        credential already held is not checked again. Past ``max_known`` the oldest held
        that ``keep`` does not protect (the members) is forgotten first."""
        if self._credentials.get(node) == credential:
            return True
        tag = hashlib.blake2b(node.encode() + b"\0" + credential, digest_size=16).digest()
        if tag in self._refused:
            self.counters["credentials_refused"] += 1
            return False
        try:
            raw = self._check(node, credential)
        except (CiuicError, ValueError):
            self.counters["credentials_refused"] += 1
            self._refused[tag] = None
            while len(self._refused) > 4096:
                self._refused.popitem(last=False)
            return False
        if len(raw) != 32:
            self.counters["credentials_refused"] += 1
            return False
        if node not in self._credentials and len(self._credentials) >= self.max_known:
            victim = next(
                (n for n in self._credentials if n != self.node and not (keep and keep(n))), None
            )
            if victim is None:
                self.counters["credentials_dropped"] += 1
                return False
            self.forget(victim)
        self._credentials[node] = credential
        if self._raw.get(node) != raw:
            self._raw[node] = raw
            self._keys.pop(node, None)
        return True

    def knows(self, node: str) -> bool:
        return node in self._raw

    def public_key(self, node: str) -> bytes | None:
        return self._raw.get(node)

    def credential_of(self, node: str) -> Credential | None:
        raw = self._credentials.get(node)
        return None if raw is None else Credential(node, raw)

    def forget(self, node: str) -> None:
        if node != self.node:
            self._credentials.pop(node, None)
            self._raw.pop(node, None)
            self._keys.pop(node, None)

    def recheck(self) -> list[str]:
        """Check every held credential again (the trust changed: a revocation list was
        reloaded); forget and return the nodes now refused."""
        refused = []
        for node, credential in list(self._credentials.items()):
            try:
                self._check(node, credential)
            except (CiuicError, ValueError):
                refused.append(node)
                self.forget(node)
        return refused

    def __len__(self) -> int:
        return len(self._credentials)

    # -- signatures -------------------------------------------------------------------------

    def sign(self, u: Signed) -> bytes:
        """This node's signature over ``u`` (which must be this node's own)."""
        return self._sign(signed_bytes(u))

    def verify(self, signer: str, u: Signed, digest: bytes | None = None) -> bool:
        """Whether ``u`` carries ``signer``'s valid signature; False (counted) when it
        does not or ``signer`` has no credential here."""
        key = self._keys.get(signer)
        if key is None:
            raw = self._raw.get(signer)
            if raw is None:
                self.counters["unknown_signers"] += 1
                return False
            try:
                key = self._keys[signer] = Ed25519PublicKey.from_public_bytes(raw)
            except ValueError:
                self.counters["bad_signatures"] += 1
                return False
        try:
            key.verify(u.signature, signed_bytes(u, digest))
        except (InvalidSignature, ValueError):
            self.counters["bad_signatures"] += 1
            return False
        return True

    def verify_chunk(self, chunk: Chunk) -> bool:
        """A chunk's origin signature (one BLAKE2b pass over the payload, one Ed25519
        verification of 100-odd bytes)."""
        return self.verify(chunk.origin, chunk, payload_digest(chunk.payload))
