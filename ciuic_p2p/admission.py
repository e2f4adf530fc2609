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
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.x509.oid import NameOID

from ciuic_p2p.errors import AdmissionError
from ciuic_p2p.identity import NodeKey, peer_id_of, raw_public_key

DEFAULT_NODE_VALIDITY = dt.timedelta(days=365)
CA_VALIDITY = dt.timedelta(days=3650)


def _name(common_name: str, cluster: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, cluster),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def cluster_of(cert: x509.Certificate) -> str:
    attrs = cert.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)
    return str(attrs[0].value) if attrs else ""


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


@dataclass(frozen=True)
class Trust:
    """What a node trusts: its cluster's CA certificate and current revocation list."""

    ca: x509.Certificate
    crl: x509.CertificateRevocationList | None = None

    def __post_init__(self) -> None:
        if self.crl is not None:
            ca_key = self.ca.public_key()
            if self.crl.issuer != self.ca.subject or not (
                isinstance(ca_key, Ed25519PublicKey) and self.crl.is_signature_valid(ca_key)
            ):
                raise AdmissionError("revocation list is not signed by this cluster's CA")

    @property
    def cluster(self) -> str:
        return cluster_of(self.ca)

    def verify(self, cert: x509.Certificate, now: dt.datetime) -> bytes:
        """Check a node certificate; return the node's raw public key or raise
        :class:`AdmissionError` saying why it is refused (also for a certificate whose
        fields cannot be parsed: whatever the bytes, nothing else is raised)."""
        ca_key = self.ca.public_key()
        if not isinstance(ca_key, Ed25519PublicKey):
            raise AdmissionError("cluster CA key is not Ed25519")
        fields = _read_fields(cert)
        if fields.issuer != self.ca.subject:
            raise AdmissionError(
                f"certificate issued by {fields.issuer_text}, not by this cluster's CA"
            )
        try:
            ca_key.verify(fields.signature, fields.tbs)
        except InvalidSignature as exc:
            raise AdmissionError("certificate not signed by this cluster's CA") from exc
        if not fields.not_before <= now <= fields.not_after:
            raise AdmissionError(
                f"certificate valid {fields.not_before:%Y-%m-%d} to "
                f"{fields.not_after:%Y-%m-%d}, not now"
            )
        if fields.raw_key is None:
            raise AdmissionError("node key is not Ed25519")
        raw = fields.raw_key
        if fields.common_name != peer_id_of(raw):
            raise AdmissionError("certificate subject does not match its key")
        if fields.cluster != self.cluster:
            raise AdmissionError(f"certificate of cluster {fields.cluster[:64]!r}")
        if fields.is_ca is not False:
            raise AdmissionError("not a node certificate")
        if self.crl is not None and self.crl.get_revoked_certificate_by_serial_number(
            fields.serial
        ):
            raise AdmissionError(f"node {peer_id_of(raw)} is revoked")
        return raw

    def check_member(self, node: str, der: bytes, now: dt.datetime) -> bytes:
        """A member's credential as gossip carries it (core.identities): the DER node
        certificate must pass :meth:`verify` and name ``node``; its raw public key."""
        try:
            cert = x509.load_der_x509_certificate(der)
            public = cert.public_key()
        except Exception:  # ValueError, x509.InvalidVersion...: a stranger's bytes
            raise AdmissionError("credential is not a certificate") from None
        # The name first: it costs no signature check (a member replaying its own
        # certificate under other names must not buy a CA verification each time).
        if not isinstance(public, Ed25519PublicKey) or peer_id_of(raw_public_key(public)) != node:
            raise AdmissionError(f"credential is not a certificate of {node[:40]!r}")
        return self.verify(cert, now)


@dataclass(frozen=True, slots=True)
class _Fields:
    """What admission reads of a certificate, read once."""

    issuer: x509.Name
    issuer_text: str
    signature: bytes
    tbs: bytes
    not_before: dt.datetime
    not_after: dt.datetime
    raw_key: bytes | None
    common_name: object
    cluster: str
    is_ca: bool | None
    """None: no BasicConstraints extension."""
    serial: int


def _read_fields(cert: x509.Certificate) -> _Fields:
    """Parse what :meth:`Trust.verify` checks. The certificate's fields come from a
    stranger's bytes, and the cryptography library parses some of them lazily, raising
    ``ValueError``, ``TypeError``, ``x509.InvalidVersion`` or others on access (a
    fuzzer found each): every failure here is one ``AdmissionError``."""
    try:
        public = cert.public_key()
        raw = raw_public_key(public) if isinstance(public, Ed25519PublicKey) else None
        names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        try:
            constraints: x509.BasicConstraints | None = cert.extensions.get_extension_for_class(
                x509.BasicConstraints
            ).value
        except x509.ExtensionNotFound:
            constraints = None
        return _Fields(
            issuer=cert.issuer,
            issuer_text=cert.issuer.rfc4514_string()[:200],
            signature=cert.signature,
            tbs=cert.tbs_certificate_bytes,
            not_before=cert.not_valid_before_utc,
            not_after=cert.not_valid_after_utc,
            raw_key=raw,
            common_name=names[0].value if names else None,
            cluster=cluster_of(cert),
            is_ca=None if constraints is None else constraints.ca,
            serial=cert.serial_number,
        )
    except AdmissionError:
        raise
    except Exception as exc:  # see the docstring: any failure to parse is a refusal
        raise AdmissionError(f"certificate cannot be parsed ({type(exc).__name__})") from None


def describe_subject(der: bytes) -> str:
    """The subject of a DER certificate for a log line, or "?"; never raises (the bytes
    are a stranger's, see :func:`_read_fields`)."""
    try:
        return x509.load_der_x509_certificate(der).subject.rfc4514_string()[:200]
    except Exception:  # informative only: an unreadable subject is shown as unknown
        return "?"


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
