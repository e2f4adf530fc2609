"""What a node trusts: its cluster's CA certificate and revocation list, and the
checks of a node certificate against them. Pure (``now`` comes in; no file): the CA
itself and the PEM files are ciuic_p2p.admission's.

Verification is our own (aioquic neither requires nor checks client certificates):
the issuer signature is checked with the CA's public key, validity against the
caller's ``now``, the subject against the key, and the serial against the CRL. Every
field is read from a stranger's bytes first, and every way those fail to parse is an
``AdmissionError``, never anything else (:func:`_read_fields`).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.x509.oid import NameOID

from ciuic_p2p.core.link.keys import peer_id_of, raw_public_key
from ciuic_p2p.errors import AdmissionError


def cluster_of(cert: x509.Certificate) -> str:
    attrs = cert.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)
    return str(attrs[0].value) if attrs else ""


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
        ours = self.ca.subject.rfc4514_string()[:200]
        if fields.issuer != self.ca.subject:
            raise AdmissionError(
                f"certificate issued by {fields.issuer_text}, not by this cluster's CA ({ours})"
            )
        try:
            ca_key.verify(fields.signature, fields.tbs)
        except InvalidSignature as exc:
            raise AdmissionError(
                f"certificate not signed by this cluster's CA ({ours}), though it names "
                f"{fields.issuer_text} as its issuer"
            ) from exc
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
        """A member's credential as gossip carries it (core.mesh.identities): the DER node
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
