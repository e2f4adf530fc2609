"""The QUIC implementation behind transport.quic: aioquic (pure Python) or qh3 (an
aioquic fork whose packet protection, TLS and connection core are in Rust), chosen by
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
OFFERED: tuple[BackendName, ...] = ("aioquic",)
"""What a node's config may choose. qh3 2.1.0 is not offered yet: with it, 14 of the
30 transport tests fail (its ``datagrams_to_send`` raises "packet builder capacity
exhausted" on accepted connections after a peer misbehaves, so the hostile-peer
tests time out); bench/transport.py measures it, ``CIUIC_TEST_QH3=1`` runs the
transport tests on it."""
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


class QuicBackend:
    """One QUIC library, behind the few calls that differ between them."""

    def __init__(self, name: BackendName) -> None:
        if name not in BACKENDS:
            raise ValueError(f"unknown QUIC backend {name!r} (one of {', '.join(BACKENDS)})")
        self.name = name
        try:
            self._configuration = importlib.import_module(f"{name}.quic.configuration")
            self._connection = importlib.import_module(f"{name}.quic.connection")
            self.events: ModuleType = importlib.import_module(f"{name}.quic.events")
        except ImportError as exc:
            raise ValueError(
                f"transport.quic_backend = {name!r}, but {name} is not installed "
                f"(pip install {name})"
            ) from exc

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
        """On a client: the connection ID the server chose for itself."""
        if self.name == "aioquic":
            return bytes(quic._peer_cid.cid)
        return bytes(quic._tls.remote_initial_source_connection_id)

    def rtt(self, quic: Any) -> tuple[float, float, float] | None:
        """QUIC's RTT estimate: min, smoothed, variance (qh3 gives the smoothed and the
        latest sample; the variance is then the spread between them)."""
        if self.name == "aioquic":
            loss = quic._loss
            if loss._rtt_min == float("inf"):
                return None
            return (loss._rtt_min, loss._rtt_smoothed, loss._rtt_variance)
        core = quic._core
        if core is None or core.smoothed_rtt is None:
            return None
        smoothed = float(core.smoothed_rtt)
        latest = float(core.latest_rtt or smoothed)
        return (min(smoothed, latest), smoothed, abs(latest - smoothed))

    def unacked_bytes(self, quic: Any, stream_id: int | None = None) -> int:
        """Stream bytes sent or queued and not acknowledged yet (one stream, or all).
        aioquic keeps them in each stream's sender buffer; qh3 reports the queued
        bytes and the bytes in flight of the whole connection."""
        if self.name == "aioquic":
            streams = quic._streams
            chosen = streams.values() if stream_id is None else [streams.get(stream_id)]
            return sum(len(getattr(s.sender, "_buffer", b"")) for s in chosen if s is not None)
        core = quic._core
        if core is None:
            return 0
        queued = int(core.get_send_buffer_size(stream_id))
        return queued + (int(core.bytes_in_flight) if stream_id is None else 0)
