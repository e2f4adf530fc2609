from __future__ import annotations

import datetime as dt

import pytest
from cryptography.hazmat.primitives import serialization

from ciuic_p2p.admission import ClusterCA, Trust
from ciuic_p2p.core.link.auth import build_auth, check_auth
from ciuic_p2p.errors import AdmissionError
from ciuic_p2p.identity import NodeKey

NOW = dt.datetime(2026, 11, 30, tzinfo=dt.UTC)
SERVER = NodeKey.generate().public_key


def der(cert: object) -> bytes:
    return cert.public_bytes(serialization.Encoding.DER)  # type: ignore[attr-defined,no-any-return]


def test_proof_binds_the_connection_and_the_server() -> None:
    ca = ClusterCA.create("alpha", NOW)
    key = NodeKey.generate()
    cert = der(ca.issue(key.public_key, NOW))
    trust = Trust(ca.certificate)
    proof = build_auth(key, cert, "alpha", SERVER, b"cid-1", b"odcid")
    assert check_auth(proof, trust, NOW, SERVER, b"cid-1", b"odcid")[0] == key.public_key
    for server, cid, odcid in (
        (SERVER, b"cid-2", b"odcid"),
        (b"s" * 32, b"cid-1", b"odcid"),
        (SERVER, b"cid-1", b"other"),
    ):
        with pytest.raises(AdmissionError, match="does not verify"):
            check_auth(proof, trust, NOW, server, cid, odcid)


def test_stolen_certificate_without_the_key_is_useless() -> None:
    ca = ClusterCA.create("alpha", NOW)
    victim = NodeKey.generate()
    cert = der(ca.issue(victim.public_key, NOW))
    proof = build_auth(NodeKey.generate(), cert, "alpha", SERVER, b"c", b"o")
    with pytest.raises(AdmissionError, match="does not verify"):
        check_auth(proof, Trust(ca.certificate), NOW, SERVER, b"c", b"o")


@pytest.mark.parametrize("payload", [b"", b"\x01", b"\x02\x00\x00" + b"x" * 64, b"\x01\x05\x00abc"])
def test_malformed_proofs_are_refused(payload: bytes) -> None:
    ca = ClusterCA.create("alpha", NOW)
    with pytest.raises(AdmissionError):
        check_auth(payload, Trust(ca.certificate), NOW, SERVER, b"c", b"o")
