"""The transport interface: send a frame to a peer, receive frames, peer events.

Peers are named by their raw 32-byte node public key. Everything above the transport
(membership, routing, dissemination) uses only this interface, so it runs unchanged
on QUIC, on the WAN emulator and in memory.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

from ciuic_p2p.core.link.frames import FrameType

Address = tuple[str, int]


@dataclass(frozen=True, slots=True)
class PeerConnected:
    """A peer finished the handshake and proved its identity."""

    peer: bytes
    address: Address
    dialed: bool
    """True when we opened the connection."""
    certificate: bytes = b""
    """The peer's node certificate (DER), checked: the mesh takes it as the peer's
    credential (core.mesh.identities)."""


@dataclass(frozen=True, slots=True)
class PeerDisconnected:
    """The link to a peer is gone; ``reason`` says why, for logs."""

    peer: bytes
    reason: str


@dataclass(frozen=True, slots=True)
class FrameReceived:
    """A frame from an authenticated peer."""

    peer: bytes
    type: FrameType
    payload: bytes


TransportEvent = PeerConnected | PeerDisconnected | FrameReceived


@dataclass(frozen=True, slots=True)
class RttStats:
    """Round-trip time to a peer, in seconds. ``quic_*`` come from the QUIC stack's
    loss recovery; ``ping_*`` from application-level pings (what routing uses)."""

    ping_min_s: float | None
    ping_smoothed_s: float | None
    ping_var_s: float | None
    quic_min_s: float | None
    quic_smoothed_s: float | None
    quic_var_s: float | None
    samples: int


@dataclass(frozen=True, slots=True)
class LinkStats:
    """Counters for one link."""

    bytes_sent: int
    bytes_received: int
    bulk_buffered_bytes: int
    """Bulk bytes handed to the stack for this peer and not yet credited back by it:
    what this node holds in memory for the peer (bounded by the peer's window)."""
    credit_available: int


class Transport(abc.ABC):
    """Frames between authenticated peers. One logical link per peer."""

    local_key: bytes

    @abc.abstractmethod
    async def start(self) -> Address:
        """Start listening; return the bound address."""

    @abc.abstractmethod
    async def connect(self, address: Address, expected_peer: bytes | None = None) -> bytes:
        """Dial, authenticate both ways, and return the peer's key."""

    @abc.abstractmethod
    async def send(self, peer: bytes, frame_type: FrameType, payload: bytes) -> None:
        """Send one frame. Bulk frames wait for the peer's credit; a peer that grants
        none within the stall timeout is dropped and the send raises."""

    @abc.abstractmethod
    async def next_event(self) -> TransportEvent:
        """The next event; consuming a bulk frame returns credit to its sender."""

    @abc.abstractmethod
    def peers(self) -> list[bytes]:
        """Peers with an authenticated link now."""

    @abc.abstractmethod
    def rtt(self, peer: bytes) -> RttStats | None: ...

    @abc.abstractmethod
    def link_stats(self, peer: bytes) -> LinkStats | None: ...

    @abc.abstractmethod
    async def disconnect(self, peer: bytes, reason: str) -> None:
        """Close the link to a peer cleanly, telling it why."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Close every link and stop listening."""
