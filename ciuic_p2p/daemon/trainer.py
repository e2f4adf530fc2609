"""The trainer socket: where the node's trainer (ciuic_p2p.train) meets its daemon.

One trainer at a time speaks the frames of core.replica.messages on a Unix socket (mode
0660: the daemon's account and group; default ``STATE_DIR/trainer.sock``; in embedded
mode, one end of a socket pair); a trainer that shards its model over local ranks has
one session per rank, the others under the first's incarnation (daemon.rankwriters).
The daemon:

- signs each chunk the trainer publishes with the node key (the trainer never holds
  it), keeps the newest parameter chunks (the snapshot that the elastic-training
  work will hand to joining peers; nothing reads it yet) and broadcasts the payload
  over the mesh;
- gives each trainer session its own incarnation (the daemon's, times 2^20, plus the
  session number), so that a restarted trainer's steps 1, 2, ... are new to its
  peers; when a trainer goes away without DONE, tells the run's replicas (GONE);
- delivers only what the mesh verified: every payload a trainer acts on (UPDATE,
  PARAMS, DONE, JOIN, GONE, FINAL) comes with its origin daemon's signature over the mesh
  chunk, checked before any node delivers or forwards it (core.mesh.broadcast), and an
  update's own header must name that same origin (no member can pass its updates off
  as another's);
- tells the trainer which members are alive whenever that changes, and answers
  statistics requests (UDP bytes sent, unsent backlog) so the trainer can adapt;
- carries DIRECT bytes between trainers (the dense baseline's all-reduce);
- holds the trainer's state snapshot in the shared store as ``state/<run id>`` (and
  asks the trainer for a fresh one when a joiner queries it), fetches the run's state
  for a joining trainer, and carries the trainer's ``put``/``get`` (daemon.store).

A trainer that stops reading cannot make the daemon grow without bound: past
``MAX_WRITE_BUFFER`` unread bytes, chunk deliveries are dropped and counted (the
consensus mix repairs what they would have changed); membership and end-of-run
messages are not. Deliveries held for a trainer that has not attached yet are
dropped when a session ends, so a new session never sees an old one's.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import os
import socket
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any, Protocol

import structlog

from ciuic_p2p.core.codec.chunk import parse_chunk
from ciuic_p2p.core.codec.origin import signed_by
from ciuic_p2p.core.mesh.broadcast import Delivery
from ciuic_p2p.core.replica.messages import (
    PayloadKind,
    TrainWireError,
    decode_done,
    decode_payload,
    decode_presence,
    encode_presence,
    run_id_of,
)
from ciuic_p2p.core.replica.trainersocket import (
    Part,
    TrainerFrame,
    TrainerFrameReader,
    decode_part,
    frame_header,
    json_frame,
    parse_json,
    part_frames,
    peer_prefix,
    split_peer,
)
from ciuic_p2p.core.store.fetch import MAX_SPANS
from ciuic_p2p.core.store.messages import ANY_VERSION
from ciuic_p2p.daemon.control import serve_unix
from ciuic_p2p.daemon.metrics import TrainingProgress
from ciuic_p2p.daemon.node import MeshDaemon
from ciuic_p2p.daemon.rankwriters import MAX_RANKS, RankWriters
from ciuic_p2p.daemon.store import StoreError, StoreService
from ciuic_p2p.errors import CiuicError, CodecError
from ciuic_p2p.identity import PEER_ID_PREFIX, peer_id_of
from ciuic_p2p.logsetup import get_logger

FIRST_FRAME_WAIT_S = 10.0
"""How long a connection may take to say its first frame (HELLO): which session it
is, the trainer's or another rank's, is decided by it."""
MAX_UNDECIDED = 16
"""Connections waiting for their first frame at a time; past it, one is closed at once."""
MAX_WRITE_BUFFER = 64 * 1024 * 1024
MAX_HELD = 4096
MAX_HELD_BYTES = 256 * 1024 * 1024
"""Deliveries held while no trainer is attached (peers that started first, or the
chunks after the state a restarted daemon prefetched), for the trainer that attaches
next: at most this many, and bytes; the oldest go first."""
PREFETCH_JOIN_WAIT_S = 60.0
"""How long a restarted daemon's prefetch waits for another member to be alive."""
RUN_FILE = "run"
"""In the state directory: the run this daemon's trainer said it trains (HELLO)."""
MEMBERS_POLL_S = 0.05
FRESH_SNAPSHOT_S = 5.0
"""A joiner's query is answered with a snapshot at most this old (else the trainer is
asked for a new one first)."""
MAX_SAMPLE_WRITERS = 8
MAX_SAMPLE_BYTES = 64 * 1024
"""A sample request's bounds: its answer (base64, per writer) fits one JSON frame."""
MAX_RANK_GETS = 2
"""Fetches of its rows of the state a rank may have under way at once."""
MAX_PENDING_OBJECTS = 4
"""Objects a trainer may have in transfer, and sent but not put, at once (each at most
``store.max_object_bytes``)."""
log = get_logger("ciuic.trainer")


class CheckpointListener(Protocol):
    def checkpoint_written(self, path: str, step: int, digest: str) -> None:
        """The trainer wrote a checkpoint (the audit log records it)."""

    def origin_set_aside(self, origin: str, until_step: int, run: str) -> None:
        """The trainer set an origin aside (the audit log records it)."""


