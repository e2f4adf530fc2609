"""Proof of possession: how a connecting node proves who it is.

aioquic's server neither requests a client certificate through a public switch nor
checks one against a CA, and accepts an empty one, so a server that trusted its
handshake alone would admit anyone. We authenticate the client ourselves, at the
application level, with a proof of possession bound to this connection:

1. The TLS handshake authenticates the server: its TLS certificate is its node
   certificate, which the client checks against the cluster CA (admission.Trust).
2. The client's first stream frame is ``AUTH``: its node certificate and an Ed25519
   signature, by its node key, over the transcript

       "ciuic-auth-v1\\0" | cluster | server node key | server CID | original DCID
       | client node key

   The server CID is the connection ID the *server* chose for this connection and the
   server key is the identity the client verified in step 1, so a proof cannot be
   replayed on another connection or to another server.
3. The server checks the certificate (CA, validity, cluster, revocation) and the
   signature, and only then sends the client anything beyond the handshake.

Payload layout of ``AUTH``: version (u8 = 1) | cert length (u16) | DER | signature (64).

:class:`ServerAdmission` is the accepting side of one link until then: it takes the
control stream's bytes and answers with the admitted peer, or a typed error
(``AdmissionError``, ``FramingError``), never anything else: the fuzz target
(tests/transport/fuzz_preauth.py) drives this very function, and the datagram path
in front of it, with no handler of its own.
"""

from __future__ import annotations

import datetime as dt
import struct
from dataclasses import dataclass

from cryptography import x509

from ciuic_p2p.core.link.frames import Frame, FrameReader, FrameType
from ciuic_p2p.core.link.keys import SIGNATURE_LEN, Signer, verify_signature
from ciuic_p2p.core.link.trust import Trust, describe_subject
from ciuic_p2p.errors import AdmissionError

AUTH_VERSION = 1
_DOMAIN = b"ciuic-auth-v1\0"
MAX_CERT_DER = 2048


def transcript(
    cluster: str, server_key: bytes, server_cid: bytes, original_dcid: bytes, client_key: bytes
) -> bytes:
    parts = [cluster.encode(), server_key, server_cid, original_dcid, client_key]
    return _DOMAIN + b"".join(struct.pack("<H", len(p)) + p for p in parts)


def build_auth(
    key: Signer,
    certificate_der: bytes,
    cluster: str,
    server_key: bytes,
    server_cid: bytes,
    original_dcid: bytes,
) -> bytes:
    proof = key.sign(transcript(cluster, server_key, server_cid, original_dcid, key.public_key))
    return struct.pack("<BH", AUTH_VERSION, len(certificate_der)) + certificate_der + proof


def check_auth(
    payload: bytes,
    trust: Trust,
    now: dt.datetime,
    server_key: bytes,
    server_cid: bytes,
    original_dcid: bytes,
) -> tuple[bytes, x509.Certificate]:
    """Verify an ``AUTH`` payload; return the client's node key and certificate, or
    raise :class:`AdmissionError` with the reason."""
    if len(payload) < 3:
        raise AdmissionError("truncated proof")
    version, cert_len = struct.unpack_from("<BH", payload, 0)
    if version != AUTH_VERSION:
        raise AdmissionError(f"proof version {version}")
    if cert_len > MAX_CERT_DER or len(payload) != 3 + cert_len + SIGNATURE_LEN:
        raise AdmissionError("proof has the wrong length")
    try:
        cert = x509.load_der_x509_certificate(payload[3 : 3 + cert_len])
    except Exception as exc:  # ValueError, and x509.InvalidVersion, which is not one
        raise AdmissionError(f"proof holds no valid certificate ({type(exc).__name__})") from None
    client_key = trust.verify(cert, now)  # every parsing failure is an AdmissionError
    signature = payload[3 + cert_len :]
    message = transcript(trust.cluster, server_key, server_cid, original_dcid, client_key)
    if not verify_signature(client_key, signature, message):
        raise AdmissionError("proof of possession does not verify for this connection")
    return client_key, cert


def claimed_subject(payload: bytes) -> str:
    """The subject an ``AUTH`` payload's certificate claims, for the refusal's log line
    ("?" when there is none to read); never raises."""
    if len(payload) < 3 + SIGNATURE_LEN:
        return "?"
    return describe_subject(payload[3:-SIGNATURE_LEN])


@dataclass(frozen=True, slots=True)
class Admitted:
    """The client proved who it is."""

    key: bytes
    certificate: x509.Certificate
    rest: list[Frame]
    """Frames that followed ``AUTH`` in the same bytes (handled as the member's)."""


class ServerAdmission:
    """The accepting side of one link before authentication (see the module
    docstring): ``receive`` the control stream's bytes as they come."""

    def __init__(
        self, trust: Trust, server_key: bytes, server_cid: bytes, original_dcid: bytes
    ) -> None:
        self.trust = trust
        self.server_key = server_key
        self.server_cid = server_cid
        self.original_dcid = original_dcid
        self.reader = FrameReader(first=frozenset({FrameType.AUTH}))
        """The control stream's reader; it carries on after admission (a frame that
        began in the same bytes as ``AUTH`` is in it)."""
        self.claimed = "?"

    def receive(self, data: bytes, now: dt.datetime) -> Admitted | None:
        """None until the whole ``AUTH`` frame is in; then the admitted peer. Raises
        ``FramingError`` for any other first frame and ``AdmissionError`` for a
        refused proof."""
        frames = self.reader.feed(data)
        if not frames:
            return None
        auth = frames[0]  # the reader let only AUTH be first
        self.claimed = claimed_subject(auth.payload)
        key, cert = check_auth(
            auth.payload, self.trust, now, self.server_key, self.server_cid, self.original_dcid
        )
        return Admitted(key, cert, frames[1:])
