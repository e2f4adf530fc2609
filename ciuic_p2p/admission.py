"""Cluster admission: a cluster CA, node certificates, and revocation.

Who holds what:

- The **cluster CA key** (Ed25519, ``ca.key``) belongs to the operator and should stay
  offline: it is needed only to admit (``ca issue``) and remove (``ca revoke``) nodes.
- Each node holds its own **node key** (see ciuic_p2p.identity) and a **node
  certificate** (X.509, signed by the CA) that binds that key to its peer ID and the
  cluster name. The certificate is the node's TLS certificate, so a client checks the
  server's admission during the QUIC handshake, and the server checks the client's
  admission from the certificate the client sends with its proof of possession.
- A **revocation list** (an X.509 CRL signed by the CA) names the serial numbers of
  removed nodes. Nodes load it from their state directory; a revoked node is refused
  by every node that has the list.

Verification here is our own (aioquic neither requires nor checks client
certificates, see docs/architecture.md): the issuer signature is checked with the CA's
public key, validity against the caller's ``now``, the subject against the key, and
the serial against the CRL. No I/O beyond the explicit load/save helpers.
"""

from __future__ import annotations

import datetime as dt
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.x509.oid import NameOID

from ciuic_p2p.core.link.trust import Trust, cluster_of, describe_subject
from ciuic_p2p.errors import AdmissionError
from ciuic_p2p.identity import NodeKey, peer_id_of

__all__ = [
    "CA_VALIDITY",
    "DEFAULT_NODE_VALIDITY",
    "ClusterCA",
    "Trust",
    "cluster_of",
    "describe_subject",
    "load_certificate",
    "load_crl",
    "write_pem",
]

DEFAULT_NODE_VALIDITY = dt.timedelta(days=365)
CA_VALIDITY = dt.timedelta(days=3650)


def _name(common_name: str, cluster: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, cluster),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


@dataclass(frozen=True)
class ClusterCA:
    """The CA of one cluster: its key and self-signed certificate."""

    key: NodeKey
    certificate: x509.Certificate

    @property
    def cluster(self) -> str:
        return cluster_of(self.certificate)

    @classmethod
    def create(cls, cluster: str, now: dt.datetime) -> ClusterCA:
        if not cluster or len(cluster) > 64:
            raise AdmissionError("cluster name must be 1 to 64 characters")
        key = NodeKey.generate()
        name = _name(f"{cluster} CA", cluster)
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.private_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + CA_VALIDITY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .sign(key.private_key, None)
        )
        return cls(key, cert)

    def issue(
        self,
        node_public_key: bytes,
        now: dt.datetime,
        validity: dt.timedelta = DEFAULT_NODE_VALIDITY,
    ) -> x509.Certificate:
        """A node certificate for a raw Ed25519 public key; its subject is the peer ID."""
        public = Ed25519PublicKey.from_public_bytes(node_public_key)
        return (
            x509.CertificateBuilder()
            .subject_name(_name(peer_id_of(node_public_key), self.cluster))
            .issuer_name(self.certificate.subject)
            .public_key(public)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + validity)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(self.key.private_key, None)
        )

    def revocation_list(
        self,
        serials: list[int],
        now: dt.datetime,
        next_update: dt.timedelta = dt.timedelta(days=30),
    ) -> x509.CertificateRevocationList:
        builder = (
            x509.CertificateRevocationListBuilder()
            .issuer_name(self.certificate.subject)
            .last_update(now)
            .next_update(now + next_update)
        )
        for serial in sorted(set(serials)):
            builder = builder.add_revoked_certificate(
                x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(now).build()
            )
        return builder.sign(self.key.private_key, None)

    # -- files --------------------------------------------------------------------------

    def save(self, directory: str | Path) -> None:
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self.key.save(d / "ca.key")
        (d / "ca.pem").write_bytes(self.certificate.public_bytes(serialization.Encoding.PEM))

    @classmethod
    def load(cls, directory: str | Path) -> ClusterCA:
        d = Path(directory)
        return cls(NodeKey.load(d / "ca.key"), load_certificate(d / "ca.pem"))


def load_certificate(path: str | Path) -> x509.Certificate:
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise AdmissionError(f"{p}: cannot read certificate: {exc.strerror}") from exc
    try:
        return x509.load_pem_x509_certificate(data)
    except ValueError as exc:
        raise AdmissionError(f"{p}: not a PEM certificate") from exc


def load_crl(path: str | Path) -> x509.CertificateRevocationList:
    p = Path(path)
    try:
        return x509.load_pem_x509_crl(p.read_bytes())
    except OSError as exc:
        raise AdmissionError(f"{p}: cannot read revocation list: {exc.strerror}") from exc
    except ValueError as exc:
        raise AdmissionError(f"{p}: not a PEM revocation list") from exc


def write_pem(path: str | Path, obj: x509.Certificate | x509.CertificateRevocationList) -> None:
    """Write a certificate or CRL atomically (readers never see half a file)."""
    p = Path(path)
    tmp = p.with_name(f".{p.name}.{secrets.token_hex(4)}.tmp")
    tmp.write_bytes(obj.public_bytes(serialization.Encoding.PEM))
    os.replace(tmp, p)
