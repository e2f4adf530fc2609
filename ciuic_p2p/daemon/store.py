"""The daemon's side of the shared store: core.store's Holder and Fetch driven over
the mesh links (STORE_CONTROL and STORE_DATA frames).

    manifest = await store.put("model_state", data)   # held here and by
                                                      # ``store.replicas`` nearest members
    data, fetch = await store.get("model_state")      # this node's, else the newest,
                                                      # from the nearest holders
    data, fetch = await store.get("model_state", writer=peer_id)  # that writer's

Objects live in the daemon's memory: a trainer's state for joiners (``state/<run>``,
daemon.trainer), and what users ``put``. Every version is signed by its writer (this
node's key) and a name's versions are kept per writer (core.store.holder), so a
member can replace only its own objects. A ``put`` asks the nearest other members to
fetch and hold a copy (HOLD/HELD), so the object outlives its writer; a member holds
exactly the object a HOLD names (its root), written by the member that asks, and not
one whose version jumps more than ``store.max_version_jump`` above what it holds of
that name.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import time
from collections.abc import Awaitable
from typing import Any, Protocol

from ciuic_p2p.core.link.keys import PEER_ID_PREFIX
from ciuic_p2p.core.store.fetch import Fetch, FetchState
from ciuic_p2p.core.store.holder import Held, Holder
from ciuic_p2p.core.store.messages import (
    ANY_ROOT,
    ANY_VERSION,
    Get,
    Manifest,
    Message,
    NoneHeld,
    Offer,
    Piece,
    Query,
    Ref,
    StoreKind,
    StoreWireError,
    decode,
    encode,
    is_data,
)
from ciuic_p2p.daemon.node import MeshDaemon
from ciuic_p2p.errors import CiuicError
from ciuic_p2p.logsetup import get_logger

log = get_logger("ciuic.store")
FRESHEN_TIMEOUT_S = 5.0


class StoreError(CiuicError):
    """A put or get that could not be completed; the message says why."""


class _Running:
    def __init__(self, fetch: Fetch) -> None:
        self.fetch = fetch
        self.wake = asyncio.Event()


class StoreListener(Protocol):
    """What the store tells the parts beside it, given at construction."""

    async def freshen(self, name: str) -> None:
        """Called before a query for ``name`` is answered (the trainer server has its
        trainer refresh the state snapshot, so that joiners get current parameters)."""

    def served(self, peer: str, name: str, version: int, nbytes: int) -> None:
        """A peer finished fetching from us, or left mid-fetch (the audit log records
        what state went where)."""


class StoreService:
    def __init__(self, daemon: MeshDaemon, listener: StoreListener | None = None) -> None:
        self.daemon = daemon
        self.settings = daemon.config.store
        self.holder = Holder(self.settings, daemon.key.public_key, daemon.key.sign)
        self.writer = self.holder.writer
        """This node's peer ID, as the writer of what it puts."""
        self.counters = daemon.counters
        self._fetches: dict[int, _Running] = {}
        self._tokens = itertools.count(int(time.monotonic_ns()) & 0xFFFF_0000)
        self._held_waiters: dict[tuple[str, int, bytes], asyncio.Queue[str]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._holding: set[str] = set()
        """Members whose HOLD this node is fetching now."""
        self._held_for: collections.Counter[str] = collections.Counter()
        """Bytes held on each member's HOLDs (never decreases: a conservative share)."""
        self.listener = listener
        self.served: collections.Counter[tuple[str, str, int]] = collections.Counter()
        """Bytes of pieces sent per (peer, name, version), until that peer finishes."""

    # -- API -------------------------------------------------------------------------------

    def put_local(
        self, name: str, version: int, data: bytes, compat: bytes | None = None
    ) -> Manifest:
        now = self.daemon.clock()
        return self.holder.put(name, version, data, compat, now)

    async def put(
        self, name: str, data: bytes, version: int | None = None, timeout_s: float = 60.0
    ) -> tuple[Manifest, list[str]]:
        """Hold ``data`` as ``name`` here and have the ``store.replicas`` nearest members
        hold it too; the manifest and who confirmed. ``version`` defaults to one above
        the newest of this node's own versions it knows of (here or on the mesh)."""
        if version is None:
            newest = self.holder.newest(name, self.writer)
            version = 1 + (newest.manifest.version if newest else 0)
            with contextlib.suppress(StoreError):
                _, fetch = await self.get(
                    name, min_version=version, patient=False, writer=self.writer
                )
                version = fetch.version + 1
        manifest = self.put_local(name, version, data)
        wanted = self.settings.replicas
        members = self._by_rtt()[:wanted]
        key = (name, version, manifest.root)
        queue: asyncio.Queue[str] = asyncio.Queue()
        self._held_waiters[key] = queue
        held: list[str] = []
        try:
            for peer in members:
                self._send(peer, Ref(StoreKind.HOLD, name, version, manifest.root))
            deadline = self.daemon.clock() + timeout_s
            while len(held) < len(members):
                left = deadline - self.daemon.clock()
                try:
                    held.append(await asyncio.wait_for(queue.get(), max(0.0, left)))
                except TimeoutError:
                    break
        finally:
            del self._held_waiters[key]
        if len(held) < min(wanted, len(members)):
            log.warning("store_put_underreplicated", name=name, held=held, wanted=wanted)
        log.info("store_put", name=name, version=version, held_by=held)
        return manifest, held

    async def get(
        self,
        name: str,
        min_version: int = 0,
        *,
        version_slack: int = 0,
        patient: bool = True,
        exclude: frozenset[str] = frozenset(),
        held_ok: bool = False,
        writer: str | None = None,
        writers: frozenset[str] | None = None,
        max_version: int = ANY_VERSION,
        root: bytes = ANY_ROOT,
        spans: tuple[tuple[int, int], ...] = (),
        one_writer: bool = False,
    ) -> tuple[bytes, Fetch]:
        """The newest version of ``name`` on the mesh (at least ``min_version``, at most
        ``max_version``) written by ``writer`` (a peer ID; None: any writer, or one of
        ``writers``) or exactly the object ``root``, and the fetch that got it
        (donors, counters; ``fetch.writer`` says whose it is). Every offer's manifest
        is checked against its writer's signature. One held here that is at least as
        new as every offer is returned without a transfer; with ``held_ok``, one held
        here of at least ``min_version`` is, without asking the mesh. ``patient``: wait
        (up to ``store.fetch_timeout_s``) for a holder to appear; otherwise fail as
        soon as every member has said it holds none. ``spans``: only these (offset,
        bytes) ranges of it, end to end; ``one_writer``: no striping over several
        writers' compatible contents (core.store.fetch)."""
        d = self.daemon
        peers = [p for p in d.mesh.view() if p != d.peer_id and p not in exclude]
        if writer is not None:
            writers = frozenset({writer})
        if root != ANY_ROOT:
            held = self.holder.find_root(name, root)
            local = held if held is not None and held.manifest.version >= min_version else None
        else:
            local = self._local(name, writers, max_version)
        floor = min_version
        if local is not None and local.manifest.version >= min_version:
            floor = local.manifest.version + 1
        fetch = Fetch(
            name,
            floor,
            peers,
            self.daemon.clock(),
            settings=self.settings,
            rtt_s=self._rtt,
            token=next(self._tokens) & 0xFFFFFFFF,
            version_slack=version_slack,
            patient=patient and local is None,
            writers=writers,
            max_version=max_version,
            root=root,
            verify=Manifest.verify,
            spans=spans,
            one_writer=one_writer,
        )
        if not (held_ok and local is not None and local.manifest.version >= min_version):
            await self._drive(fetch)
        if fetch.state is FetchState.DONE and fetch.result is not None:
            self.counters["store_fetched_bytes"] += len(fetch.result)
            return fetch.result, fetch
        if local is not None and local.manifest.version >= min_version:
            fetch.version = local.manifest.version
            fetch.manifest = local.manifest
            if spans:
                if any(at + n > len(local.data) for at, n in spans):
                    raise StoreError(f"{name!r} is shorter than the spans asked for")
                return b"".join(bytes(local.data[at : at + n]) for at, n in spans), fetch
            return local.data, fetch
        raise StoreError(fetch.error or f"nobody holds {name!r}")

    async def get_any(
        self, name: str, min_version: int = 0, writer: str | None = None, patient: bool = True
    ) -> tuple[bytes, Fetch]:
        """``name`` as a user asks for it: of ``writer`` (a peer ID or a member's node
        name, see :meth:`writer_of`) if given; else this node's own version, else that
        of the writer whose version this node has held longest (the name's first writer
        here: a member that writes the same name later, however far ahead, does not
        take it over), else the newest of any writer. ``fetch.writer`` says whose it
        is."""
        if writer:
            return await self.get(name, min_version, writer=self.writer_of(writer), patient=patient)
        with contextlib.suppress(StoreError):
            return await self.get(name, min_version, writer=self.writer, patient=False)
        first = next(iter(self.holder.objects.get(name, ())), None)
        if first is not None:
            with contextlib.suppress(StoreError):
                return await self.get(
                    name, min_version, writer=first.manifest.writer, patient=False
                )
        return await self.get(name, min_version, patient=patient)

    def remove_own(self, name: str) -> int:
        """Drop this node's own versions of ``name`` held here (``ciuic-node store
        rm``); how many. Another writer's object cannot be removed from the mesh: a
        name held here only as others' is refused, and the copies other members hold
        of ours stay theirs."""
        removed = self.holder.remove(name, self.writer)
        if removed:
            log.info("store_removed", name=name, versions=removed)
            return removed
        others = sorted({h.manifest.writer for h in self.holder.objects.get(name, ())})
        if others:
            raise StoreError(
                f"{name} is held here only as another writer's ({', '.join(others)}): "
                "a member removes only its own objects, and another's cannot be removed "
                "from the mesh"
            )
        raise StoreError(f"no object {name!r} is held here")

    def writer_of(self, who: str) -> str:
        """The peer ID of ``who``: a peer ID, a member's node name, or "self"."""
        if who in ("self", self.writer, self.daemon.config.node.name):
            return self.writer
        if who.startswith(PEER_ID_PREFIX):
            return who
        named = [p for p, m in self.daemon.mesh.members().items() if m.name == who]
        if len(named) != 1:
            raise StoreError(f"no single member is named {who!r}: give its peer ID")
        return named[0]

    def _local(self, name: str, writers: frozenset[str] | None, max_version: int) -> Held | None:
        """The newest held here of those ``writers`` (None: any, this node's own first)."""
        if writers is None:
            return self.holder.newest(name, None, max_version)
        found = [self.holder.newest(name, w, max_version) for w in writers]
        held = [h for h in found if h is not None]
        return max(held, key=lambda h: h.manifest.version) if held else None

    def status(self) -> dict[str, Any]:
        """What this node holds and fetches now (``ciuic-node status``)."""
        held = [
            {
                "name": name,
                "version": h.manifest.version,
                "bytes": h.manifest.total_bytes,
                "writer": h.manifest.writer,
            }
            for name, versions in sorted(self.holder.objects.items())
            for h in versions
        ]
        fetches = [
            {
                "name": f.name,
                "state": f.state.value,
                "pieces": f.manifest.pieces if f.manifest else None,
                "received": f.received_pieces,
                "donors": f.donors,
                "by_donor": dict(f.stats.pieces_by_donor),
                "stray": f.stats.stray,
                "corrupt": f.stats.corrupt,
                "busy": f.stats.busy,
                "donor_timeouts": f.stats.donor_timeouts,
            }
            for f in (r.fetch for r in self._fetches.values())
        ]
        return {
            "held": held,
            "fetches": fetches,
            "uploads": sorted(self.holder.uploads),
            "counters": dict(self.holder.counters),
        }

    # -- driving fetches -------------------------------------------------------------------

    async def _drive(self, fetch: Fetch) -> None:
        running = _Running(fetch)
        token = id(running)
        self._fetches[token] = running
        asyncio.get_running_loop()
        try:
            while True:
                for peer, msg in fetch.take_messages():
                    self._send(peer, msg)
                if fetch.done:
                    break
                when = fetch.get_timer()
                delay = None if when is None else max(0.0, when - self.daemon.clock())
                running.wake.clear()
                try:
                    await asyncio.wait_for(running.wake.wait(), delay)
                except TimeoutError:
                    fetch.handle_timer(self.daemon.clock())
        finally:
            del self._fetches[token]
        for donor in fetch.stats.pieces_by_donor:
            offer = fetch.offers.get(donor)
            if offer is not None:
                m = offer.manifest
                self._send(donor, Ref(StoreKind.FINISHED, fetch.name, m.version, m.root))

    def _rtt(self, peer: str) -> float | None:
        d = self.daemon
        return d.mesh.rtt_s(d.peer_id, peer)

    def _by_rtt(self) -> list[str]:
        d = self.daemon
        peers = [p for p in d.mesh.view() if p != d.peer_id]
        unknown = self.settings.unknown_rtt_s
        return sorted(peers, key=lambda p: (self._rtt(p) or unknown, p))

    def _send(self, peer: str, msg: Message) -> None:
        if not self.daemon.send_store(peer, encode(msg), bulk=is_data(msg)):
            self.counters["store_unknown_peer"] += 1

    def _served_to(self, peer: str) -> None:
        for key in [k for k in self.served if k[0] == peer]:
            nbytes = self.served.pop(key)
            if self.listener is not None:
                self.listener.served(peer, key[1], key[2], nbytes)

    def member_down(self, peer: str) -> None:
        """The mesh declared ``peer`` dead or left: its fetches and uploads end."""
        now = self.daemon.clock()
        self.holder.finished(peer)
        self._served_to(peer)
        for running in list(self._fetches.values()):
            running.fetch.peer_gone(peer, now)
            running.wake.set()

    # -- messages from members -------------------------------------------------------------

    def on_message(self, peer: str, payload: bytes) -> None:
        """A STORE_* frame from ``peer``."""
        try:
            msg = decode(payload)
        except StoreWireError as exc:
            self.counters["store_decode_errors"] += 1
            log.warning("store_message_refused", peer=peer, reason=str(exc))
            return
        now = self.daemon.clock()
        if isinstance(msg, Query):
            self._spawn(self._answer_query(peer, msg))
        elif isinstance(msg, Get):
            self._on_get(peer, msg, now)
        elif isinstance(msg, Offer | NoneHeld | Piece) or (
            isinstance(msg, Ref) and msg.kind in (StoreKind.BUSY, StoreKind.GONE)
        ):
            self._to_fetches(peer, msg, now)
        elif msg.kind is StoreKind.FINISHED:
            self.holder.finished(peer)
            self._served_to(peer)
        elif msg.kind is StoreKind.HOLD:
            self._spawn(self._hold(peer, msg))
        elif msg.kind is StoreKind.HELD:
            queue = self._held_waiters.get((msg.name, msg.version, msg.root))
            if queue is not None:
                queue.put_nowait(peer)

    def _on_get(self, peer: str, msg: Get, now: float) -> None:
        got = self.holder.on_get(peer, msg, now, self.daemon.queued_for(peer))
        if isinstance(got, list):
            self.served[(peer, msg.name, msg.version)] += sum(len(p.data) for p in got)
        if isinstance(got, list) and self.settings.upload_rate_bps > 0:
            self._spawn(self._paced(peer, got))
        else:
            for reply in got if isinstance(got, list) else [got]:
                self._send(peer, reply)

    def _to_fetches(self, peer: str, msg: Offer | NoneHeld | Piece | Ref, now: float) -> None:
        """An answer to a fetch: every running fetch of that name hears it."""
        for running in list(self._fetches.values()):
            f = running.fetch
            if isinstance(msg, Offer):
                f.on_offer(peer, msg, now)
            elif isinstance(msg, NoneHeld):
                f.on_none(peer, msg, now)
            elif msg.name != f.name:
                continue
            elif isinstance(msg, Piece):
                f.on_piece(peer, msg, now)
            elif msg.kind is StoreKind.GONE:
                f.on_gone(peer, now)
            else:
                f.on_busy(peer, now)
            running.wake.set()

    async def _paced(self, peer: str, pieces: list[Piece]) -> None:
        """Send pieces no faster than ``store.upload_rate_bps`` (the donor's own
        training traffic shares its links)."""
        rate = self.settings.upload_rate_bps / 8
        for piece in pieces:
            self._send(peer, piece)
            await asyncio.sleep(len(piece.data) / rate)

    async def _answer_query(self, peer: str, query: Query) -> None:
        if self.listener is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.listener.freshen(query.name), FRESHEN_TIMEOUT_S)
        self._send(peer, self.holder.on_query(query, self.daemon.clock()))

    async def _hold(self, peer: str, ref: Ref) -> None:
        """A member asked us to keep a copy of what it put: exactly that object (its
        root), written (signed) by that member, and not a version more than
        ``store.max_version_jump`` above the newest of that name held here; one such
        fetch at a time per member, each member within a quarter of
        ``store.max_held_bytes`` (so that one cannot fill what is there for all), all
        within the whole."""
        if self.holder.find(ref.name, ref.version, ref.root) is None:
            share = self.settings.max_held_bytes // 4
            if self.holder.jump_refused(ref.name, ref.version):
                self._hold_refused(peer, ref, "version jump")
                return
            if (
                peer in self._holding
                or self._held_for[peer] >= share
                or self.holder.bytes_held() >= self.settings.max_held_bytes
            ):
                self._hold_refused(peer, ref, "over its share")
                return
            self._holding.add(peer)
            try:
                data, fetch = await self.get(ref.name, ref.version, root=ref.root)
            except StoreError as exc:
                self.counters["store_holds_failed"] += 1
                log.warning("store_hold_failed", name=ref.name, peer=peer, reason=str(exc))
                return
            finally:
                self._holding.discard(peer)
            manifest = fetch.manifest
            if manifest is None or manifest.root != ref.root or manifest.writer != peer:
                self._hold_refused(peer, ref, "not the asking member's own object")
                return
            if (
                self._held_for[peer] + len(data) > share
                or self.holder.bytes_held() + len(data) > self.settings.max_held_bytes
            ):
                self._hold_refused(peer, ref, "over its share")
                return
            if self.holder.jump_refused(ref.name, manifest.version):
                self._hold_refused(peer, ref, "version jump")
                return
            if not self.holder.put_held(manifest, data, self.daemon.clock()):
                self._hold_refused(peer, ref, "content does not match its manifest")
                return
            self._held_for[peer] += len(data)
        self._send(peer, Ref(StoreKind.HELD, ref.name, ref.version, ref.root))

    def _hold_refused(self, peer: str, ref: Ref, why: str) -> None:
        self.counters["store_holds_refused"] += 1
        log.warning("store_hold_refused", name=ref.name, version=ref.version, peer=peer, reason=why)

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
