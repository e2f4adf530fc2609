"""Signed mesh messages for unit tests of the pure cores: real keys and signatures
from the simulator's authority (emulator.meshsim), as every node checks them."""

from __future__ import annotations

import dataclasses
from typing import TypeVar

from ciuic_p2p.core.mesh.identities import Identities
from ciuic_p2p.core.mesh.messages import Alive, Chunk, Left, Links, signed_bytes
from ciuic_p2p.emulator.meshsim import SimAuthority

AUTHORITY = SimAuthority(seed=77)
U = TypeVar("U", Alive, Left, Links, Chunk)


def identities(name: str, *known: str) -> Identities:
    """``name``'s identities, holding the credentials of ``known``."""
    ids = AUTHORITY.identities(name)
    for other in known:
        assert ids.learn(other, AUTHORITY.credential(other))
    return ids


def signed(u: U, by: str | None = None) -> U:
    """``u`` signed by its own node (or by ``by``: a forgery)."""
    signer = by or (u.origin if isinstance(u, Chunk | Links) else u.node)
    return dataclasses.replace(u, signature=AUTHORITY.key_of(signer).sign(signed_bytes(u)))


def chunk(origin: str, seq: int, payload: bytes = b"x", hops: int = 0) -> Chunk:
    return signed(Chunk(origin, seq, hops, payload))
