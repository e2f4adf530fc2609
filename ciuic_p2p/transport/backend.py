"""The QUIC implementation behind transport.quic: aioquic (pure Python) or qh3 1.x (an
aioquic fork whose packet protection and TLS crypto are in Rust), chosen by
``transport.quic_backend``. Both are sans-I/O and speak the same connection API; what
differs is reached only through this module: how a configuration takes our node
certificate, the peer's certificate, the connection ID the server chose (bound into
the client's proof), QUIC's RTT estimate and the bytes sent and not yet acknowledged.
Packet headers and Retry (transport.gate) are parsed with aioquic's helpers whatever
the backend: they are wire formats, not connection state. A node's config may choose
only what :data:`OFFERED` lists.
"""

from __future__ import annotations

import importlib
import ssl
from types import ModuleType
from typing import Any, Literal

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from ciuic_p2p.config import TransportSection
from ciuic_p2p.identity import NodeKey

BackendName = Literal["aioquic", "qh3"]
BACKENDS: tuple[BackendName, ...] = ("aioquic", "qh3")
OFFERED: tuple[BackendName, ...] = ("aioquic", "qh3")
"""What a node's config may choose. Every transport test runs on each. qh3 is taken in
its 1.x line: 2.x (connection core in Rust too) raises "packet builder capacity
exhausted" building its first flight to any aioquic client, so it could not accept an
aioquic node, nor the hostile-peer tests' client; :func:`unsupported_reason` refuses
it."""
QH3_SUPPORTED = (1, 9)
"""The qh3 line this module was written and tested against (1.9 up to 2)."""
CONTROL_STREAM = 0
ED25519_SIGNATURE = 0x0807
"""TLS 1.3's code point for Ed25519 (RFC 8446, 4.2.3)."""


def available(name: str) -> bool:
    """Whether the backend's package is installed."""
    try:
        importlib.import_module(f"{name}.quic.connection")
    except ImportError:
        return False
    return True


def unsupported_reason(name: str) -> str | None:
    """Why the installed package cannot serve as the backend, or None when it can."""
    if not available(name):
        return f"{name} is not installed (pip install {name!r}, a dependency of ciuic-p2p)"
    if name == "qh3":
        import importlib.metadata  # noqa: PLC0415
        import re  # noqa: PLC0415

        try:
            found = importlib.metadata.version("qh3")
        except importlib.metadata.PackageNotFoundError:
            return "qh3 is importable but not installed as a package (no version to check)"
        parts = re.match(r"(\d+)\.(\d+)", found)  # 1.10rc1 is 1.10
        major_minor = (int(parts[1]), int(parts[2])) if parts else (0, 0)
        if not QH3_SUPPORTED <= major_minor < (2, 0):
            return (
                f"qh3 {found} is installed; the qh3 backend needs 1.9 <= qh3 < 2 "
                "(qh3 2.x cannot accept aioquic peers)"
            )
    return None


