"""The transport interface: send a frame to a peer, receive frames, peer events.

Peers are named by their raw 32-byte node public key. Everything above the transport
(membership, routing, dissemination) uses only this interface, so it runs unchanged
on QUIC, on the WAN emulator and in memory.
"""

from __future__ import annotations

import abc
import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ciuic_p2p.core.link.frames import FrameType
from ciuic_p2p.core.link.trust import Trust
from ciuic_p2p.guard import Guard

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
    receive_rate_bps: float | None = None
    """The pace of the peer's bulk frames arriving here, measured passively
    (core.link.throughput); None before a frame large enough to measure."""
    rate_samples: int = 0
    pace_bps: float | None = None
    """The rate this node paces its bulk frames to the peer at (core.link.pacer);
    None: not paced."""


@dataclass(frozen=True, slots=True)
class StrangerStats:
    """What sources that are not members cost a node (transport.gate)."""

    pending_connections: int = 0
    connections_opened: int = 0
    retries_sent: int = 0
    refused: int = 0
    """Connections refused before authentication (bad credential, timeout, framing)."""
    dropped: dict[str, int] = field(default_factory=dict)
    """Datagrams dropped before any state, by reason."""


class Transport(abc.ABC):
    """Frames between authenticated peers. One logical link per peer."""

    local_key: bytes
    certificate_der: bytes
    """This node's certificate (DER): its credential in the mesh."""
    trust: Trust
    """The CA and revocation list in force (``set_trust`` replaces it)."""
    wallclock: Callable[[], dt.datetime]
    """UTC now, for certificate validity."""
    guard: Guard
    """Faults of the transport's callbacks, counted (ciuic_p2p.guard)."""
    udp_bytes_sent: int
    """Every byte this node put on the wire (all links, all frames)."""

    @abc.abstractmethod
    async def start(self) -> Address:
        """Start listening; return the bound address."""

    @abc.abstractmethod
    async def resolve(self, host: str, port: int) -> Address:
        """The address to dial for ``host:port`` (a name looked up, of the family this
        transport listens on); raises TransportError when there is none."""

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
    def set_trust(self, trust: Trust) -> list[bytes]:
        """Use a new CA/revocation list from now on, and close every link whose peer it
        no longer admits; the keys of those peers."""

    @abc.abstractmethod
    def unacked_bytes(self) -> int:
        """Bytes sent on live links that the peers have not acknowledged yet."""

    @abc.abstractmethod
    def strangers(self) -> StrangerStats: ...

    @abc.abstractmethod
    async def disconnect(self, peer: bytes, reason: str) -> None:
        """Close the link to a peer cleanly, telling it why."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Close every link and stop listening."""

    def pace(self, peer: bytes, rate_bps: float | None) -> None:
        """Send bulk bytes to ``peer`` no faster than ``rate_bps`` (None: as fast as
        the link takes them; core.link.pacer). A transport without a bottleneck to
        spare (in memory) ignores it."""
        del peer, rate_bps

    def lanes_status(self) -> dict[str, Any] | None:
        """What the node's lane processes carry (transport.laned); None without lanes."""
        return None
