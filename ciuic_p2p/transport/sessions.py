"""What both transports do with the link sessions (core.link.session) they drive: one
authenticated link per peer, the events handed up, bulk sends that wait for credit,
and credit returned as the application reads. A transport supplies how a link's
bytes leave (``flush``) and how a link ends (``drop``); the rest is here, once."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Generic, TypeVar

from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from ciuic_p2p.config import TransportSection
from ciuic_p2p.core.link.frames import FrameType
from ciuic_p2p.core.link.keys import peer_id_of
from ciuic_p2p.core.link.session import LinkClaim, LinkSession, keep_new_link
from ciuic_p2p.transport.base import (
    Address,
    FrameReceived,
    LinkStats,
    PeerConnected,
    PeerDisconnected,
    RttStats,
    TransportEvent,
)
from ciuic_p2p.transport.errors import DuplicateLinkError, RefusedError, TransportError


class SessionLink:
    """One link as a transport holds it: its session and what asyncio needs."""

    def __init__(self, session: LinkSession, address: Address, dialed: bool) -> None:
        self.session = session
        self.address = address
        self.dialed = dialed
        self.admitted = False
        """The peer was authenticated (it stays True once the link is closed)."""
        self.closed = False
        self.established_at = 0.0
        self.bytes_sent = 0
        self.bytes_received = 0
        self.paced_bytes = 0
        """Bulk bytes this node's pacer still holds back (transport.quic): the peer
        cannot credit bytes it has not been sent."""
        self.credit_changed = asyncio.Event()
        self.gone = asyncio.Event()
        self.ready: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        # Nobody awaits an accepted link's future: mark its failure as seen.
        self.ready.add_done_callback(lambda f: f.cancelled() or f.exception())

    @property
    def peer(self) -> bytes | None:
        return self.session.peer

    @property
    def claimed(self) -> str:
        return self.session.claimed

    @property
    def certificate(self) -> x509.Certificate | None:
        return self.session.certificate

    def claim(self) -> LinkClaim:
        return LinkClaim(self.dialed, self.established_at)


L = TypeVar("L", bound=SessionLink)


class LinkBook(Generic[L]):
    """The authenticated links of one transport, by peer key, and its event queue."""

    def __init__(
        self,
        local_key: bytes,
        settings: TransportSection,
        *,
        flush: Callable[[L], None],
        drop: Callable[[L, str, bool], None],
    ) -> None:
        """``flush(link)``: send what the link's session queued. ``drop(link, reason,
        quiet)``: close the link (quietly: no CLOSE frame, no event)."""
        self.local_key = local_key
        self.settings = settings
        self.links: dict[bytes, L] = {}
        self.events: asyncio.Queue[TransportEvent] = asyncio.Queue()
        self._flush = flush
        self._drop = drop

    def admit(self, link: L, now: float) -> bool:
        """The link's peer was authenticated: keep this link or the one it already
        has (core.link.session.keep_new_link); whether this one is kept."""
        peer = link.peer
        assert peer is not None
        link.admitted = True
        link.established_at = now
        existing = self.links.get(peer)
        if existing is not None and not existing.closed:
            keep_new = keep_new_link(
                self.local_key, peer, link.claim(), existing.claim(), self.settings.auth_timeout_s
            )
            loser, winner = (existing, link) if keep_new else (link, existing)
            if not loser.ready.done():
                loser.ready.set_result(peer)
            self.links[peer] = winner
            self._drop(loser, "duplicate link", True)
            if not keep_new:
                return False
        self.links[peer] = link
        if not link.ready.done():
            link.ready.set_result(peer)
        if existing is None or existing.closed:
            cert = link.certificate
            der = b"" if cert is None else cert.public_bytes(Encoding.DER)
            self.events.put_nowait(PeerConnected(peer, link.address, link.dialed, der))
        return True

    def gone(self, link: L, reason: str, quiet: bool) -> None:
        """The link is over (its session closed first): forget it, fail a dial that
        waited on it, and say so unless ``quiet``."""
        if link.closed:
            return
        link.closed = True
        link.gone.set()
        link.credit_changed.set()
        if not link.ready.done():
            error = DuplicateLinkError if reason == "duplicate link" else RefusedError
            link.ready.set_exception(error(f"refused: {reason}"))
        peer = link.peer
        if peer is not None and self.links.get(peer) is link:
            del self.links[peer]
            if not quiet:
                self.events.put_nowait(PeerDisconnected(peer, reason))

    def frame_arrived(self, link: L, frame_type: FrameType, payload: bytes) -> None:
        assert link.peer is not None
        self.events.put_nowait(FrameReceived(link.peer, frame_type, payload))

    def live(self, peer: bytes) -> L:
        link = self.links.get(peer)
        if link is None or link.closed:
            raise TransportError(f"no link to {peer_id_of(peer)}")
        return link

    async def send(self, peer: bytes, frame_type: FrameType, payload: bytes) -> None:
        """One frame; a bulk frame waits for the peer's credit, and a peer that grants
        none within ``stall_timeout_s`` is dropped (the send raises)."""
        link = self.live(peer)
        # The size limit is checked before any wait (FramingError).
        while not link.session.send(frame_type, payload):
            link.credit_changed.clear()
            try:
                await asyncio.wait_for(link.credit_changed.wait(), self.settings.stall_timeout_s)
            except TimeoutError:
                if link.paced_bytes and not link.closed:  # held back here, not there
                    continue
                self._drop(link, "peer stalled: no credit", False)
                raise TransportError(f"{peer_id_of(peer)} stopped reading; dropped") from None
            if link.closed:
                raise TransportError(f"link to {peer_id_of(peer)} closed")
        self._flush(link)
        if link.closed:
            raise TransportError(f"link to {peer_id_of(peer)} dropped")

    async def next_event(self) -> TransportEvent:
        event = await self.events.get()
        if isinstance(event, FrameReceived):
            link = self.links.get(event.peer)
            if link is not None and not link.closed:
                link.session.consumed(event.type, len(event.payload))
                self._flush(link)
        return event

    def peers(self) -> list[bytes]:
        return [p for p, link in self.links.items() if not link.closed]

    def link_stats(self, peer: bytes) -> LinkStats | None:
        link = self.links.get(peer)
        if link is None:
            return None
        s = link.session
        return LinkStats(
            bytes_sent=link.bytes_sent,
            bytes_received=link.bytes_received,
            bulk_buffered_bytes=s.bulk_buffered_bytes,
            credit_available=s.credit_out.available,
            receive_rate_bps=s.receive_rate.rate_bps,
            rate_samples=s.receive_rate.samples_taken,
        )

    def ping_rtt(
        self, peer: bytes, quic: tuple[float | None, float, float | None] | None = None
    ) -> RttStats | None:
        """The session's ping RTT, with the QUIC stack's estimate when there is one."""
        link = self.links.get(peer)
        if link is None:
            return None
        rtt = link.session.rtt
        return RttStats(
            ping_min_s=rtt.min_s,
            ping_smoothed_s=rtt.smoothed_s,
            ping_var_s=rtt.var_s,
            quic_min_s=None if quic is None else quic[0],
            quic_smoothed_s=None if quic is None else quic[1],
            quic_var_s=None if quic is None else quic[2],
            samples=rtt.samples,
        )