class QuicBackend:
    """One QUIC library, behind the few calls that differ between them."""

    def __init__(self, name: BackendName) -> None:
        if name not in BACKENDS:
            raise ValueError(f"unknown QUIC backend {name!r} (one of {', '.join(BACKENDS)})")
        self.name = name
        reason = unsupported_reason(name)
        if reason is not None:
            raise ValueError(f"transport.quic_backend = {name!r}, but {reason}")
        try:
            self._configuration = importlib.import_module(f"{name}.quic.configuration")
            self._connection = importlib.import_module(f"{name}.quic.connection")
            self.events: ModuleType = importlib.import_module(f"{name}.quic.events")
        except ImportError as exc:  # unsupported_reason checked it is installed
            raise ValueError(f"transport.quic_backend = {name!r}: {exc}") from exc

    def configuration(
        self,
        settings: TransportSection,
        alpn: str,
        cid_length: int,
        certificate: x509.Certificate | None,
        key: NodeKey | None,
    ) -> Any:
        """The library's configuration for one of our connections; a server passes its
        node certificate and key (the TLS certificate is the node certificate)."""
        kwargs: dict[str, Any] = {
            "is_client": certificate is None,
            "alpn_protocols": [alpn],
            "idle_timeout": settings.idle_timeout_s,
            "max_datagram_size": settings.max_datagram_size,
            "connection_id_length": cid_length,
            # QUIC's own windows stay above our framing's, which bounds what a peer may
            # have queued here (core.link.session sizes it to the path).
            "max_data": 2 * settings.receive_window_max_bytes + 4 * settings.receive_window_bytes,
            "max_stream_data": settings.receive_window_max_bytes
            + 2 * settings.receive_window_bytes,
            "verify_mode": ssl.CERT_NONE,  # we verify the server's certificate ourselves
        }
        if self.name == "aioquic":
            kwargs["congestion_control_algorithm"] = settings.congestion_control
        else:  # node certificates are Ed25519, which qh3 does not offer by default
            kwargs["signature_algorithms"] = [ED25519_SIGNATURE]
            kwargs["probe_datagram_size"] = False
        conf = self._configuration.QuicConfiguration(**kwargs)
        if certificate is not None and key is not None:
            if self.name == "aioquic":
                conf.certificate = certificate
                conf.private_key = key.private_key
            else:  # qh3 parses PEM into its own certificate and key types
                pem = certificate.public_bytes(serialization.Encoding.PEM)
                key_pem = key.private_key.private_bytes(
                    serialization.Encoding.PEM,
                    serialization.PrivateFormat.PKCS8,
                    serialization.NoEncryption(),
                )
                conf.load_cert_chain(pem, key_pem)
        return conf

    def connection(self, configuration: Any, **kwargs: Any) -> Any:
        return self._connection.QuicConnection(configuration=configuration, **kwargs)

    def supported_versions(self, settings: TransportSection) -> list[int]:
        return list(self.configuration(settings, "x", 8, None, None).supported_versions)

    def peer_certificate(self, quic: Any) -> x509.Certificate | None:
        """The certificate the server presented (the client verifies it against the
        cluster CA itself)."""
        if self.name == "aioquic":
            cert: x509.Certificate | None = quic.tls._peer_certificate
            return cert
        theirs = quic.get_peercert()
        return None if theirs is None else x509.load_der_x509_certificate(theirs.public_bytes())

    def server_cid(self, quic: Any) -> bytes:
        """On a client: the connection ID the server chose for itself, as its first
        packet stated it (the peer CID in use may change once the server issues
        others)."""
        chosen = quic._remote_initial_source_connection_id
        return bytes(quic._peer_cid.cid if chosen is None else chosen)

    def rtt(self, quic: Any) -> tuple[float, float, float] | None:
        """QUIC's RTT estimate: min, smoothed, variance (qh3 1.x keeps aioquic's loss
        recovery state)."""
        loss = quic._loss
        if loss._rtt_min == float("inf"):
            return None
        return (loss._rtt_min, loss._rtt_smoothed, loss._rtt_variance)

    def unacked_bytes(self, quic: Any, stream_id: int | None = None) -> int:
        """Stream bytes sent or queued and not acknowledged yet (one stream, or all).
        aioquic keeps them in each stream's sender buffer; qh3's sender (in Rust)
        shows only the ranges still to send, so its bytes in flight (the whole
        connection's) are added when all streams are asked for."""
        streams = quic._streams
        chosen = streams.values() if stream_id is None else [streams.get(stream_id)]
        senders = [s.sender for s in chosen if s is not None]
        if self.name == "aioquic":
            return sum(len(getattr(sender, "_buffer", b"")) for sender in senders)
        queued = sum(int(stop) - int(start) for s in senders for start, stop in s._pending)
        return queued + (int(quic._loss.bytes_in_flight) if stream_id is None else 0)
