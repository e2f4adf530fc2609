"""What a datagram from an unknown source may cost: the gate in front of the QUIC
endpoint. Synchronous and without I/O (``now`` comes in, a decision comes out); the
transport carries it out.

A datagram whose destination connection ID names no connection of ours would make a
new one. Anyone on the internet can send such datagrams, by the thousand and from
forged addresses, so before any state exists:

- only a QUIC Initial of a version this node speaks, at least 1200 bytes (RFC 9000
  section 14.1), may open a connection; anything else is dropped and counted (a
  Version Negotiation answer would help nobody: a cluster speaks one version);
- a node holds at most ``max_pending_connections`` connections that have not proven
  a member's identity yet, and at most ``max_pending_per_prefix`` from one /24 (IPv4)
  or /56 (IPv6); past either, new ones are dropped until one settles (authenticates,
  is refused or times out after ``auth_timeout_s``), so a stranger's memory cost is
  bounded, whatever it sends;
- once ``retry_above_pending`` connections are pending, an Initial without a valid
  token is answered with a QUIC Retry (RFC 9000 section 8.1.2: a token that only a
  client that receives at its claimed address can return, AES-GCM sealed with a key
  of this process, aioquic's ``QuicRetryTokenHandler``) and costs no state; honest
  peers, whose QUIC stack follows the Retry, pay one round trip while under attack;
  on a QUIC library that cannot take a first datagram padded after its Initial packet
  (qh3 2.x; aioquic and qh3 1.x pad that way), such an Initial always gets a Retry
  (``retry_padded``: transport.backend says why);
- new connections are admitted at most ``handshakes_per_s`` per second (a token
  bucket of one second's burst): each costs a TLS handshake, about a millisecond and
  a half of CPU here, and a loop busy with strangers' handshakes answers its members'
  probes late, which they read as suspicion.

A source the transport knows (an address where a member was authenticated before:
the daemon's proven addresses) is exempt from the caps and the rate, not from the
Retry: strangers holding every pending slot must not keep members out, and a forged
member address cannot return a Retry token.
"""

from __future__ import annotations

import collections
import os
from dataclasses import dataclass

from aioquic.quic.packet import QuicHeader, QuicPacketType, encode_quic_retry
from aioquic.quic.retry import QuicRetryTokenHandler

from ciuic_p2p.addresses import network_of
from ciuic_p2p.config import TransportSection

MIN_INITIAL_DATAGRAM = 1200
Address = tuple[str, int]


@dataclass(frozen=True, slots=True)
class Open:
    """Create a connection for this Initial."""

    original_dcid: bytes
    retry_scid: bytes | None = None
    """Set when the client came back with our Retry token."""


@dataclass(frozen=True, slots=True)
class Reply:
    """Send ``data`` (a Retry) to the source and keep no state."""

    data: bytes


@dataclass(frozen=True, slots=True)
class Drop:
    reason: str


Decision = Open | Reply | Drop


class InitialGate:
    """Decides about datagrams for unknown connection IDs (see the module docstring).

    The transport calls :meth:`decide` for each such datagram, :meth:`opened` when it
    created the connection and :meth:`settled` once that connection authenticated or
    went away."""

    def __init__(
        self,
        settings: TransportSection,
        supported_versions: list[int],
        retry_padded: bool = False,
    ) -> None:
        self.settings = settings
        self.supported_versions = frozenset(supported_versions)
        self.retry_padded = retry_padded
        """Answer an Initial followed by padding in its datagram with a Retry, always
        (the QUIC library cannot take it otherwise: transport.backend)."""
        self._retry = QuicRetryTokenHandler()
        self.pending = 0
        self.pending_by_prefix: collections.Counter[str] = collections.Counter()
        self.dropped: collections.Counter[str] = collections.Counter()
        """Datagrams dropped before any state, by reason."""
        self.retries_sent = 0
        self.opened_total = 0
        self._tokens = float(settings.handshakes_per_s)
        self._tokens_at: float | None = None

    def decide(
        self, header: QuicHeader, size: int, addr: Address, now: float, known: bool = False
    ) -> Decision:
        if header.packet_type != QuicPacketType.INITIAL:
            return self._drop("not an Initial")
        if header.version is None or header.version not in self.supported_versions:
            return self._drop("unsupported QUIC version")
        if size < MIN_INITIAL_DATAGRAM:
            return self._drop("Initial shorter than 1200 bytes")
        s = self.settings
        prefix = network_of(addr[0])
        if not known and self.pending >= s.max_pending_connections:
            return self._drop("too many connections pending")
        if not known and self.pending_by_prefix[prefix] >= s.max_pending_per_prefix:
            return self._drop("too many connections pending from one network")
        retry_scid: bytes | None = None
        original = header.destination_cid
        if header.token:
            try:
                original = self._retry.validate_token(
                    address=addr,
                    destination_cid=header.destination_cid,
                    token=header.token,
                    now=now,
                )
            except ValueError:
                return self._drop("invalid Retry token")
            retry_scid = header.destination_cid
        elif self.pending >= s.retry_above_pending or (
            self.retry_padded and header.packet_length < size
        ):
            return self._retry_packet(header, addr, now)
        if not known and not self._take_token(now):
            return self._drop("handshake rate limit")
        return Open(original, retry_scid)

    def opened(self, addr: Address) -> None:
        self.pending += 1
        self.opened_total += 1
        self.pending_by_prefix[network_of(addr[0])] += 1

    def settled(self, addr: Address) -> None:
        self.pending = max(0, self.pending - 1)
        prefix = network_of(addr[0])
        self.pending_by_prefix[prefix] -= 1
        if self.pending_by_prefix[prefix] <= 0:
            del self.pending_by_prefix[prefix]

    def _retry_packet(self, header: QuicHeader, addr: Address, now: float) -> Reply:
        assert header.version is not None  # decide() dropped Initials without one
        scid = os.urandom(8)  # the connection ID the client sends its next Initial to
        token = self._retry.create_token(
            address=addr,
            original_destination_connection_id=header.destination_cid,
            retry_source_connection_id=scid,
            now=now,
        )
        self.retries_sent += 1
        return Reply(
            encode_quic_retry(
                version=header.version,
                source_cid=scid,
                destination_cid=header.source_cid,
                original_destination_cid=header.destination_cid,
                retry_token=token,
            )
        )

    def _take_token(self, now: float) -> bool:
        rate = self.settings.handshakes_per_s
        if self._tokens_at is not None:
            self._tokens = min(rate, self._tokens + (now - self._tokens_at) * rate)
        self._tokens_at = now
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True

    def _drop(self, reason: str) -> Drop:
        self.dropped[reason] += 1
        return Drop(reason)
