"""The QUIC implementation behind transport.quic: aioquic (pure Python) or qh3 (an
aioquic fork: in its 1.x line packet protection and TLS crypto are in Rust, in its 2.x
line the whole connection core too), chosen by ``transport.quic_backend``. All are
sans-I/O and speak the same connection API; what differs is reached only through this
module: how a configuration takes our node certificate, the peer's certificate, the
connection ID the server chose (bound into the client's proof), QUIC's RTT estimate,
the bytes sent and not yet acknowledged, and whether a server must answer a padded
first datagram with a Retry (:attr:`QuicBackend.retry_padded_initials`). Packet
headers and Retry (transport.gate) are parsed with aioquic's helpers whatever the
backend: they are wire formats, not connection state. A node's config may choose only
what :data:`OFFERED` lists.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import re
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
"""What a node's config may choose. Every transport test runs on each."""
QH3_LINES = (((1, 9), (2, 0)), ((2, 1), (3, 0)))
"""The qh3 releases this module was written and tested against: 1.9 up to 2 (aioquic's
connection logic) and 2.1 up to 3 (a connection core in Rust: about half the CPU per
MB of 1.x, bench/transport.py). 2.0 is left out: untested."""
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

        try:
            found = importlib.metadata.version("qh3")
        except importlib.metadata.PackageNotFoundError:
            return "qh3 is importable but not installed as a package (no version to check)"
        if qh3_line(found) is None:
            return (
                f"qh3 {found} is installed; the qh3 backend needs 1.9 <= qh3 < 2 or 2.1 <= qh3 < 3"
            )
    return None


def _no_packet_log(event: str, data: bytes) -> None:
    """qh3 2.x's ``QuicConnection._log_packets`` where no qlog is kept."""


def qh3_line(version: str) -> int | None:
    """The major version of a qh3 release this module supports (1 or 2), else None."""
    parts = re.match(r"(\d+)\.(\d+)", version)  # 1.10rc1 is 1.10
    major_minor = (int(parts[1]), int(parts[2])) if parts else (0, 0)
    for low, high in QH3_LINES:
        if low <= major_minor < high:
            return low[0]
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
        self.native_core = name == "qh3" and qh3_line(importlib.metadata.version("qh3")) == 2
        """qh3 2.x: the connection state lives in Rust, reached through its accessors."""
        self.retry_padded_initials = self.native_core
        """A server on qh3 2.x counts only the packets of a client's first datagram
        toward its anti-amplification budget, not the padding after them (aioquic and
        qh3 1.x pad that way), and its first flight then fails ("packet builder
        capacity exhausted"); a Retry validates the client's address, which lifts the
        budget (transport.gate answers such a datagram with one: a round trip more, for
        those peers only)."""
        try:
            self._configuration = importlib.import_module(f"{name}.quic.configuration")
            self._connection = importlib.import_module(f"{name}.quic.connection")
            self.events: ModuleType = importlib.import_module(f"{name}.quic.events")
            self.connection_error: type[Exception] = self._connection.QuicConnectionError
            """What the library raises when asked to drive a connection it closed (qh3
            2.x raises "connection is closed" from a timer that outlived it)."""
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
        quic = self._connection.QuicConnection(configuration=configuration, **kwargs)
        if self.native_core and configuration.quic_logger is None:
            # qh3 2.x parses and copies every packet it sends for its qlog before it
            # looks whether a logger is set: 6-7% of a sender's CPU with none.
            quic._log_packets = _no_packet_log
        return quic

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
        if self.native_core:  # read from the server's first packet by qh3's TLS bridge
            return bytes(quic._tls.remote_initial_source_connection_id)
        chosen = quic._remote_initial_source_connection_id
        return bytes(quic._peer_cid.cid if chosen is None else chosen)

    def rtt(self, quic: Any) -> tuple[float | None, float, float | None] | None:
        """QUIC's RTT estimate: min, smoothed, variance (qh3 1.x keeps aioquic's loss
        recovery state; qh3 2.x shows only the smoothed and latest RTT: no min, no
        variance)."""
        if self.native_core:
            core = quic._core
            smoothed = None if core is None else float(core.smoothed_rtt)
            return None if not smoothed else (None, smoothed, None)
        loss = quic._loss
        if loss._rtt_min == float("inf"):
            return None
        return (loss._rtt_min, loss._rtt_smoothed, loss._rtt_variance)

    def unacked_bytes(self, quic: Any, stream_id: int | None = None) -> int:
        """Stream bytes sent or queued and not acknowledged yet (one stream, or all).
        aioquic keeps them in each stream's sender buffer; qh3's sender (in Rust)
        shows only the bytes still to send, so its bytes in flight (the whole
        connection's) are added when all streams are asked for."""
        if self.native_core:
            core = quic._core
            queued = int(quic.get_send_buffer_size(stream_id))
            in_flight = 0 if core is None or stream_id is not None else int(core.bytes_in_flight)
            return queued + in_flight
        streams = quic._streams
        chosen = streams.values() if stream_id is None else [streams.get(stream_id)]
        senders = [s.sender for s in chosen if s is not None]
        if self.name == "aioquic":
            return sum(len(getattr(sender, "_buffer", b"")) for sender in senders)
        queued = sum(int(stop) - int(start) for s in senders for start, stop in s._pending)
        return queued + (int(quic._loss.bytes_in_flight) if stream_id is None else 0)