class TrainerServer:
    """The daemon's end of the trainer socket. The composition root (daemon.assembly)
    hands it the mesh's deliveries and DIRECT frames (:meth:`deliver`,
    :meth:`direct`) and the store's snapshot requests (:meth:`freshen`)."""

    def __init__(
        self,
        daemon: MeshDaemon,
        store: StoreService,
        path: Path | None = None,
        *,
        checkpoints: CheckpointListener | None = None,
    ) -> None:
        self.daemon = daemon
        self.path = path
        self.store = store
        self.checkpoints = checkpoints
        self.state_name = ""
        self._snapshot_at = -1.0
        self._fresh = asyncio.Event()
        self._parts: dict[str, tuple[int, bytes, bytearray, int]] = {}
        """Objects the trainer is sending: name -> (version, compat, bytes so far,
        total)."""
        self._objects: dict[str, tuple[int, bytes, bytes]] = {}
        self._rank_gets: dict[int, int] = {}
        """Each rank's fetches under way (MAX_RANK_GETS)."""
        """Complete objects waiting for the trainer's PUT_REQUEST."""
        self.server: asyncio.AbstractServer | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.snapshot: dict[tuple[int, int], bytes] = {}
        """Newest parameter chunk per (bucket, range start), as published."""
        self.snapshot_step = -1
        self.progress = TrainingProgress()
        """Each origin's steps as its chunks pass here, sign/verify times (daemon.metrics)."""
        self._round_step = -1
        self._round_bytes = 0
        self._last_round_bytes = 0
        """Bytes of the trainer's update chunks in its current and its last round."""
        self._members: list[str] = []
        self._held: collections.deque[tuple[bool, bytes | None, tuple[bytes | memoryview, ...]]] = (
            collections.deque()
        )
        """(droppable, the run it is of or None, frame parts) per held delivery."""
        self._held_bytes = 0
        self._closing = False
        """The daemon is stopping: a trainer cut off now is not gone (no GONE)."""
        self._stop_ready = asyncio.Event()
        self.stop_reply: dict[str, Any] | None = None
        """The trainer's answer to STOPPING: its step and checkpoint's path (or None)."""
        self._prefetch: asyncio.Task[None] | None = None
        self.prefetch_info: dict[str, Any] | None = None
        """What the prefetch of a restarted daemon did (timing, version, donors)."""
        self._prefetch_usable = False
        """The prefetched state may be handed to the trainer without asking the mesh:
        every delivery since this daemon started is held for it or was delivered to it
        (none dropped, no trainer session ended)."""
        self._sessions_ended = 0
        self._hello = False
        self._sessions = 0
        self._run_id: bytes | None = None
        self._expected_run: bytes | None = None
        """The run the last trainer here trained (RUN_FILE): while none is attached,
        only its deliveries are held (others' cannot push them out)."""
        self._done = False
        self._tasks: list[asyncio.Task[None]] = []
        self.ranks = RankWriters(MAX_WRITE_BUFFER, MAX_HELD, MAX_HELD_BYTES, self.daemon.counters)
        """A sharded trainer's other ranks (daemon.rankwriters)."""
        self._undecided = 0
        """Connections whose first frame has not come yet."""
        self._replicas: dict[str, tuple[bytes, str]] = {}
        """Each origin whose run chunks or announcements were delivered here: (its run,
        ``live``, ``ended`` after its DONE or ``gone`` after its GONE), for ``runs``."""

    async def start(self) -> None:
        if self.path is None:
            raise ValueError("no socket path")
        self.server = await serve_unix(self.path, self._client, 0o660, 1 << 20)
        self._tasks.append(asyncio.get_running_loop().create_task(self._watch_members()))
        self._start_prefetch()

    def _start_prefetch(self) -> None:
        run = None
        with contextlib.suppress(OSError, UnicodeDecodeError):
            run = (self.daemon.state_dir / RUN_FILE).read_text().strip() or None
        if run is not None:
            self._expected_run = run_id_of(run)
            # The page and metrics show this run's trainers until one attaches.
            self.progress.run, self.progress.run_id = run[:64], self._expected_run
        if run is None or not self.daemon.config.store.prefetch_state:
            return
        name = "state/" + run_id_of(run).hex()
        self._prefetch = asyncio.get_running_loop().create_task(self._prefetch_state(name))
        self._tasks.append(self._prefetch)

    async def _prefetch_state(self, name: str) -> None:
        """Fetch the run's state into the store as soon as another member is alive;
        the trainer's GET for it then returns at once (see ``_get``)."""
        d = self.daemon
        asyncio.get_running_loop()
        t0 = self.daemon.clock()
        while d.node is None or len(d.mesh.view()) < 2:
            if self.daemon.clock() - t0 > PREFETCH_JOIN_WAIT_S:
                return
            await asyncio.sleep(MEMBERS_POLL_S)
        joined = self.daemon.clock()
        s = d.config.store
        try:
            # Patient: the donors' daemons ask their trainers for a fresh snapshot first,
            # which can outlast the query round.
            data, fetch = await self.store.get(name, 1, version_slack=s.state_version_slack_steps)
        except StoreError as exc:
            log.info("state_prefetch_failed", name=name, reason=str(exc))
            return
        m = fetch.manifest
        held = None if m is None else self.store.holder.newest(name, m.writer)
        # Its writer's own copy when the bytes are one donor's exact state; a state
        # striped over several replicas' is held as this node's (the trainer checks
        # either against the run before it takes it: train.statesync).
        if (
            m is not None
            and (held is None or held.manifest.version < fetch.version)
            and not self.store.holder.put_held(m, data, self.daemon.clock())
        ):
            self.store.put_local(name, fetch.version, data, m.compat)
        self.prefetch_info = {
            "version": fetch.version,
            "after_start_s": round(joined - d.started_at, 3),
            "seconds": round(self.daemon.clock() - joined, 3),
            # Until the first piece request: the query round and the donors' snapshots.
            "query_s": None
            if fetch.stats.first_donor_s is None
            else round(fetch.stats.first_donor_s - fetch.stats.started_s, 3),
            "donors": dict(fetch.stats.pieces_by_donor),
        }
        d.counters["state_prefetched"] += 1
        # A trainer attached meanwhile got the held deliveries and every one since.
        dropped = d.counters["deliveries_without_trainer"]
        self._prefetch_usable = self._sessions_ended == 0 and dropped == 0
        log.info("state_prefetched", name=name, **self.prefetch_info)

    async def serve_socket(self, sock: socket.socket) -> None:
        """Serve one already connected socket (embedded mode)."""
        reader, writer = await asyncio.open_unix_connection(sock=sock)
        self._tasks.append(asyncio.get_running_loop().create_task(self._watch_members()))
        self._tasks.append(asyncio.get_running_loop().create_task(self._client(reader, writer)))

    async def ask_checkpoint(self, wait_s: float) -> dict[str, Any] | None:
        """The daemon is stopping: ask an attached trainer to write a checkpoint now and
        wait for it up to ``wait_s`` (the trainer writes it at its next step); its
        answer (``step``, ``checkpoint``: the path or None), or None when no trainer
        answered in time or none is attached."""
        if wait_s <= 0 or not self._attached() or self.writer is None:
            return None
        self._stop_ready.clear()
        self.stop_reply = None
        log.warning(
            "stopping_with_trainer",
            run=self.progress.run,
            waiting_s=wait_s,
            hint="asked the trainer for a checkpoint; it goes on and reconnects when a "
            f"daemon serves {self.path or 'its socket'} again",
        )
        self._write(json_frame(TrainerFrame.STOPPING, {"wait_s": wait_s}))
        try:
            await asyncio.wait_for(self._stop_ready.wait(), wait_s)
        except TimeoutError:
            log.warning(
                "trainer_checkpoint_late",
                waited_s=wait_s,
                hint="stopping anyway; the trainer writes it at its next step "
                "(store.stop_checkpoint_wait_s sets the wait)",
            )
            return None
        if self.stop_reply is None:  # it detached meanwhile: nothing more to wait for
            log.warning("trainer_left_before_checkpoint")
            return None
        log.info("trainer_ready_to_stop", **self.stop_reply)
        return self.stop_reply

    def _stop_ready_frame(self, body: memoryview) -> None:
        info = parse_json(body)
        step, path = info.get("step"), info.get("checkpoint")
        if not isinstance(step, int) or not 0 <= step < 1 << 62:
            raise TrainWireError("STOP_READY needs a step in [0, 2^62)")
        if path is not None and (not isinstance(path, str) or len(path) > 4096):
            raise TrainWireError("STOP_READY's checkpoint is a path (at most 4096 chars)")
        self.stop_reply = {"step": step, "checkpoint": path}
        self._stop_ready.set()

    def checkpoint_dir(self) -> str | None:
        """Where this daemon's trainer checkpoints unless told otherwise
        (``checkpoints`` in the state directory, 0700 like the checkpoints a trainer
        makes itself: a model's parameters are the run's, not every local user's, and a
        file another account could replace would be restored unvouched). A trainer of
        another account falls back to its own directory; None if it cannot be made."""
        path = self.daemon.state_dir / "checkpoints"
        try:
            if not path.is_dir():
                path.mkdir(mode=0o700, parents=True, exist_ok=True)
                os.chmod(path, 0o700)  # mkdir's mode passes through the umask
        except OSError as exc:
            log.warning("checkpoint_dir_unusable", path=str(path), error=str(exc))
            return None
        return str(path.resolve())

    async def close(self) -> None:
        """Close the socket and this server's tasks (the store is the assembly's). The
        trainer is not gone with its daemon: it goes on stepping and reconnects to the
        daemon that comes back (train.channel), so its replicas hear no GONE; they see
        the member leave, and keep its account until it is back."""
        self._closing = True
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.writer is not None:
            self.writer.close()
        if self.server is not None:
            self.server.close()
            with contextlib.suppress(Exception):
                await self.server.wait_closed()
        if self.path is not None:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()

    # -- one trainer ---------------------------------------------------------------------

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A connection: the trainer, or (its HELLO names a rank) another rank of the
        sharded trainer attached (daemon.rankwriters); its first frames decide."""
        frames = TrainerFrameReader()
        first: list[tuple[TrainerFrame, memoryview]] = []
        if self._undecided >= MAX_UNDECIDED:
            self.daemon.counters["trainer_connections_refused"] += 1
            writer.close()
            return
        self._undecided += 1
        try:
            async with asyncio.timeout(FIRST_FRAME_WAIT_S):
                while not first and (data := await reader.read(1 << 20)):
                    first = list(frames.feed(data))
        except (TrainWireError, ConnectionError, asyncio.IncompleteReadError, TimeoutError):
            first = []
        finally:
            self._undecided -= 1
        if not first:
            writer.close()
            return
        if _names_rank(*first[0]):
            await self._rank_client(reader, writer, frames, first)
            return
        if self.writer is not None and not self.writer.is_closing():
            writer.write(json_frame(TrainerFrame.WELCOME, {"error": "a trainer is attached"}))
            writer.close()
            return
        await self._trainer_client(reader, writer, frames, first)

    async def _trainer_client(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        frames: TrainerFrameReader,
        first: list[tuple[TrainerFrame, memoryview]],
    ) -> None:
        self.writer = writer
        self._hello = False
        counters = self.daemon.counters
        # This task's own context: every event it logs names the trainer session.
        structlog.contextvars.bind_contextvars(trainer_session=counters["trainer_sessions"] + 1)
        try:
            async for ftype, body in _frames_of(reader, frames, first):
                self._on_frame(ftype, body)
        except TrainWireError as exc:
            counters["trainer_protocol_errors"] += 1
            log.warning("trainer_refused", reason=str(exc))
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            counters["trainer_sessions"] += 1
            self._sessions_ended += 1
            self._stop_ready.set()  # a stopping daemon waits for no trainer that left
            if self.writer is writer and self._hello:
                log.info("trainer_detached", run=self.progress.run, done=self._done)
            writer.close()
            if self.writer is writer:
                if not self._done:  # gone mid-run: its other ranks' sessions with it
                    self.ranks.close()
                # Done, the other ranks may still be in their last round: they keep
                # their sessions, and their deliveries, until they leave (or the next
                # trainer attaches).
                self._parts.clear()  # half-sent objects go with their session
                self._objects.clear()
                self.writer = None
                self._hello = False
                self._held.clear()
                self._held_bytes = 0
                self._prefetch_usable = False
                if (
                    self._run_id is not None
                    and not self._done
                    and not self._closing
                    and self.daemon.node is not None
                ):
                    # The trainer went away mid-run: its replicas stop waiting for it.
                    self.daemon.broadcast(encode_presence(PayloadKind.GONE, self._run_id))
                    counters["trainer_gone"] += 1
                if self._run_id is not None:  # the page shows it ended, with no rate
                    why = "done" if self._done else "gone"
                    self.progress.ended(self.daemon.peer_id, self._run_id, why)
                self._run_id = None

    def _hello_frame(self, body: memoryview) -> None:
        """A trainer says which run it trains: welcome it, and hand it what was held
        for that run."""
        d = self.daemon
        hello = parse_json(body)
        run, ranks = hello.get("run"), hello.get("ranks", 1)
        if not isinstance(run, str) or not run:
            raise TrainWireError("HELLO names no run")
        if type(ranks) is not int or not 1 <= ranks <= MAX_RANKS:
            raise TrainWireError(f"HELLO's ranks must be in [1, {MAX_RANKS}]")
        self._run_id = self._expected_run = run_id_of(run)
        self.state_name = "state/" + self._run_id.hex()
        self.progress.trainer_attached(run, self._run_id, d.peer_id)  # the metrics' run label
        self._remember_run(run)
        self._done = False
        self._sessions += 1
        self._members = d.mesh.view()
        self._hello = True
        log.info("trainer_attached", run=run[:64], session=self._sessions, ranks=ranks)
        incarnation = (d.mesh.incarnation << 20) + self._sessions
        self.ranks.expect(ranks, incarnation)
        self._write(json_frame(TrainerFrame.WELCOME, self._welcome(incarnation)))
        while self._held:  # what came for this run while no trainer was here
            droppable, held_run, parts = self._held.popleft()
            if held_run is not None and held_run != self._run_id:
                d.counters["deliveries_other_run"] += 1  # an ended or other run's
                continue
            self._write(*parts, droppable=droppable)
            # The other ranks are owed them as much (held until each attaches): a JOIN
            # held here reached the first rank alone, and the others never counted
            # that replica.
            if _is_delivery(parts):
                self.ranks.write(*parts, droppable=droppable)
        self._held_bytes = 0

    def _welcome(self, incarnation: int, rank: int = 0) -> dict[str, Any]:
        d = self.daemon
        return {
            "peer": d.peer_id,
            "public_key": d.key.public_key.hex(),
            "incarnation": incarnation,
            "members": self._members,
            # Only the first rank writes the replica's checkpoints.
            "checkpoint_dir": self.checkpoint_dir() if rank == 0 else None,
        }

    async def _rank_client(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        frames: TrainerFrameReader,
        first: list[tuple[TrainerFrame, memoryview]],
    ) -> None:
        """Another rank of the attached sharded trainer (daemon.rankwriters): its HELLO
        names its rank and the first rank's incarnation; then it publishes its shard's
        chunks (updates, consensus fragments, its last-round copy) and asks for
        statistics, and gets every delivery of the run."""
        rank = 0
        counters = self.daemon.counters
        try:
            async for ftype, body in _frames_of(reader, frames, first):
                rank = self._rank_frame(rank, ftype, body, writer)
        except TrainWireError as exc:
            counters["trainer_protocol_errors"] += 1
            log.warning("trainer_rank_refused", rank=rank, reason=str(exc))
            with contextlib.suppress(Exception):
                writer.write(json_frame(TrainerFrame.WELCOME, {"error": str(exc)}))
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            held = self.ranks.detach(rank, writer)
            writer.close()
            if rank and held and not self._done:
                # One rank gone mid-run: the node's replica is its ranks together, and
                # FSDP2's next collective fails on the others (torchrun ends them).
                log.warning(
                    "trainer_rank_lost",
                    rank=rank,
                    of=self.ranks.ranks,
                    hint="the node's sharded replica cannot go on without this rank; "
                    "start its torchrun again: it resumes from its checkpoint or the mesh",
                )
            elif rank:
                log.info("trainer_rank_detached", rank=rank)

    def _rank_frame(
        self, rank: int, ftype: TrainerFrame, body: memoryview, writer: asyncio.StreamWriter
    ) -> int:
        """One frame of another rank's session (``rank`` 0: before its HELLO); its rank."""
        if rank == 0:
            return self._rank_hello(ftype, body, writer)
        if self.ranks.writers.get(rank) is not writer or writer.is_closing():
            # Its first rank's session ended (or another took its place): what it
            # had buffered is not this node's to sign any more.
            raise TrainWireError(f"rank {rank}'s session ended with its first rank's")
        if ftype is TrainerFrame.PUBLISH:
            kind = decode_payload(body).kind
            if kind not in (PayloadKind.UPDATE, PayloadKind.PARAMS, PayloadKind.FINAL):
                raise TrainWireError(f"rank {rank} publishes no {kind.name}")
            self._publish(body)
        elif ftype is TrainerFrame.STATS_REQUEST:
            writer.write(self._stats_reply())
        elif ftype is TrainerFrame.GET_REQUEST:
            self._rank_get(rank, parse_json(body), writer)
        else:
            raise TrainWireError(f"rank {rank} does not send {ftype.name}")
        return rank

    def _rank_get(self, rank: int, request: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        """A rank fetches its rows of the run's state (train.shardfetch): ranges of one
        writer's version, never a whole object or another name."""
        if request.get("name") != self.state_name or not request.get("spans"):
            raise TrainWireError(f"rank {rank} fetches only ranges of its run's state")
        if self._rank_gets.get(rank, 0) >= MAX_RANK_GETS:
            raise TrainWireError(f"rank {rank} has {MAX_RANK_GETS} fetches under way")
        self._rank_gets[rank] = self._rank_gets.get(rank, 0) + 1

        def write(*parts: bytes | memoryview) -> None:
            if not writer.is_closing():
                writer.writelines(parts)

        async def get() -> None:
            try:
                await self._get(request, write)
            finally:
                self._rank_gets[rank] -= 1

        self._spawn(get())

    def _rank_hello(
        self, ftype: TrainerFrame, body: memoryview, writer: asyncio.StreamWriter
    ) -> int:
        if ftype is not TrainerFrame.HELLO:
            raise TrainWireError("a rank says HELLO first")
        if not self._attached() or not self.ranks.expecting():
            raise TrainWireError("no sharded trainer's first rank is attached here")
        hello = parse_json(body)
        if hello.get("run") != self.progress.run:
            raise TrainWireError("a rank's HELLO names another run than its first rank's")
        rank, incarnation = hello.get("rank"), hello.get("incarnation")
        why = self.ranks.admit(rank, incarnation)
        if why is not None:
            raise TrainWireError(why)
        assert isinstance(rank, int) and isinstance(incarnation, int)
        writer.write(json_frame(TrainerFrame.WELCOME, self._welcome(incarnation, rank)))
        self.ranks.attach(rank, writer)
        log.info("trainer_rank_attached", rank=rank, of=self.ranks.ranks)
        return rank

    def _on_frame(self, ftype: TrainerFrame, body: memoryview) -> None:
        d = self.daemon
        if ftype is TrainerFrame.HELLO:
            self._hello_frame(body)
        elif ftype is TrainerFrame.PUBLISH:
            self._publish(body)
        elif ftype is TrainerFrame.STATS_REQUEST:
            self._stats_frame(body)
        elif ftype is TrainerFrame.PUT_PART:
            self._put_part(decode_part(body))
        elif ftype is TrainerFrame.GET_REQUEST:
            self._spawn(self._get(parse_json(body)))
        elif ftype is TrainerFrame.PUT_REQUEST:
            self._spawn(self._put(parse_json(body)))
        elif ftype is TrainerFrame.SAMPLE_REQUEST:
            self._spawn(self._sample(parse_json(body)))
        elif ftype is TrainerFrame.CHECKPOINT:
            info = parse_json(body)
            step, digest = info.get("step"), info.get("digest")
            if not isinstance(step, int) or not isinstance(digest, str):
                raise TrainWireError("CHECKPOINT needs an integer step and a digest")
            d.counters["trainer_checkpoints"] += 1
            if self.checkpoints is not None:
                self.checkpoints.checkpoint_written(str(info.get("path", "")), step, digest)
        elif ftype is TrainerFrame.STOP_READY:
            self._stop_ready_frame(body)
        elif ftype is TrainerFrame.DIRECT_OUT:
            peer, payload = split_peer(body)
            try:
                d.send_direct(peer, bytes(payload))
            except ValueError:
                d.counters["direct_unknown_peer"] += 1
        else:
            raise TrainWireError(f"a trainer does not send {ftype.name}")

    def _stats_frame(self, body: memoryview) -> None:
        if len(body):
            for origin, until in self.progress.report(parse_json(body)):
                log.warning(
                    "origin_set_aside",
                    origin=origin,
                    until_step=until,
                    hint="ciuic-node ca revoke removes a member for good",
                )
                if self.checkpoints is not None:
                    self.checkpoints.origin_set_aside(origin, until, self.progress.run)
        self._write(self._stats_reply())

    def _stats_reply(self) -> bytes:
        d = self.daemon
        return json_frame(
            TrainerFrame.STATS,
            {
                "udp_bytes_sent": d.transport.udp_bytes_sent,
                "backlog_bytes": d.backlog_bytes(),
                "counters": dict(d.counters),
            },
        )

    def _publish(self, body: memoryview) -> None:
        d = self.daemon
        msg = decode_payload(body)
        if msg.kind in (PayloadKind.DONE, PayloadKind.JOIN, PayloadKind.GONE):
            self._done = self._done or msg.kind is PayloadKind.DONE
            if msg.kind is PayloadKind.DONE and self._run_id is not None:
                step = decode_done(msg.body)[1]
                self.progress.ended(d.peer_id, self._run_id, "done", step)
            d.broadcast(bytes(body))
            return
        t0 = time.perf_counter()
        try:
            header, _ = parse_chunk(msg.body)
            payload = signed_by(msg.body, d.key, header, prefix=bytes(body[:4]))
        except (CodecError, CiuicError) as exc:
            raise TrainWireError(f"published chunk refused: {exc}") from None
        self.progress.sign.add(time.perf_counter() - t0)
        update = msg.kind is PayloadKind.UPDATE
        self.progress.observe(
            d.peer_id, header.incarnation, header.step, d.clock(), update, header.run_id
        )
        d.counters["chunks_published"] += 1
        if msg.kind is PayloadKind.FINAL:
            d.broadcast(payload)  # once per run: not a round's piece
            return
        if msg.kind is PayloadKind.PARAMS:
            if header.step != self.snapshot_step:
                self.snapshot.clear()
                self.snapshot_step = header.step
            self.snapshot[(header.bucket, header.range_start)] = payload
            d.broadcast(payload)
            return
        # An update's chunks are a round's pieces: they spread by the strategy chosen
        # for the round (core.mesh.strategy), sized by this trainer's last round.
        if header.step != self._round_step:
            if self._round_step >= 0:
                self._last_round_bytes = self._round_bytes
            self._round_step, self._round_bytes = header.step, 0
        self._round_bytes += len(payload)
        d.broadcast(
            payload,
            round_id=(header.incarnation, header.step),
            round_bytes=max(self._last_round_bytes, self._round_bytes),
        )

    # -- state and the shared store ------------------------------------------------------

    def _put_part(self, part: Part) -> None:
        """One part of an object the trainer sends, in order: the buffer grows with the
        bytes that arrived (never to the size a first part announces) and holds at most
        ``store.max_object_bytes``; what a session leaves half-sent goes with it."""
        limit = self.daemon.config.store.max_object_bytes
        if part.total > limit:
            raise TrainWireError(f"object of {part.total} bytes exceeds store.max_object_bytes")
        version, compat, data, total = self._parts.get(part.name, (-1, b"", bytearray(), -1))
        if version != part.version or total != part.total or part.offset == 0:
            if len(self._parts) >= MAX_PENDING_OBJECTS and part.name not in self._parts:
                raise TrainWireError("too many objects in transfer at once")
            version, compat, data, total = part.version, part.compat, bytearray(), part.total
        if part.offset != len(data):
            raise TrainWireError(f"object part at {part.offset}, expected {len(data)}")
        data += part.data
        if len(data) < part.total:
            self._parts[part.name] = (version, compat, data, total)
            return
        self._parts.pop(part.name, None)
        if part.name == self.state_name:
            self.store.put_local(part.name, version, bytes(data), compat)
            self._snapshot_at = self.daemon.clock()
            self._fresh.set()
            self.daemon.counters["state_snapshots"] += 1
        else:
            if part.name not in self._objects and len(self._objects) >= MAX_PENDING_OBJECTS:
                raise TrainWireError("too many objects sent and not put yet")
            self._objects[part.name] = (version, compat, bytes(data))

    def _remember_run(self, run: str) -> None:
        """Write the run's name to the state directory, for the prefetch after a
        restart (atomically; a daemon whose directory is read-only just won't)."""
        path = self.daemon.state_dir / RUN_FILE
        with contextlib.suppress(OSError):
            if path.exists() and path.read_text().strip() == run:
                return
            tmp = path.with_suffix(".tmp")
            tmp.write_text(run + "\n")
            os.replace(tmp, path)

    async def freshen(self, name: str) -> None:
        """Before a joiner's query for this run's state is answered: have the trainer
        hand a fresh snapshot unless the one held is recent."""
        asyncio.get_running_loop()
        if name != self.state_name or not self._hello:
            return
        if self.daemon.clock() - self._snapshot_at <= FRESH_SNAPSHOT_S:
            return
        self._fresh.clear()
        self._write(frame_header(TrainerFrame.SNAPSHOT_REQUEST, 0))
        await self._fresh.wait()

    def _result(
        self, rid: object, ok: bool, write: Callable[..., None] | None = None, **fields: object
    ) -> None:
        frame = json_frame(TrainerFrame.STORE_RESULT, {"id": rid, "ok": ok, **fields})
        (write or self._write)(frame)

    async def _get(
        self, request: dict[str, object], write: Callable[..., None] | None = None
    ) -> None:
        """A GET: the object (or, with ``spans``, those ranges of it, end to end) to the
        trainer, or to the rank whose ``write`` this is."""
        rid = request.get("id")
        name = request.get("name")
        t0 = self.daemon.clock()
        write = write or self._write
        try:
            if not isinstance(name, str):
                raise StoreError("GET names no object")
            spans = _spans_of(request.get("spans"))
            prefetch = self._prefetch
            if prefetch is not None and name == self.state_name and not prefetch.done():
                await asyncio.shield(prefetch)  # the state it gets is what we want
            min_version = int(request.get("min_version", 0))  # type: ignore[call-overload]
            writer, writers = request.get("writer"), request.get("writers")
            if isinstance(writers, list) and all(isinstance(w, str) for w in writers):
                allowed: frozenset[str] | None = frozenset(writers)
            elif writers is None:
                allowed = None
            else:
                raise StoreError("GET's writers are not a list of peer IDs")
            if name != self.state_name and not writer and allowed is None:
                # A user's object: this node's own version, else the newest of any.
                patient = bool(request.get("patient", True))
                data, fetch = await self.store.get_any(name, min_version, patient=patient)
            else:
                data, fetch = await self.store.get(
                    name,
                    min_version,
                    version_slack=int(request.get("slack", 0)),  # type: ignore[call-overload]
                    patient=bool(request.get("patient", True)),
                    # Only the prefetched state, with every chunk since held for the trainer.
                    held_ok=bool(request.get("held_ok")) and self._prefetch_usable,
                    writer=self.store.writer_of(str(writer)) if writer else None,
                    writers=allowed,
                    max_version=int(request.get("max_version", ANY_VERSION)),  # type: ignore[call-overload]
                    one_writer=bool(request.get("one_writer")),
                    spans=spans,
                )
        except (StoreError, ValueError, TypeError) as exc:
            self._result(rid, False, write, error=str(exc))
            return
        compat = fetch.manifest.compat if fetch.manifest else bytes(32)
        for parts in part_frames(TrainerFrame.GOT_PART, name, fetch.version, data, compat):
            write(*parts)
        self._result(
            rid,
            True,
            write,
            version=fetch.version,
            writer=fetch.writer,
            writers=sorted(set(fetch.writers_used.values()) | {fetch.writer} - {""}),
            bytes=len(data),
            seconds=round(self.daemon.clock() - t0, 3),
            query_s=None
            if fetch.stats.first_donor_s is None
            else round(fetch.stats.first_donor_s - fetch.stats.started_s, 3),
            donors=dict(fetch.stats.pieces_by_donor),
            corrupt=fetch.stats.corrupt,
            donor_timeouts=fetch.stats.donor_timeouts,
            donors_lost=fetch.stats.donors_lost,
            busy=fetch.stats.busy,
            restarts=fetch.stats.restarts,
            prefetch=self.prefetch_info if name == self.state_name else None,
        )

    async def _sample(self, request: dict[str, object]) -> None:
        """Spans of the run's state as each of several writers holds it (their newest
        version within the bounds asked), fetched in parallel: a joiner compares them
        with the state it took (train.statesync). Answers every writer, with its
        bytes (base64) or why not."""
        rid = request.get("id")
        try:
            writers, spans, low, high = _sample_request(request, self.state_name)
        except (StoreError, ValueError, TypeError) as exc:
            self._result(rid, False, error=str(exc))
            return

        async def one(writer: str) -> dict[str, object]:
            try:
                data, fetch = await self.store.get(
                    self.state_name, low, writer=writer, max_version=high, patient=False,
                    spans=spans, one_writer=True,
                )  # fmt: skip
            except (StoreError, ValueError) as exc:
                return {"writer": writer, "error": str(exc)}
            return {
                "writer": writer,
                "version": fetch.version,
                "data": base64.b64encode(data).decode("ascii"),
            }

        samples = await asyncio.gather(*(one(w) for w in writers))
        self._result(rid, True, samples=list(samples))

    async def _put(self, request: dict[str, object]) -> None:
        rid = request.get("id")
        name = request.get("name")
        held = self._objects.pop(name, None) if isinstance(name, str) else None
        if held is None or not isinstance(name, str):
            self._result(rid, False, error=f"no object {name!r} was sent")
            return
        version, _, data = held
        try:
            manifest, holders = await self.store.put(name, data, version or None)
        except (StoreError, ValueError) as exc:
            self._result(rid, False, error=str(exc))
            return
        self._result(rid, True, version=manifest.version, held_by=holders)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.append(task)
        task.add_done_callback(self._forget)

    def _forget(self, task: asyncio.Task[None]) -> None:
        if task in self._tasks:
            self._tasks.remove(task)

    # -- mesh to trainer -----------------------------------------------------------------

    def deliver(self, delivery: Delivery) -> None:
        counters = self.daemon.counters
        run: bytes | None = None
        try:
            msg = decode_payload(delivery.payload)
            if msg.kind is PayloadKind.DONE:
                run, step, _ = decode_done(msg.body)
                self.progress.ended(delivery.origin, run, "done", step)
            elif msg.kind in (PayloadKind.JOIN, PayloadKind.GONE):
                run = decode_presence(msg.body).run_id
                if msg.kind is PayloadKind.GONE:
                    self.progress.ended(delivery.origin, run, "gone")
            if msg.kind in (PayloadKind.UPDATE, PayloadKind.PARAMS, PayloadKind.FINAL):
                # The mesh checked the origin's signature over the whole payload
                # (core.mesh.broadcast): what is left is that the update is the origin's own.
                t0 = time.perf_counter()
                header, _ = parse_chunk(msg.body)
                self.progress.verify.add(time.perf_counter() - t0)
                if peer_id_of(header.origin) != delivery.origin:
                    raise CiuicError("chunk origin differs from the mesh origin")
                run = header.run_id
                self.progress.observe(
                    delivery.origin,
                    header.incarnation,
                    header.step,
                    delivery.at,
                    msg.kind is PayloadKind.UPDATE,
                    run,
                )
        except (TrainWireError, CiuicError) as exc:
            counters["deliveries_refused"] += 1
            log.warning("delivery_refused", origin=delivery.origin, reason=str(exc))
            return
        self._note_replica(delivery.origin, run, msg.kind)
        if msg.kind is PayloadKind.JOIN and not self._attached():
            # A trainer that attaches later asks the replicas where they are then; an
            # old JOIN would tell it a step long past.
            counters["joins_not_held"] += 1
            return
        wanted = self._run_id if self._attached() else self._expected_run
        if run is not None and wanted is not None and run != wanted:
            counters["deliveries_other_run"] += 1  # runs share the mesh, not trainers
            return
        prefix = peer_prefix(delivery.origin)
        parts = (
            frame_header(TrainerFrame.DELIVER, len(prefix) + len(delivery.payload)),
            prefix,
            delivery.payload,
        )
        droppable = msg.kind in (PayloadKind.UPDATE, PayloadKind.PARAMS)
        self._write(*parts, droppable=droppable, run=run)
        if self._attached() or self.ranks.writers:
            self.ranks.write(*parts, droppable=droppable)

    def direct(self, peer: str, payload: bytes) -> None:
        prefix = peer_prefix(peer)
        self._write(
            frame_header(TrainerFrame.DIRECT_IN, len(prefix) + len(payload)), prefix, payload
        )

    def _note_replica(self, origin: str, run: bytes | None, kind: PayloadKind) -> None:
        if run is None or (origin not in self._replicas and len(self._replicas) >= MAX_HELD):
            return  # bounded by members in practice; by MAX_HELD whatever they send
        state = {PayloadKind.DONE: "ended", PayloadKind.GONE: "gone"}.get(kind, "live")
        self._replicas[origin] = (run, state)

    def runs(self) -> list[dict[str, Any]]:
        """The training runs this daemon knows (``ciuic-node runs``): its own trainer's
        and those its peers' chunks and announcements named, each with its replicas
        (origin daemons): their newest step seen here and whether they are live,
        ended (DONE) or gone (GONE); this node's own: attached, detached or ended."""
        d = self.daemon
        steps = self.progress.rows(d.peer_id, d.clock())
        replicas: dict[bytes, list[dict[str, Any]]] = collections.defaultdict(list)
        for origin, (run, state) in self._replicas.items():
            replicas[run].append({"peer": origin, "local": False, "state": state})
        own = self._run_id or self._expected_run
        if own is not None:
            state = "attached" if self._attached() else "detached"
            replicas[own].append(
                {"peer": d.peer_id, "local": True, "state": "ended" if self._done else state}
            )
        out = []
        for run, rows in sorted(replicas.items()):
            for row in rows:
                seen = steps.get(row["peer"]) or {}
                row["step"], row["steps_per_s"] = seen.get("step"), seen.get("steps_per_s")
                row["age_s"] = seen.get("age_s")
            out.append(
                {
                    "run": run.hex(),
                    "name": self.progress.run if run == own else "",
                    "local": run == own,
                    "live": any(r["state"] in ("live", "attached") for r in rows),
                    "replicas": sorted(rows, key=lambda r: (not r["local"], r["peer"])),
                }
            )
        return out

    def _attached(self) -> bool:
        return self.writer is not None and not self.writer.is_closing() and self._hello

    def _write(
        self, *parts: bytes | memoryview, droppable: bool = False, run: bytes | None = None
    ) -> None:
        writer = self.writer
        counters = self.daemon.counters
        if writer is None or not self._attached():
            self._held.append((droppable, run, parts))
            self._held_bytes += sum(len(p) for p in parts)
            while len(self._held) > MAX_HELD or self._held_bytes > MAX_HELD_BYTES:
                _, _, dropped = self._held.popleft()
                self._held_bytes -= sum(len(p) for p in dropped)
                counters["deliveries_without_trainer"] += 1
                self._prefetch_usable = False
            return
        if droppable and writer.transport.get_write_buffer_size() > MAX_WRITE_BUFFER:
            counters["deliveries_dropped"] += 1
            return
        writer.writelines(parts)

    async def _watch_members(self) -> None:
        while True:
            await asyncio.sleep(MEMBERS_POLL_S)
            if self.daemon.node is None or self.writer is None:
                continue
            view = self.daemon.mesh.view()
            if view != self._members:
                self._members = view
                frame = json_frame(TrainerFrame.MEMBERS, {"alive": view})
                self._write(frame)
                self.ranks.write(frame)


async def _frames_of(
    reader: asyncio.StreamReader,
    frames: TrainerFrameReader,
    first: list[tuple[TrainerFrame, memoryview]],
) -> AsyncIterator[tuple[TrainerFrame, memoryview]]:
    """A session's frames: those read to decide whose it is, then the rest as they come."""
    for frame in first:
        yield frame
    while data := await reader.read(1 << 20):
        for frame in frames.feed(data):
            yield frame


def _is_delivery(parts: tuple[bytes | memoryview, ...]) -> bool:
    """A held frame is a DELIVER (what the other ranks of a sharded trainer are owed;
    not a request or a DIRECT frame of the first rank's)."""
    return bool(parts) and bytes(parts[0][4:5]) == bytes((TrainerFrame.DELIVER,))


def _names_rank(ftype: TrainerFrame, body: memoryview) -> bool:
    """A HELLO of a sharded trainer's rank other than the first."""
    if ftype is not TrainerFrame.HELLO:
        return False
    try:
        return parse_json(body).get("rank") is not None
    except TrainWireError:
        return False


def _spans_of(raw: object) -> tuple[tuple[int, int], ...]:
    """A GET's ``spans`` (absent: the whole object), each checked: [offset, bytes]
    pairs of ints, at most MAX_SPANS (the fetch bounds their bytes)."""
    if raw is None:
        return ()
    if (
        not isinstance(raw, list)
        or len(raw) > MAX_SPANS
        or not all(
            isinstance(s, list) and len(s) == 2 and all(type(x) is int and x >= 0 for x in s)
            for s in raw
        )
    ):
        raise StoreError(f"a GET's spans are at most {MAX_SPANS} [offset, bytes] pairs")
    return tuple((int(at), int(n)) for at, n in raw)


def _sample_request(
    request: dict[str, object], state_name: str
) -> tuple[list[str], tuple[tuple[int, int], ...], int, int]:
    """A SAMPLE_REQUEST's writers, spans and version bounds, each checked: a trainer's
    request is input like any other."""
    if request.get("name") != state_name:
        raise StoreError("a sample is of this run's state only")
    writers, spans = request.get("writers"), request.get("spans")
    if (
        not isinstance(writers, list)
        or not 0 < len(writers) <= MAX_SAMPLE_WRITERS
        or not all(isinstance(w, str) and w.startswith(PEER_ID_PREFIX) for w in writers)
    ):
        raise StoreError(f"a sample names 1..{MAX_SAMPLE_WRITERS} writers by peer ID")
    if not isinstance(spans, list) or not all(
        isinstance(s, list) and len(s) == 2 and all(type(x) is int for x in s) for s in spans
    ):
        raise StoreError("a sample's spans are [offset, bytes] pairs")
    pairs = tuple((int(at), int(n)) for at, n in spans)
    if sum(n for _, n in pairs) > MAX_SAMPLE_BYTES:
        raise StoreError(f"a sample is at most {MAX_SAMPLE_BYTES} bytes per writer")
    low, high = request.get("min_version", 0), request.get("max_version", ANY_VERSION)
    if type(low) is not int or type(high) is not int or not 0 <= low <= high <= ANY_VERSION:
        raise StoreError("a sample's version bounds are out of range")
    return list(dict.fromkeys(writers)), pairs, low, high
