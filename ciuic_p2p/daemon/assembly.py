"""One node, assembled: the composition root, and the only place where parts are
wired to each other.

    node = NodeAssembly(config, key, certificate, trust, state_dir=d, trainer_socket=p)
    address = await node.start()          # the mesh daemon on its transport
    await node.start_trainers()           # the trainer socket (a path; or serve_socket)
    node.open_audit(); await node.start_control(path); await node.start_web(token_path)
    ...
    await node.close()

``ciuic-node run`` (daemon.run), the embedded daemon (train.embedded), the lab's local
meshes (lab.daemons) and the tests all build nodes here. The parts never set each
other's callbacks: the assembly is the daemon's listener (daemon.node.MeshListener),
the store's (daemon.store.StoreListener), the trainer server's (its checkpoints) and
the transport's admission observer, and passes each call to the part it concerns. A
part that wants to hear something too is added here, in code; ``observer`` (tests,
benchmarks) is told what the daemon tells, after the parts.

One clock (``clock``) reaches the transport, the daemon, the store and the trainer
server: they all read the daemon's.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

from cryptography import x509

from ciuic_p2p.admission import Trust
from ciuic_p2p.config import Config
from ciuic_p2p.core.audit import AuditError
from ciuic_p2p.core.mesh.broadcast import Delivery
from ciuic_p2p.daemon.addressbook import AddressBook
from ciuic_p2p.daemon.auditlog import AuditLog
from ciuic_p2p.daemon.control import ControlServer
from ciuic_p2p.daemon.node import Direction, MeshDaemon, MeshListener
from ciuic_p2p.daemon.store import StoreService
from ciuic_p2p.daemon.trainer import TrainerServer
from ciuic_p2p.daemon.web import WebServer
from ciuic_p2p.errors import CiuicError
from ciuic_p2p.identity import NodeKey, peer_id_of
from ciuic_p2p.transport.base import Address, Transport
from ciuic_p2p.transport.laned import LanedTransport
from ciuic_p2p.transport.quic import AdmissionObserver, QuicTransport

WrapUdp = Callable[[asyncio.DatagramTransport], asyncio.DatagramTransport]


class StatusPart(Protocol):
    def status(self) -> dict[str, Any]: ...


def quic_transport(
    config: Config,
    key: NodeKey,
    certificate: x509.Certificate,
    trust: Trust,
    *,
    addresses: AddressBook,
    clock: Callable[[], float] = time.monotonic,
    wallclock: Callable[[], dt.datetime] | None = None,
    wrap_udp: WrapUdp | None = None,
    on_admission: AdmissionObserver | None = None,
) -> Transport:
    """The production transport of a node, listening where ``config.node`` says: its
    own QUIC link, with ``transport.lanes`` lane processes for its chunks when that is
    2 or more and no ``wrap_udp`` shapes its datagrams (lanes' own sockets would pass
    the WAN emulator by, so an emulated node keeps one)."""
    main = QuicTransport(
        key,
        certificate,
        trust,
        host=config.node.listen_host,
        port=config.node.listen_port,
        settings=config.transport,
        clock=clock,
        wrap_udp=wrap_udp,
        known_source=addresses.known_source,
        on_admission=on_admission,
        wallclock=wallclock or (lambda: dt.datetime.now(dt.UTC)),
    )
    lanes = config.transport.lanes
    if lanes < 2 or wrap_udp is not None:
        return main
    base_port = config.transport.lane_base_port
    return LanedTransport(main, key, certificate, lanes, base_port=base_port, log=config.log)


def bare_daemon(
    config: Config,
    key: NodeKey,
    certificate: x509.Certificate,
    trust: Trust,
    *,
    state_dir: Path | None = None,
    listener: MeshListener | None = None,
    wrap_udp: WrapUdp | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> MeshDaemon:
    """A mesh daemon on QUIC with nothing above it: no store, no trainer socket (what
    the mesh's own tests and benchmarks drive)."""
    addresses = AddressBook()
    transport = quic_transport(
        config, key, certificate, trust, addresses=addresses, clock=clock, wrap_udp=wrap_udp
    )
    return MeshDaemon(
        config,
        key,
        transport,
        addresses=addresses,
        listener=listener,
        state_dir=state_dir,
        clock=clock,
    )


class NodeAssembly:
    """See the module docstring."""

    def __init__(
        self,
        config: Config,
        key: NodeKey,
        certificate: x509.Certificate,
        trust: Trust,
        *,
        state_dir: Path | None = None,
        transport: Transport | None = None,
        wrap_udp: WrapUdp | None = None,
        clock: Callable[[], float] = time.monotonic,
        trainers: bool = True,
        trainer_socket: Path | None = None,
        observer: MeshListener | None = None,
    ) -> None:
        """``transport``: one already built (the in-memory one in tests); by default
        QUIC where ``config.node`` says, shaped by ``wrap_udp`` (the WAN emulator).
        ``trainers``: serve a trainer (on ``trainer_socket``, or a socket pair through
        ``trainers.serve_socket``)."""
        self.config = config
        self.key = key
        self.addresses = AddressBook()
        self.audit: AuditLog | None = None
        self.audit_dir: Path | None = None
        self.observer = observer
        self.transport = transport or quic_transport(
            config,
            key,
            certificate,
            trust,
            addresses=self.addresses,
            clock=clock,
            wrap_udp=wrap_udp,
            on_admission=self.admission,
        )
        self.daemon = MeshDaemon(
            config,
            key,
            self.transport,
            addresses=self.addresses,
            listener=self,
            state_dir=state_dir,
            clock=clock,
        )
        self.store = StoreService(self.daemon, listener=self)
        self.trainers = (
            TrainerServer(self.daemon, self.store, trainer_socket, checkpoints=self)
            if trainers
            else None
        )
        self.control: ControlServer | None = None
        self.web: WebServer | None = None
        self.web_status: dict[str, Any] | None = None
        self.service: StatusPart | None = None
        """The service life cycle (daemon.service), when ``ciuic-node run`` runs one."""
        self.closers: list[Callable[[], Awaitable[None]]] = []
        """Extra parts, closed last-in first-out."""

    @property
    def peer_id(self) -> str:
        return self.daemon.peer_id

    # -- starting the parts ---------------------------------------------------------------

    async def start(self) -> str:
        """The mesh daemon on its transport; the address other members dial."""
        return await self.daemon.start()

    async def start_trainers(self) -> None:
        """Listen on the trainer socket (``trainer_socket``)."""
        if self.trainers is None:
            raise CiuicError("this node serves no trainer")
        await self.trainers.start()

    async def start_control(self, path: Path) -> ControlServer:
        self.control = ControlServer(self.daemon, path, store=self.store)
        await self.control.start()
        return self.control

    def open_audit(self) -> AuditLog:
        """The audit log (``config.audit``), fed by the transport (admissions), the mesh
        (chunk traffic), the store (state served) and the trainer (checkpoints)."""
        config = self.config
        directory = Path(config.audit.dir or Path(config.node.state_dir) / "audit")
        try:
            audit = AuditLog(
                directory,
                self.key,
                peer_id=self.daemon.peer_id,
                interval_s=config.audit.interval_s,
                rotate_bytes=config.audit.rotate_bytes,
                max_dir_bytes=config.audit.max_dir_bytes,
            )
        except AuditError as exc:
            raise CiuicError(f"audit log {directory}: {exc}") from None
        audit.started()
        self.audit, self.audit_dir = audit, directory
        return audit

    async def start_web(self, token_path: Path | None) -> int:
        """The status page and metrics (``config.web``); its port. Raises OSError."""
        web = WebServer(self.daemon, self.config.web, trainer=self.trainers, token_path=token_path)
        port = await web.start()
        self.web = web
        self.closers.append(web.close)
        return port

    async def close(self) -> None:
        """Close every part (no leave: daemon.service leaves first when it stops)."""
        if self.trainers is not None:
            await self.trainers.close()
        await self.store.close()
        await self.daemon.close()
        for close in reversed(self.closers):
            await close()
        if self.control is not None:
            await self.control.close()

    # -- the daemon's listener (daemon.node.MeshListener) ---------------------------------------

    def chunk_delivered(self, delivery: Delivery) -> None:
        if self.trainers is not None:
            self.trainers.deliver(delivery)
        if self.observer is not None:
            self.observer.chunk_delivered(delivery)

    def direct_received(self, peer: str, payload: bytes) -> None:
        if self.trainers is not None:
            self.trainers.direct(peer, payload)
        if self.observer is not None:
            self.observer.direct_received(peer, payload)

    def store_message(self, peer: str, payload: bytes) -> None:
        self.store.on_message(peer, payload)
        if self.observer is not None:
            self.observer.store_message(peer, payload)

    def member_down(self, peer: str) -> None:
        self.store.member_down(peer)
        if self.observer is not None:
            self.observer.member_down(peer)

    def chunk_traffic(self, direction: Direction, origin: str, nbytes: int) -> None:
        if self.audit is not None:
            record = self.audit.received if direction == "received" else self.audit.forwarded
            record(origin, nbytes)
        if self.observer is not None:
            self.observer.chunk_traffic(direction, origin, nbytes)

    def status_sections(self) -> dict[str, Any]:
        sections: dict[str, Any] = {"store": self.store.status()}
        if self.service is not None:
            sections["service"] = self.service.status()
        if self.audit is not None:
            audit = self.audit
            sections["audit"] = {
                "dir": str(self.audit_dir),
                "last_seq": audit.last_seq,
                "head": audit.head,
                "write_errors": audit.write_errors,
                "error": audit.error,
                "pruned_files": audit.pruned_files,
            }
        if self.web_status is not None:
            sections["web"] = self.web_status
        if self.trainers is not None:  # how long rounds took to gather here
            sections["rounds"] = self.trainers.progress.rounds.status()
        if self.observer is not None:
            sections.update(self.observer.status_sections())
        return sections

    # -- the store's listener, the trainer server's, the transport's --------------------------

    async def freshen(self, name: str) -> None:
        if self.trainers is not None:
            await self.trainers.freshen(name)

    def served(self, peer: str, name: str, version: int, nbytes: int) -> None:
        if self.audit is not None:
            self.audit.served_state(name, version, peer, nbytes)

    def checkpoint_written(self, path: str, step: int, digest: str) -> None:
        if self.audit is not None:
            self.audit.checkpoint(path, step, digest)

    def origin_set_aside(self, origin: str, until_step: int, run: str) -> None:
        if self.audit is not None:
            self.audit.origin_set_aside(origin, until_step, run)

    def admission(self, peer: bytes | None, address: Address, reason: str) -> None:
        if self.audit is None:
            return
        if peer is None:
            self.audit.refused(address, reason)
        else:
            self.audit.admitted(peer_id_of(peer), address)
