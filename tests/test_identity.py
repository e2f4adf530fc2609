from __future__ import annotations

import datetime as dt
import os
from pathlib import Path

import pytest

from ciuic_p2p.admission import ClusterCA, Trust, load_certificate, write_pem
from ciuic_p2p.errors import AdmissionError, IdentityError
from ciuic_p2p.identity import NodeKey, peer_id_of

NOW = dt.datetime(2026, 11, 30, tzinfo=dt.UTC)


def test_key_file_is_owner_only_and_round_trips(tmp_path: Path) -> None:
    key = NodeKey.generate()
    path = tmp_path / "node.key"
    key.save(path)
    assert (path.stat().st_mode & 0o777) == 0o600
    assert NodeKey.load(path).public_key == key.public_key
    with pytest.raises(IdentityError, match="already exists"):
        key.save(path)


def test_loose_permissions_are_refused_with_the_fix(tmp_path: Path) -> None:
    path = tmp_path / "node.key"
    NodeKey.generate().save(path)
    os.chmod(path, 0o644)
    with pytest.raises(IdentityError, match=r"too open.*chmod 600"):
        NodeKey.load(path)


@pytest.mark.parametrize("content", [b"", b"garbage", b"-----BEGIN PRIVATE KEY-----\nAAAA\n"])
def test_malformed_key_is_refused_clearly(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "node.key"
    path.write_bytes(content)
    os.chmod(path, 0o600)
    with pytest.raises(IdentityError, match="not a PEM private key"):
        NodeKey.load(path)


def test_peer_id_is_short_printable_and_stable() -> None:
    key = NodeKey.generate()
    pid = key.peer_id
    assert pid.startswith("ciuic") and len(pid) == 37 and pid.isalnum() and pid == pid.lower()
    assert peer_id_of(key.public_key) == pid != NodeKey.generate().peer_id


def test_node_certificate_admits_its_node_only_in_its_cluster(tmp_path: Path) -> None:
    ca = ClusterCA.create("alpha", NOW)
    key = NodeKey.generate()
    cert = ca.issue(key.public_key, NOW)
    trust = Trust(ca.certificate)
    assert trust.verify(cert, NOW) == key.public_key
    other = ClusterCA.create("alpha", NOW)  # same name, other CA key
    with pytest.raises(AdmissionError, match="not signed by this cluster's CA"):
        Trust(other.certificate).verify(cert, NOW)
    with pytest.raises(AdmissionError, match="not now"):
        trust.verify(cert, NOW + dt.timedelta(days=400))
    ca.save(tmp_path / "ca")
    write_pem(tmp_path / "n.pem", cert)
    loaded = ClusterCA.load(tmp_path / "ca")
    assert Trust(loaded.certificate).verify(load_certificate(tmp_path / "n.pem"), NOW)


def test_revoked_node_is_refused() -> None:
    ca = ClusterCA.create("alpha", NOW)
    good, bad = (ca.issue(NodeKey.generate().public_key, NOW) for _ in range(2))
    trust = Trust(ca.certificate, ca.revocation_list([bad.serial_number], NOW))
    trust.verify(good, NOW)
    with pytest.raises(AdmissionError, match="revoked"):
        trust.verify(bad, NOW)
    forged = ClusterCA.create("alpha", NOW).revocation_list([], NOW)
    with pytest.raises(AdmissionError, match="not signed"):
        Trust(ca.certificate, forged)


def test_ca_certificate_is_not_a_node_certificate() -> None:
    ca = ClusterCA.create("alpha", NOW)
    with pytest.raises(AdmissionError):
        Trust(ca.certificate).verify(ca.certificate, NOW)
