"""The daemon's mesh layer: a MeshNode (pure) driven over a transport (QUIC in
production, the in-memory one in tests: the daemon is given one and never knows which).

The adapter owns the timer and the outboxes; the MeshNode owns every decision, and
tells the adapter what happened through one event stream (core.mesh.node). The parts
above (the trainer socket, the store, the audit log) hear from the daemon through one
:class:`MeshListener` passed at construction, never by setting each other's callbacks.
One clock, given at construction, reaches the transport, the mesh and every part.

Messages leave as GOSSIP frames (control stream) or MESH_CHUNK frames (bulk
stream, credit flow control) to the link whose peer listens at the message's
address, dialling it first when there is none. Each destination has its own outbox
and sender task, so a slow or dead peer never holds up the others; an outbox that
grows past ``outbox.MAX_OUTBOX`` messages drops its oldest (membership repeats what matters,
repair re-fetches chunks) and counts them. DIRECT frames carry bytes from this node's
trainer to one peer's trainer (the dense baseline), outside the mesh.

Every message that arrives is checked: its sender name must be the peer ID of the
authenticated key of the link it came on, or it is dropped and counted, so that no
member can speak for another.

Dialling is where a member could make this node send datagrams anywhere: which
addresses may be dialled, and how often, is daemon.addressbook's; dials run at most
``MAX_DIALS`` at once, and a destination's queue and task go when it is unreachable,
so that a lying address costs a few datagrams an hour, not a flood.

The incarnation survives restarts in ``state_dir/incarnation``: a restarted node
comes back with a higher one, which the mesh takes over its old death notice.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from ciuic_p2p.addresses import format_address, parse_address
from ciuic_p2p.config import Config
from ciuic_p2p.core.link.frames import BULK_TYPES, FrameType
from ciuic_p2p.core.mesh.broadcast import Delivery
from ciuic_p2p.core.mesh.identities import Identities
from ciuic_p2p.core.mesh.members import MemberEvent, State
from ciuic_p2p.core.mesh.messages import (
    CHUNK_KINDS,
    Chunk,
    MeshDecodeError,
    Message,
    decode_message,
    encode_message,
)
from ciuic_p2p.core.mesh.node import (
    Delivered,
    IncarnationRaised,
    Joined,
    LeaveSpread,
    MeshEvent,
    MeshNode,
)
from ciuic_p2p.daemon import nodestatus
from ciuic_p2p.daemon.addressbook import AddressBook
from ciuic_p2p.daemon.delivered import save_delivered, take_delivered
from ciuic_p2p.daemon.incarnation import next_incarnation, save_incarnation
from ciuic_p2p.daemon.linkrates import LinkRates
from ciuic_p2p.daemon.outbox import ChunkKey, Outbox
from ciuic_p2p.guard import Guard
from ciuic_p2p.identity import NodeKey, peer_id_of
from ciuic_p2p.logsetup import get_logger
from ciuic_p2p.transport.base import (
    FrameReceived,
    PeerConnected,
    PeerDisconnected,
    Transport,
    TransportEvent,
)
from ciuic_p2p.transport.errors import TransportError

MAX_STORE_CONTROL_BYTES = 60 * 1024
"""A store offer this small travels on the control stream (a joiner's query is not
answered behind the bulk backlog)."""
MAX_DIALS = 64
"""Outgoing connections being set up at once."""
REPAIR_QUEUE_BYTES = 8 * 1024 * 1024
"""Chunks queued for one destination past which a repair answer (a WANT's) is not
queued: a member that asks for everything and reads nothing gets this much."""
log = get_logger("ciuic.mesh")

Direction = Literal["received", "forwarded"]


class MeshListener(Protocol):
    """What the daemon tells the parts above it (memberlist's delegates), given to it
    at construction. The node's composition root (daemon.assembly) is the one
    listener in production and routes each call to the part it concerns."""

    def chunk_delivered(self, delivery: Delivery) -> None:
        """A chunk the mesh verified, seen here for the first time."""

    def direct_received(self, peer: str, payload: bytes) -> None:
        """A DIRECT frame: a member's trainer to this node's (not forwarded)."""

    def store_message(self, peer: str, payload: bytes) -> None:
        """A STORE_* frame (daemon.store)."""

    def member_down(self, peer: str) -> None:
        """The mesh declared a member dead or left."""

    def chunk_traffic(self, direction: Direction, origin: str, nbytes: int) -> None:
        """A chunk of ``origin`` received or forwarded (the audit log sums these)."""

    def status_sections(self) -> dict[str, Any]:
        """Extra sections of :meth:`MeshDaemon.status` (the store's fetches, ...)."""


class NoListener:
    """The listener of a daemon with nothing above it: what it hears goes nowhere
    (the daemon's counters still count it)."""

    def chunk_delivered(self, delivery: Delivery) -> None:
        return None

    def direct_received(self, peer: str, payload: bytes) -> None:
        return None

    def store_message(self, peer: str, payload: bytes) -> None:
        return None

    def member_down(self, peer: str) -> None:
        return None

    def chunk_traffic(self, direction: Direction, origin: str, nbytes: int) -> None:
        return None

    def status_sections(self) -> dict[str, Any]:
        return {}


class ChunkRecorder(NoListener):
    """Hands each delivered chunk to ``record`` and ignores the rest (benchmarks and
    tests of a daemon with nothing above it)."""

    def __init__(self, record: Callable[[Delivery], None]) -> None:
        self.record = record

    def chunk_delivered(self, delivery: Delivery) -> None:
        self.record(delivery)


@dataclass
class _Destination:
    box: Outbox = field(default_factory=Outbox)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None


@dataclass
class PeerTraffic:
    """Frames exchanged with one destination address (read by daemon.metrics)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    chunks_sent: int = 0
    chunks_received: int = 0
    chunks_relayed: int = 0
    """Chunks of other origins queued for this destination (forwarded or repaired)."""


class MeshDaemon:
    """One node: QUIC transport + mesh state machine + its timer."""

    def __init__(
        self,
        config: Config,
        key: NodeKey,
        transport: Transport,
        *,
        addresses: AddressBook | None = None,
        listener: MeshListener | None = None,
        state_dir: Path | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``transport``: built with the same ``clock`` and, for QUIC, asking
        ``addresses`` which sources it knows (daemon.assembly builds both)."""
        self.config = config
        self.key = key
        self.peer_id = peer_id_of(key.public_key)
        self.state_dir = Path(state_dir or config.node.state_dir)
        self._resume_saved = False
        """Whether this life saved its resume point (:meth:`save_resume_point`)."""
        self.clock = clock
        self.transport = transport
        self.addresses = addresses or AddressBook()
        self.listener: MeshListener = listener or NoListener()
        self.node: MeshNode | None = None
        self.address = ""
        self.started_at = clock()
        self._peer_at: dict[str, bytes] = {}
        self._address_of: dict[bytes, str] = {}
        self._outboxes: dict[tuple[str, int], _Destination] = {}
        self._dialing: dict[str, asyncio.Future[bytes]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.banned: set[str] = set()
        """Peers dropped by a revocation list reloaded while they were linked."""
        self.counters: collections.Counter[str] = collections.Counter()
        # Mesh message bytes (before transport framing) and counts sent, by kind: what
        # the mesh's own upkeep costs beside the chunks it carries.
        self.mesh_bytes_sent: collections.Counter[str] = collections.Counter()
        self.mesh_messages_sent: collections.Counter[str] = collections.Counter()
        self.traffic: collections.defaultdict[str, PeerTraffic] = collections.defaultdict(
            PeerTraffic
        )
        """Per destination address; counted here, named by peer at scrape time."""
        self.member_events: collections.Counter[str] = collections.Counter()
        """Membership changes seen, by the state entered (``alive``, ``dead``...)."""
        self.guard = Guard("daemon")
        """Faults of this daemon's callbacks, counted (ciuic_p2p.guard)."""
        self.closed = asyncio.Event()
        self._joined = asyncio.Event()
        self._left = asyncio.Event()
        self.link_rates = LinkRates(
            config.mesh,
            self.peer_id,
            transport,
            self.guard,
            self.counters,
            peer_at=self._peer_at,
            bulk_queued=self._bulk_queued,
            backlog_bytes=self.backlog_bytes,
            enqueue=self._enqueue,
            receive_rates=lambda: nodestatus.receive_rates(self),
        )
        """Feeds the links' measured rates to the mesh, paces and probes the links."""

    # -- life cycle -------------------------------------------------------------------------

    async def start(self) -> str:
        host, port = await self.transport.start()
        advertised = self.config.node.advertise_host or host
        if advertised in ("0.0.0.0", "::", ""):
            await self.transport.close()
            raise ValueError(
                f"listening on {host} (every interface): say which address the other "
                "members dial with --advertise HOST (node.advertise_host)"
            )
        self.address = format_address(advertised, port)
        incarnation = next_incarnation(self.state_dir)
        t = self.transport
        identities = Identities(
            self.peer_id,
            t.certificate_der,
            self.key.sign,
            # The trust in force when asked: a reloaded revocation list applies.
            lambda node, der: t.trust.check_member(node, der, t.wallclock()),
        )
        resume = take_delivered(self.state_dir, time.time(), self.config.mesh.own_chunk_retain_s)
        self.node = MeshNode(
            self.peer_id,
            self.address,
            self.config.mesh,
            self.clock(),
            identities=identities,
            region=self.config.node.region,
            name=self.config.node.name,
            incarnation=incarnation,
            seed=zlib.crc32(self.key.public_key) ^ incarnation,
            resume=resume,
        )
        self._tasks.append(asyncio.get_running_loop().create_task(self._receive_loop()))
        self._pump()
        log.info(
            "mesh_started",
            peer=self.peer_id,
            name=self.config.node.name,
            address=self.address,
            incarnation=incarnation,
            resumes_origins=len(resume),  # chunks sent while it was down are repaired
        )
        return self.address

    @property
    def mesh(self) -> MeshNode:
        if self.node is None:
            raise RuntimeError("daemon not started")
        return self.node

    async def join(self, address: str, timeout_s: float = 15.0) -> list[str]:
        """Join the mesh through the member at ``address``; the view once joined.
        Raises TransportError when that member refuses us (wrong credential) or cannot
        be reached, TimeoutError when it never answers."""
        ip, port = await self.transport.resolve(*parse_address(address))
        target = format_address(ip, port)
        if target == self.address:
            raise ValueError(f"{address} is this node itself: join through another member")
        key = await self.transport.connect((ip, port))
        self._learn_peer(key, target)
        self._joined.clear()
        self.mesh.join(target, self.clock())
        self._pump()
        try:
            await asyncio.wait_for(self._joined.wait(), timeout_s)
        except TimeoutError:
            raise TimeoutError(f"{address} did not answer the join in {timeout_s:g} s") from None
        return self.mesh.view()

    def ban(self, key: bytes) -> None:
        """A peer our trust no longer admits (revoked): its chunks are dropped even
        when others relay them, until the daemon restarts."""
        peer = peer_id_of(key)
        self.banned.add(peer)
        log.warning("peer_banned", peer=peer)

    def trust_changed(self) -> list[str]:
        """Check every member's credential again under the transport's new trust;
        members now refused can no longer sign anything that counts here (their chunks
        and announcements fail), and are banned."""
        if self.node is None:
            return []
        refused = self.node.recheck_identities()
        for peer in refused:
            self.banned.add(peer)
            log.warning("peer_banned", peer=peer)
        return refused

    def force_leave(self, peer: str) -> str | None:
        """Take a failed member as departed here (``ciuic-node force-leave``:
        core.mesh.membership); why not, None when done."""
        refused = self.mesh.force_leave(peer, self.clock())
        self._pump()
        return refused

    def save_resume_point(self) -> None:
        """Save what this node delivered of each origin, for its next start
        (daemon.delivered): call it when its trainer stops taking deliveries, so that
        what comes after is repaired then. Once; the first call counts."""
        if self._resume_saved or self.node is None:
            return
        self._resume_saved = True
        save_delivered(self.state_dir, self.node.dissemination.delivered(), time.time())

    async def leave(self) -> None:
        """Tell the mesh we are leaving, wait (bounded) for it to spread, then close."""
        node = self.mesh
        alone = len(node.view()) <= 1  # nobody to tell: no reason to wait
        node.leave(self.clock())
        self._pump()
        deadline = self.clock() + (0.0 if alone else self.config.mesh.leave_propagate_s)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._left.wait(), max(0.0, deadline - self.clock()))
        await self._drain(deadline - self.clock())
        # Sent is not received: a lost packet of the announcement is retransmitted only
        # while the connection lives, so close once the peers acknowledged everything.
        while self.transport.unacked_bytes() and self.clock() < deadline:
            await asyncio.sleep(0.01)
        spread = alone or self._left.is_set()  # the departure reached the others in time
        self.save_resume_point()
        await self.close()
        log.info("mesh_left", peer=self.peer_id, announced=spread, alone=alone)

    async def _drain(self, timeout_s: float) -> None:
        end = self.clock() + max(0.0, timeout_s)
        while any(o.box for o in self._outboxes.values()) and self.clock() < end:
            await asyncio.sleep(0.01)

    async def close(self) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        if self._timer is not None:
            self._timer.cancel()
        tasks: list[asyncio.Future[Any]] = [*self._tasks]
        tasks += [o.task for o in self._outboxes.values() if o.task is not None]
        # A dial outlives the sender that awaited it (it is shielded, shared by all of
        # the address's waiters): left pending, the loop's end destroys it mid-flight.
        tasks += self._dialing.values()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self.transport.close()

    def broadcast(
        self, payload: bytes, round_id: object = None, round_bytes: int | None = None
    ) -> int:
        """Send ``payload`` to every live node; a piece of a round (``round_id``,
        ``round_bytes``: core.mesh.node.MeshNode.broadcast) by the round's strategy."""
        seq = self.mesh.broadcast(payload, self.clock(), round_id, round_bytes)
        self._pump()
        return seq

    # -- driving the state machine ---------------------------------------------------------

    def _pump(self) -> None:
        node = self.node
        if node is None or self.closed.is_set():
            return
        self._send_messages(node)
        while (event := node.next_event()) is not None:
            self._on_mesh_event(event)
        self._arm_timer(node.get_timer())

    def _on_mesh_event(self, event: MeshEvent) -> None:
        if isinstance(event, Delivered):
            self._hand_up(event.delivery)
        elif isinstance(event, MemberEvent):
            self._member_changed(event)
        elif isinstance(event, Joined):
            self._joined.set()
        elif isinstance(event, LeaveSpread):
            self._left.set()
        elif isinstance(event, IncarnationRaised):
            save_incarnation(self.state_dir, event.incarnation)

    def _send_messages(self, node: MeshNode) -> None:
        # A chunk forwarded to several children is one body in several messages from
        # this node: encoded once (a 1 MiB join per child was one more pass per copy).
        encoded: dict[int, tuple[Message, bytes]] = {}
        for address, msg in node.messages_to_send():
            same = encoded.get(id(msg.body))
            if same is not None and same[0].body is msg.body and same[0].sender == msg.sender:
                data = same[1]
            else:
                try:
                    data = encode_message(msg)
                except ValueError as exc:  # our own message over a limit: a bug, not fatal
                    log.error("mesh_message_too_large", kind=msg.kind.name, error=str(exc))
                    continue
                if isinstance(msg.body, Chunk):
                    encoded[id(msg.body)] = (msg, data)
            self.mesh_bytes_sent[msg.kind.name] += len(data)
            self.mesh_messages_sent[msg.kind.name] += 1
            body = msg.body
            if isinstance(body, Chunk):
                if body.hops == 255 and self._bulk_queued(address) > REPAIR_QUEUE_BYTES:
                    self.counters["repairs_deferred"] += 1  # asked again when it has read
                    continue
                if body.origin != self.peer_id:
                    self.listener.chunk_traffic("forwarded", body.origin, len(body.payload))
                self._enqueue(address, FrameType.MESH_CHUNK, data, (body.origin, body.seq))
            else:
                self._enqueue(address, FrameType.GOSSIP, data)

    def _hand_up(self, delivery: Delivery) -> None:
        if delivery.origin in self.banned:
            self.counters["chunks_from_banned"] += 1
            return
        self.counters["chunks_delivered"] += 1
        self.listener.chunk_traffic("received", delivery.origin, len(delivery.payload))
        self.listener.chunk_delivered(delivery)

    def _arm_timer(self, when: float | None) -> None:
        if when != self._timer_at:
            if self._timer is not None:
                self._timer.cancel()
            self._timer, self._timer_at = None, when
            if when is not None:
                loop = asyncio.get_running_loop()
                delay = max(0.0, when - self.clock())
                self._timer = loop.call_at(loop.time() + delay, self._on_timer)

    def _on_timer(self) -> None:
        self._timer, self._timer_at = None, None
        if self.node is not None and not self.closed.is_set():
            self.guard.call("timer", self._timer_fired, self.node)

    def _timer_fired(self, node: MeshNode) -> None:
        try:
            now = self.clock()
            self.link_rates.tick(node, now)
            node.handle_timer(now)
        finally:
            self._pump()  # re-arms the timer whatever happened

    def _member_changed(self, event: MemberEvent) -> None:
        self.member_events[event.state.name.lower()] += 1
        if event.state in (State.DEAD, State.LEFT):
            self.listener.member_down(event.node)
        level = log.warning if event.state in (State.SUSPECT, State.DEAD) else log.info
        m = self.mesh.members().get(event.node)
        level(
            "member_" + event.state.name.lower(),
            peer=event.node,
            incarnation=event.incarnation,
            name=m.name if m is not None else "",
            address=m.address if m is not None else "",
        )

    async def _receive_loop(self) -> None:
        while True:
            event = await self.transport.next_event()
            # One member's frame must not end the loop that serves all of them.
            self.guard.call("frame", self._on_event, event)

    def _on_event(self, event: TransportEvent) -> None:
        if isinstance(event, FrameReceived) and event.peer in self._address_of:
            traffic = self.traffic[self._address_of[event.peer]]
            traffic.bytes_received += len(event.payload)
            traffic.chunks_received += event.type is FrameType.MESH_CHUNK
        if isinstance(event, PeerConnected):
            # A new link may replace an older one to the same peer without a
            # PeerDisconnected (a restarted peer re-dialling): what the old one
            # carried may never arrive.
            self._links_lost(event.peer)
            self._learn_peer(event.peer, format_address(*event.address))
            if self.node is not None and event.certificate:
                self.node.learn_identity(peer_id_of(event.peer), event.certificate)
        elif isinstance(event, PeerDisconnected):
            self.counters["links_lost"] += 1
            self._links_lost(event.peer)
        elif isinstance(event, FrameReceived) and event.type in (
            FrameType.GOSSIP,
            FrameType.MESH_CHUNK,
        ):
            self._on_frame(event)
        elif isinstance(event, FrameReceived) and event.type is FrameType.RATE_PROBE:
            self.counters["rate_probes_received"] += 1  # measured on arrival; dropped
        elif isinstance(event, FrameReceived) and event.type is FrameType.DIRECT:
            self.counters["direct_received"] += 1
            self.listener.direct_received(peer_id_of(event.peer), event.payload)
        elif isinstance(event, FrameReceived) and event.type in (
            FrameType.STORE_CONTROL,
            FrameType.STORE_DATA,
        ):
            self.listener.store_message(peer_id_of(event.peer), event.payload)

    def _on_frame(self, event: FrameReceived) -> None:
        try:
            msg = decode_message(event.payload)
        except MeshDecodeError as exc:
            self.counters["decode_errors"] += 1
            log.warning("mesh_message_refused", peer=peer_id_of(event.peer), reason=str(exc))
            return
        if msg.sender != peer_id_of(event.peer) or (
            (msg.kind in CHUNK_KINDS) != (event.type is FrameType.MESH_CHUNK)
        ):
            self.counters["spoofed"] += 1
            log.warning("mesh_message_refused", peer=peer_id_of(event.peer), reason="sender")
            return
        address = self._address_of.get(event.peer)
        if address is None or self.node is None:
            return
        self.node.receive_message(address, msg, self.clock())
        self._pump()

    def _learn_peer(self, key: bytes, address: str) -> None:
        self._peer_at[address] = key
        self._address_of[key] = address
        self.addresses.prove(address)

    # -- sending -----------------------------------------------------------------------------

    def send_direct(self, peer: str, payload: bytes) -> None:
        """Queue bytes for one member's trainer (DIRECT frame, bulk, not forwarded)."""
        address = self.mesh.address_of(peer)
        if address is None:
            raise ValueError(f"{peer} is not a member")
        self._enqueue(address, FrameType.DIRECT, payload)

    def send_store(self, peer: str, payload: bytes, bulk: bool) -> bool:
        """Queue a store message for one member; False if it is not one."""
        address = self.mesh.address_of(peer)
        if address is None:
            return False
        if not bulk or len(payload) <= MAX_STORE_CONTROL_BYTES:
            self._enqueue(address, FrameType.STORE_CONTROL, payload)
        else:  # pieces and large offers: bulk, in their own outbox
            self._enqueue(address, FrameType.STORE_DATA, payload)
        return True

    def outbox_depths(self) -> dict[tuple[str, int], tuple[int, int]]:
        """(address, lane: 1 bulk, 0 control) -> (frames, bytes) waiting there."""
        return {
            dest_key: (len(d.box.queue) + len(d.box.side), d.box.queued_bytes)
            for dest_key, d in self._outboxes.items()
        }

    def peers_by_address(self) -> dict[str, str]:
        """Address -> peer ID: the member table's, then each link's authenticated key."""
        names = {m.address: p for p, m in self.mesh.members().items()}
        names.update({address: peer_id_of(key) for address, key in self._peer_at.items()})
        return names

    def backlog_bytes(self) -> int:
        """Bulk bytes queued here and not yet handed to the transport (store pieces
        included)."""
        return sum(
            d.box.queued_bytes + d.box.side_bytes for (_, bulk), d in self._outboxes.items() if bulk
        )

    def _bulk_queued(self, address: str) -> int:
        dest = self._outboxes.get((address, 1))
        return 0 if dest is None else dest.box.queued_bytes + dest.box.side_bytes

    def queued_for(self, peer: str) -> int:
        """Bulk bytes waiting for one member (what a store GET adds to is bounded)."""
        address = self.mesh.address_of(peer)
        return 0 if address is None else self._bulk_queued(address)

    def _links_lost(self, peer: bytes) -> None:
        """Every outbox that sends to ``peer`` forgets what it handed to the link: the
        outboxes are keyed by address, and a peer may be known at more than one (the
        one it advertises and the one it dialled from)."""
        addresses = {a for a, k in self._peer_at.items() if k == peer}
        if (known := self._address_of.get(peer)) is not None:
            addresses.add(known)
        for address in addresses:
            for lane in (0, 1):
                dest = self._outboxes.get((address, lane))
                if dest is not None:
                    dest.box.link_lost()

    def _enqueue(
        self, address: str, ftype: FrameType, data: bytes, chunk: ChunkKey | None = None
    ) -> None:
        # Control and bulk get separate outboxes: a chunk waiting for credit must
        # never hold up a probe.
        lane = int(ftype in BULK_TYPES)
        dest = self._outboxes.get((address, lane))
        if dest is None:
            t = self.config.transport
            # With lanes a chunk may leave through a lane process, whose losses the
            # daemon never hears of: no copy counts as on its way there.
            box = Outbox(in_flight_s=t.stall_timeout_s if t.lanes <= 1 else 0.0)
            dest = self._outboxes[(address, lane)] = _Destination(box)
        dropped, in_flight = dest.box.dropped, dest.box.in_flight
        accepted = dest.box.push(ftype, data, chunk, self.clock())
        self.counters["outbox_dropped"] += dest.box.dropped - dropped
        if dest.box.in_flight > in_flight:  # a copy is on its way there (daemon.outbox)
            self.counters["chunks_in_flight"] += 1
        elif not accepted:  # that chunk is still queued for this peer (see daemon.outbox)
            self.counters["repairs_already_queued"] += 1
        elif chunk is not None and chunk[0] != self.peer_id:
            self.traffic[address].chunks_relayed += 1
        dest.wake.set()
        if dest.task is None or dest.task.done():
            dest.task = asyncio.get_running_loop().create_task(self._sender(address, dest))

    async def _sender(self, address: str, dest: _Destination) -> None:
        box = dest.box
        while not self.closed.is_set():
            if not box:
                dest.wake.clear()
                await dest.wake.wait()
                continue
            try:
                key = await self._link_to(address)
            except (TransportError, OSError, ValueError) as exc:
                self.counters["unreachable_dropped"] += box.clear()
                log.info("peer_unreachable", address=address, reason=str(exc))
                for dest_key, d in list(self._outboxes.items()):
                    if d is dest and not d.box:  # its queue and task go; sends remake them
                        del self._outboxes[dest_key]
                        return
                continue
            ftype, data, chunk = box.take()
            try:
                await self.transport.send(key, ftype, data)
                if chunk is not None:
                    box.handed_to_link(chunk, self.clock())
                self.counters["messages_sent"] += 1
                traffic = self.traffic[address]
                traffic.bytes_sent += len(data)
                traffic.chunks_sent += ftype is FrameType.MESH_CHUNK
            except TransportError:
                self.counters["send_failed"] += 1
            except Exception as exc:  # this task must outlive any one frame
                # A sender that died here would strand its queue: the outbox refuses
                # second copies of the chunks in it, so re-asks could never revive it.
                self.counters["send_failed"] += 1
                log.warning("send_failed", address=address, error=repr(exc))

    async def _link_to(self, address: str) -> bytes:
        """The peer key of a live link to ``address``, dialling once for all waiters
        (see the module docstring for what holds a dial back)."""
        key = self._peer_at.get(address)
        if key is not None and key in self.transport.peers():
            return key
        pending = self._dialing.get(address)
        if pending is None:
            if not self.addresses.may_dial(address, self.clock()):
                self.counters["dials_held_back"] += 1
                raise TransportError(f"{address} has not answered as its member; backing off")
            if len(self._dialing) >= MAX_DIALS:
                self.counters["dials_over_limit"] += 1
                raise TransportError("too many connections being set up at once")
            expected = self._member_key_at(address)
            pending = asyncio.ensure_future(
                self.transport.connect(parse_address(address), expected_peer=expected)
            )
            self._dialing[address] = pending
            pending.add_done_callback(lambda f: self._dial_done(address, f))
        try:
            key = await asyncio.shield(pending)
        except TransportError:
            self.addresses.dial_failed(address, self.clock())
            raise
        self._learn_peer(key, address)
        return key

    def _member_key_at(self, address: str) -> bytes | None:
        """The key of the member that signed ``address`` as its own (a dial there must
        reach that member and no other), or None when no member did (a join)."""
        node = self.node
        if node is None:
            return None
        for name, m in node.members().items():
            if m.address == address:
                return node.public_key_of(name)
        return None

    def _dial_done(self, address: str, future: asyncio.Future[bytes]) -> None:
        self._dialing.pop(address, None)
        if not future.cancelled():
            future.exception()  # retrieved: the waiters report it, not the loop

    # -- status --------------------------------------------------------------------------------

    def route_table(self) -> list[dict[str, Any]]:
        """Each destination's path, with its RTT beside the direct one (``routes``)."""
        return nodestatus.route_table(self)

    def status(self) -> dict[str, Any]:
        """What ``ciuic-node status``, the status page and the metrics show."""
        return nodestatus.status(self)
