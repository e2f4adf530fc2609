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

Bounded in CPU per member: a credential check costs a certificate parse and an Ed25519
verification (about 0.1 to 0.3 ms), and a member can carry a hundred fresh
certificates in every gossip frame. So a credential relayed by a member (``sender``)
is checked only while that member's token bucket allows (``check_burst`` at once,
refilled at ``checks_per_s``); a check that ends in a refusal spends a token, one that
accepts gives it back (an honest member relays only credentials it accepted itself, so
its bucket stays full however many members it announces at once). Past the bucket,
the member's unknown credentials are dropped unchecked and counted
(``credentials_unchecked``): one member's lies cost this node at most
``check_burst + checks_per_s * t`` checks, and never another member's. Refusals are
remembered per sender (a pool of fresh certificates larger than any cache flushes only
its own sender's memory), and every accepted credential is remembered by digest
(``verified_cache``), so one seen again is not checked again.
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

CHECK_BURST = 16
"""Refused credential checks one sender may cost at once (its bucket's depth)."""
CHECKS_PER_S = 4.0
"""Refused credential checks one sender may cost per second, past the burst: at the
0.3 ms a check costs at most, about 0.1 % of a core per lying member."""
MAX_SENDERS = 4096
"""Senders whose buckets are held (the least recently heard forgotten first; senders
are members whose link authenticated them, so a liar is one sender)."""
REFUSALS_PER_SENDER = 64
"""Refused credentials remembered per sender: repeated, refused without a check and
without a token."""
VERIFIED_CACHE = 8192
"""Digests of accepted (node, credential) pairs remembered: one seen again is taken
without a check (emptied when the trust changes, :meth:`Identities.recheck`)."""


class _Bucket:
    """One sender's credential checks: a token bucket and the refusals it sent."""

    __slots__ = ("at", "refused", "tokens")

    def __init__(self, tokens: float, now: float) -> None:
        self.tokens = tokens
        self.at = now
        self.refused: collections.OrderedDict[bytes, None] = collections.OrderedDict()

    def refill(self, now: float, rate: float, depth: float) -> None:
        if now > self.at:
            self.tokens = min(depth, self.tokens + (now - self.at) * rate)
        self.at = max(self.at, now)


class Identities:
    def __init__(
        self,
        node: str,
        credential: bytes,
        sign: Callable[[bytes], bytes],
        check: CredentialCheck,
        *,
        max_known: int = 8192,
        check_burst: int = CHECK_BURST,
        checks_per_s: float = CHECKS_PER_S,
    ) -> None:
        self.node = node
        self.credential = credential
        """This node's own credential (sent with its Alive)."""
        self._sign = sign
        self._check = check
        self.max_known = max_known
        self.check_burst = check_burst
        self.checks_per_s = checks_per_s
        self._credentials: dict[str, bytes] = {}
        self._raw: dict[str, bytes] = {}
        self._keys: dict[str, Ed25519PublicKey] = {}
        """Parsed at the first signature checked (a large simulation learns a million
        credentials it never needs a key object for)."""
        self._refused: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        """Digests of (node, credential) refused lately that no member relayed (an
        authenticated link's own certificate): checked once, not at every repetition
        (bounded). What members relay is remembered per sender (``_buckets``)."""
        self._buckets: collections.OrderedDict[str, _Bucket] = collections.OrderedDict()
        """Each sender's bucket of checks and the refusals it sent, least recently heard
        first (at most ``MAX_SENDERS``)."""
        self._verified: collections.OrderedDict[bytes, bytes] = collections.OrderedDict()
        """Digest of an accepted (node, credential) to its raw public key (at most
        ``VERIFIED_CACHE``, least recently used first)."""
        self.counters: collections.Counter[str] = collections.Counter()
        """``credential_checks`` (each check run), ``credentials_refused``,
        ``credentials_unchecked`` (dropped past their sender's bucket),
        ``credentials_cached`` (taken from the verified cache), ``credentials_dropped``,
        ``bad_signatures``, ``unknown_signers``."""
        self.learn(node, credential)

    # -- credentials ------------------------------------------------------------------------

    def learn(
        self,
        node: str,
        credential: bytes,
        keep: Callable[[str], bool] | None = None,
        *,
        sender: str | None = None,
        now: float = 0.0,
    ) -> bool:
        """Check ``credential`` for ``node`` and hold it; False (counted) if refused. A
        credential already held, or accepted before (by digest), is not checked again.
        ``sender``: the member that relayed it, whose bucket pays for a check that
        refuses (module docstring); None for a credential no member relayed (an
        authenticated link's certificate). Past ``max_known`` the oldest held that
        ``keep`` does not protect (the members) is forgotten first."""
        if self._credentials.get(node) == credential:
            return True
        tag = hashlib.blake2b(node.encode() + b"\0" + credential, digest_size=16).digest()
        raw = self._verified.get(tag)
        if raw is not None:
            self._verified.move_to_end(tag)
            self.counters["credentials_cached"] += 1
            return self._hold(node, credential, raw, keep)
        bucket = None if sender is None else self._bucket(sender, now)
        refused = self._refused if bucket is None else bucket.refused
        if tag in refused:
            self.counters["credentials_refused"] += 1
            return False
        if bucket is not None:
            if bucket.tokens < 1:
                self.counters["credentials_unchecked"] += 1
                return False
            bucket.tokens -= 1
        self.counters["credential_checks"] += 1
        try:
            raw = self._check(node, credential)
        except (CiuicError, ValueError):
            raw = b""
        if len(raw) != 32:
            self.counters["credentials_refused"] += 1
            refused[tag] = None
            while len(refused) > (4096 if bucket is None else REFUSALS_PER_SENDER):
                refused.popitem(last=False)
            return False
        if bucket is not None:
            bucket.tokens += 1  # accepted: the check is not the sender's to pay
        self._verified[tag] = raw
        while len(self._verified) > VERIFIED_CACHE:
            self._verified.popitem(last=False)
        return self._hold(node, credential, raw, keep)

    def _bucket(self, sender: str, now: float) -> _Bucket:
        bucket = self._buckets.get(sender)
        if bucket is None:
            bucket = self._buckets[sender] = _Bucket(float(self.check_burst), now)
            while len(self._buckets) > MAX_SENDERS:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(sender)
            bucket.refill(now, self.checks_per_s, float(self.check_burst))
        return bucket

    def _hold(
        self, node: str, credential: bytes, raw: bytes, keep: Callable[[str], bool] | None
    ) -> bool:
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
        reloaded); forget and return the nodes now refused. What was remembered as
        accepted or refused under the old trust is forgotten."""
        self._verified.clear()
        self._refused.clear()
        for bucket in self._buckets.values():
            bucket.refused.clear()
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
