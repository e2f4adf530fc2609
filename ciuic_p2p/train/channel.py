"""The trainer's end of the trainer socket (daemon.trainer): frames out with one
``sendmsg`` each (header and payload buffers gathered, not joined), frames in on a
reader thread, so that the training loop never blocks on the network; it only takes
what has arrived."""

from __future__ import annotations

import base64
import collections
import contextlib
import functools
import itertools
import socket
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from ciuic_p2p.core.replica.messages import TrainWireError
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
from ciuic_p2p.errors import CiuicError


class LocalDaemon(Protocol):
    """A daemon that runs in this process (ciuic_p2p.train.embedded.EmbeddedDaemon):
    what the hook needs of it, named here so that importing the hook loads no daemon,
    transport or QUIC stack until one is made."""

    address: str

    def start(self, timeout_s: float = 30.0) -> str: ...

    def connect(self) -> DaemonChannel: ...

    def stop(self, leave: bool = True) -> None: ...


class ChannelError(CiuicError):
    """The daemon could not be reached, refused the trainer, or went away."""


class DaemonAway(ChannelError):
    """The daemon is away (restarting); the channel reconnects when it is back."""


RECONNECT_INTERVAL_S = 0.2
REJOIN_WAIT_S = 30.0
"""How long a reconnected channel waits for its daemon to see another member before
it sends what it kept (a node alone in its mesh sends at once after this)."""
PENDING_MAX_BYTES = 256 << 20
"""What the trainer keeps of its publishes while its daemon is away (the hook stops
taking updates then: only those already encoded wait here)."""


class DaemonChannel:
    """One trainer's connection to its daemon. Made by :meth:`connect` (a socket
    path), a channel outlives its daemon's restart: when the daemon goes away it is
    ``away``, keeps what the trainer publishes meanwhile, connects again when a
    daemon serves the path, says HELLO for the same run, and sends what it kept."""

    def __init__(self, sock: socket.socket, path: Path | None = None) -> None:
        self.sock = sock
        self.sock.setblocking(True)
        self.path = path
        """The socket path to reconnect to; None: a channel that ends with its daemon
        (an embedded one)."""
        self.away = False
        """The daemon went away and the channel is reconnecting."""
        self.away_since: float | None = None
        self.reconnects = 0
        self.away_s = 0.0
        """Time spent away, over every absence (s)."""
        self._run: str | None = None
        self._hello: dict[str, Any] = {}
        self._closing = False
        self._pending: collections.deque[bytes | memoryview] = collections.deque()
        self._pending_bytes = 0
        self.dropped_while_away = 0
        """Publishes dropped past ``PENDING_MAX_BYTES`` while away."""
        self._send_lock = threading.Lock()
        self._cond = threading.Condition()
        self.deliveries: collections.deque[Any] = collections.deque()
        """Delivered payloads: ``(peer, payload)``, or what ``prepare`` made of them."""
        self._prepare: Callable[[str, memoryview], Any] | None = None
        self.decode_s = 0.0
        """Time the reader thread spent preparing (decoding, checking) deliveries."""
        self.direct: collections.deque[tuple[str, memoryview]] = collections.deque()
        self.alive: list[str] = []
        self.welcome: dict[str, Any] | None = None
        self.stats: dict[str, Any] = {}
        self._stats_seq = 0
        self.snapshot_wanted = threading.Event()
        """Set when the daemon asks for a fresh state snapshot (a joiner is syncing)."""
        self.stop_asked = threading.Event()
        """Set when the daemon says it is stopping (STOPPING): checkpoint now."""
        self.daemon_stopping = False
        """From STOPPING until the channel is back: what is published is kept for the
        next daemon (the stopping one may not send it before it leaves)."""
        self._results: dict[int, dict[str, Any]] = {}
        self._got: dict[str, tuple[int, bytes, bytearray, int]] = {}
        self._done_objects: dict[str, tuple[int, bytes, bytearray]] = {}
        self._ids = itertools.count(1)
        self.error: str | None = None
        self.closed = False
        self._thread = self._start_reader(sock)

    def _start_reader(self, sock: socket.socket) -> threading.Thread:
        thread = threading.Thread(
            target=self._read_loop, args=(sock,), name="ciuic-channel", daemon=True
        )
        thread.start()
        return thread

    @classmethod
    def connect(cls, path: str | Path, timeout_s: float = 10.0) -> DaemonChannel:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                where = Path(path).expanduser()
                sock.connect(str(where))
                return cls(sock, where)
            except (FileNotFoundError, ConnectionRefusedError) as exc:
                if time.monotonic() > deadline:
                    sock.close()
                    raise ChannelError(
                        f"{path}: no daemon serves trainers here (is `ciuic-node run` "
                        f"running with this --trainer-socket?): {exc.strerror}"
                    ) from None
                time.sleep(0.1)
            except OSError as exc:
                sock.close()
                raise ChannelError(f"{path}: {exc.strerror or exc}") from None

    # -- sending -------------------------------------------------------------------------

    def _send(self, *parts: bytes | memoryview) -> None:
        if self.closed:
            raise ChannelError(self.error or "the daemon connection is closed")
        if self.away:
            raise DaemonAway(f"the daemon is away ({self.error})")
        with self._send_lock:
            sock = self.sock
            try:
                _send_all(sock, parts)
            except OSError as exc:
                self._lost(sock, f"the daemon connection broke: {exc.strerror or exc}")
                if self.closed:
                    raise ChannelError(self.error or "closed") from None
                raise DaemonAway(f"the daemon is away ({self.error})") from None

    def hello(self, run: str, timeout_s: float = 10.0, **rank: int) -> dict[str, Any]:
        """Say which run this trainer trains; the daemon's WELCOME. ``rank``: a
        sharded trainer's first rank says ``ranks`` (how many it has), each other
        rank its ``rank`` and the first rank's ``incarnation`` (daemon.rankwriters)."""
        self._run = run
        self._hello = {"run": run, **rank}
        self._send(json_frame(TrainerFrame.HELLO, self._hello))
        self.wait(lambda: self.welcome is not None, timeout_s)
        if self.welcome is None:
            raise ChannelError(self.error or "the daemon did not answer the trainer's hello")
        if "error" in self.welcome:
            raise ChannelError(f"the daemon refused this trainer: {self.welcome['error']}")
        return self.welcome

    def pending_full(self) -> bool:
        """Whether what is kept for the daemon's return nears its bound: the hook then
        stops taking updates from the model (the residual keeps them, merged)."""
        return self._pending_bytes >= PENDING_MAX_BYTES // 2

    def publish(self, payload: bytes | memoryview) -> None:
        """Send ``payload`` to the run; while the daemon is away, or stopping (it said
        STOPPING: what it gets now may never leave it), keep it (bounded) and send it
        once the channel is back: an update taken from the model is never lost to a
        restart."""
        parts = (frame_header(TrainerFrame.PUBLISH, len(payload)), payload)
        while True:
            if not self.daemon_stopping:
                try:
                    self._send(*parts)
                    return
                except DaemonAway:
                    pass
            # Under the send lock, as _back flushes what is kept and marks the channel
            # back: kept now is flushed by it, or the channel is back and it is sent.
            with self._send_lock:
                if self.away or self.daemon_stopping:
                    with self._cond:
                        if self._pending_bytes + len(payload) > PENDING_MAX_BYTES:
                            self.dropped_while_away += 1
                            return
                        self._pending.append(payload)
                        self._pending_bytes += len(payload)
                    return

    def send_direct(self, peer: str, payload: bytes | memoryview) -> None:
        prefix = peer_prefix(peer)
        self._send(
            frame_header(TrainerFrame.DIRECT_OUT, len(prefix) + len(payload)), prefix, payload
        )

    def checkpoint_written(self, path: Path, step: int, digest: str) -> None:
        body = {"path": str(Path(path).resolve()), "step": step, "digest": digest}
        with contextlib.suppress(DaemonAway):  # the file is written; the news can wait
            self._send(json_frame(TrainerFrame.CHECKPOINT, body))

    def ready_to_stop(self, step: int, path: Path | None) -> None:
        """Answer STOPPING: this replica's step and the checkpoint it wrote (if any)."""
        body = {"step": step, "checkpoint": None if path is None else str(Path(path).resolve())}
        with contextlib.suppress(ChannelError):  # gone already: nothing to tell
            self._send(json_frame(TrainerFrame.STOP_READY, body))

    def put_parts(
        self, name: str, version: int, data: bytes | bytearray | memoryview, compat: bytes
    ) -> None:
        """Hand the daemon an object to hold (the state snapshot, or a put's data)."""
        for parts in part_frames(TrainerFrame.PUT_PART, name, version, data, compat):
            self._send(*parts)

    def _request(
        self, ftype: TrainerFrame, body: dict[str, Any], timeout_s: float
    ) -> dict[str, Any]:
        return self._result(self._ask(ftype, body), timeout_s)

    def _ask(self, ftype: TrainerFrame, body: dict[str, Any]) -> int:
        rid = next(self._ids)
        self._send(json_frame(ftype, {**body, "id": rid}))
        return rid

    def answered(self, rid: int) -> bool:
        with self._cond:
            return rid in self._results

    def _result(self, rid: int, timeout_s: float) -> dict[str, Any]:
        self.wait(lambda: rid in self._results, timeout_s)
        with self._cond:
            result = self._results.pop(rid, None)
        if result is None:
            raise ChannelError(self.error or f"the daemon did not answer within {timeout_s:g} s")
        return result

    def get_object(
        self,
        name: str,
        *,
        min_version: int = 0,
        slack: int = 0,
        patient: bool = True,
        timeout_s: float = 300.0,
        writer: str | None = None,
    ) -> tuple[bytearray, dict[str, Any]]:
        """Fetch ``name`` through the daemon (core.store.fetch): its bytes and the daemon's
        report (version, writer, donors, bytes, seconds, corrupt pieces...). ``writer``:
        that member's version (peer ID or node name); None: this node's, else any."""
        rid = self.ask_object(name, min_version, slack, patient, writer=writer)
        return self.object_got(rid, name, timeout_s)

    def ask_object(
        self,
        name: str,
        min_version: int = 0,
        slack: int = 0,
        patient: bool = True,
        held_ok: bool = False,
        *,
        writer: str | None = None,
        writers: list[str] | None = None,
        max_version: int | None = None,
        one_writer: bool = False,
        spans: list[tuple[int, int]] | None = None,
    ) -> int:
        """Start fetching ``name`` (see :meth:`get_object`; ``held_ok``: a version of at
        least ``min_version`` that the daemon holds will do; ``writers``: only versions
        these peers wrote; ``max_version``: none above; ``one_writer``: all of it one
        writer's, not striped over several writers' compatible states); the request's
        ID, for :meth:`answered` and :meth:`object_got`."""
        body: dict[str, Any] = {
            "name": name,
            "min_version": min_version,
            "slack": slack,
            "patient": patient,
            "held_ok": held_ok,
        }
        if writer:
            body["writer"] = writer
        if writers is not None:
            body["writers"] = sorted(writers)
        if max_version is not None:
            body["max_version"] = max_version
        if one_writer:
            body["one_writer"] = True
        if spans:  # only these (offset, bytes) ranges of it, end to end
            body["spans"] = [list(s) for s in spans]
        return self._ask(TrainerFrame.GET_REQUEST, body)

    def sample_state(
        self,
        name: str,
        writers: list[str],
        spans: list[tuple[int, int]],
        *,
        min_version: int,
        max_version: int,
        timeout_s: float,
    ) -> dict[str, tuple[int, bytes] | str]:
        """The bytes at ``spans`` of the state ``name`` as each of ``writers`` holds
        it (its newest version within the bounds), fetched by the daemon in parallel:
        for each writer, (version, bytes), or why there is none."""
        body = {
            "name": name,
            "writers": writers,
            "spans": [list(s) for s in spans],
            "min_version": min_version,
            "max_version": max_version,
        }
        result = self._request(TrainerFrame.SAMPLE_REQUEST, body, timeout_s)
        if not result.get("ok"):
            raise ChannelError(f"{name}: {result.get('error', 'sample failed')}")
        out: dict[str, tuple[int, bytes] | str] = {w: "no answer" for w in writers}
        for sample in result.get("samples") or []:
            writer = sample.get("writer") if isinstance(sample, dict) else None
            if writer not in out:
                continue
            data, version = sample.get("data"), sample.get("version")
            if isinstance(data, str) and type(version) is int:
                try:
                    out[writer] = (version, base64.b64decode(data, validate=True))
                except ValueError:
                    out[writer] = "a sample that is not base64"
            else:
                out[writer] = str(sample.get("error", "no sample"))[:200]
        return out

    def object_got(self, rid: int, name: str, timeout_s: float) -> tuple[bytearray, dict[str, Any]]:
        """Wait for the fetch ``rid`` of ``name``; see :meth:`get_object`."""
        result = self._result(rid, timeout_s)
        if not result.get("ok"):
            raise ChannelError(f"{name}: {result.get('error', 'fetch failed')}")
        with self._cond:
            got = self._done_objects.pop(name, None)
        if got is None or got[0] != result.get("version"):
            raise ChannelError(f"{name}: the daemon's parts did not arrive whole")
        return got[2], result

    def put_object(
        self, name: str, data: bytes | bytearray | memoryview, *, version: int = 0,
        timeout_s: float = 120.0,
    ) -> dict[str, Any]:  # fmt: skip
        """Have the mesh hold ``data`` as ``name`` (version 0: the next one)."""
        self.put_parts(name, version, data, bytes(32))
        result = self._request(TrainerFrame.PUT_REQUEST, {"name": name}, timeout_s)
        if not result.get("ok"):
            raise ChannelError(f"{name}: {result.get('error', 'put failed')}")
        return result

    def request_stats(self, report: dict[str, Any] | None = None) -> None:
        """Ask for statistics; the answer lands in ``stats`` when it comes. ``report``
        tells the daemon this trainer's own figures (its metrics export them)."""
        with contextlib.suppress(DaemonAway):  # asked again after the next step
            if report is None:
                self._send(frame_header(TrainerFrame.STATS_REQUEST, 0))
            else:
                self._send(json_frame(TrainerFrame.STATS_REQUEST, report))

    def fetch_stats(self, timeout_s: float = 5.0) -> dict[str, Any]:
        with self._cond:
            seq = self._stats_seq
        self.request_stats()
        self.wait(lambda: self._stats_seq > seq, timeout_s)
        return self.stats

    # -- receiving -----------------------------------------------------------------------

    def prepare_deliveries(self, prepare: Callable[[str, memoryview], Any]) -> None:
        """From now on, the reader thread makes ``prepare(peer, payload)`` of each
        delivery (decoding and checking it while the trainer computes); earlier ones
        stay ``(peer, payload)``. Once per channel: one replica reads it."""
        if self._prepare is not None:
            raise ChannelError("this channel already prepares its deliveries")
        self._prepare = prepare

    def take_deliveries(self) -> list[Any]:
        out: list[Any] = []
        dq = self.deliveries
        while dq:
            out.append(dq.popleft())
        return out

    def wait(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        """Block until ``predicate()`` holds, something new arrives, or the timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not predicate():
                left = deadline - time.monotonic()
                if left <= 0 or self.closed:
                    return predicate()
                self._cond.wait(left)
        return True

    def wait_any(self, timeout_s: float) -> None:
        with self._cond:
            if not self.deliveries and not self.direct and not self.closed:
                self._cond.wait(timeout_s)

    def _read_loop(self, sock: socket.socket) -> None:
        reader = TrainerFrameReader()
        try:
            while True:
                data = sock.recv(1 << 20)
                if not data:
                    self._lost(sock, "the daemon closed the trainer socket")
                    return
                for ftype, body in reader.feed(data):
                    self._on_frame(ftype, body)
        except (OSError, TrainWireError) as exc:
            self._lost(sock, f"trainer socket: {exc}")
        except Exception as exc:  # e.g. out of device memory while decoding: never die silently
            self._fail(f"trainer socket reader failed: {exc!r}")

    def _lost(self, sock: socket.socket, why: str) -> None:
        """The connection ``sock`` ended: away and reconnecting where the channel can
        (a path, a run said, not being closed), else closed for good."""
        with self._cond:
            if sock is not self.sock or self.away or self.closed:
                return  # an old connection's reader, or already seen
            if self.path is None or self._run is None or self._closing:
                self._fail(why)
                return
            self.error = why
            self.away = True
            self.away_since = time.monotonic()
            self._cond.notify_all()
        threading.Thread(target=self._reconnect, name="ciuic-reconnect", daemon=True).start()

    def _reconnect(self) -> None:
        """Connect again until a daemon serves the path and welcomes this run."""
        assert self.path is not None and self._run is not None
        while not self._closing:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(str(self.path))
            except OSError:
                sock.close()
                time.sleep(RECONNECT_INTERVAL_S)
                continue
            with self._cond:
                self.welcome = None
            reader = self._start_reader(sock)
            try:
                _send_all(sock, [json_frame(TrainerFrame.HELLO, self._hello)])
            except OSError:
                sock.close()
                time.sleep(RECONNECT_INTERVAL_S)
                continue
            self.wait(lambda: self.welcome is not None, 10.0)
            welcome = self.welcome
            if welcome is None:
                with contextlib.suppress(OSError):
                    sock.close()
                continue
            if "error" in welcome:
                self._fail(f"the daemon refused this trainer on reconnecting: {welcome['error']}")
                return
            # A daemon just started serves its trainer before it has rejoined the mesh:
            # what it broadcasts then reaches nobody, and the others' logs of its new
            # session start after it. Kept publishes wait for a member to be there.
            self.wait(functools.partial(self._others_alive, str(welcome.get("peer", ""))),
                      REJOIN_WAIT_S)  # fmt: skip
            self._back(sock, reader)
            return

    def _others_alive(self, me: str) -> bool:
        return any(member != me for member in self.alive)

    def _back(self, sock: socket.socket, reader: threading.Thread) -> None:
        with self._send_lock:
            old, self.sock, self._thread = self.sock, sock, reader
            with contextlib.suppress(OSError):
                old.close()
            with self._cond:
                pending, self._pending = list(self._pending), collections.deque()
                self._pending_bytes = 0
            try:
                for payload in pending:
                    _send_all(sock, [frame_header(TrainerFrame.PUBLISH, len(payload)), payload])
            except OSError as exc:
                with self._cond:  # gone again at once: keep them for the next try
                    self._pending.extendleft(reversed(pending))
                    self._pending_bytes = sum(len(p) for p in self._pending)
                self.error = f"the daemon connection broke: {exc.strerror or exc}"
                threading.Thread(target=self._reconnect, daemon=True).start()
                return
            with self._cond:  # still under the send lock: see publish
                if self.away_since is not None:
                    self.away_s += time.monotonic() - self.away_since
                self.away, self.away_since = False, None
                self.daemon_stopping = False
                self.reconnects += 1
                self._cond.notify_all()

    def _on_frame(self, ftype: TrainerFrame, body: memoryview) -> None:
        item: Any = None
        if ftype is TrainerFrame.DELIVER:
            peer, payload = split_peer(body)
            # Decode here, on the reader thread, while the trainer computes.
            prepare = self._prepare
            t0 = time.perf_counter()
            item = (peer, payload) if prepare is None else prepare(peer, payload)
            self.decode_s += time.perf_counter() - t0
        with self._cond:
            if ftype is TrainerFrame.DELIVER:
                self.deliveries.append(item)
            elif ftype is TrainerFrame.DIRECT_IN:
                self.direct.append(split_peer(body))
            elif ftype is TrainerFrame.MEMBERS:
                self.alive = list(parse_json(body).get("alive", []))
            elif ftype is TrainerFrame.WELCOME:
                self.welcome = parse_json(body)
                self.alive = list(self.welcome.get("members", []))
            elif ftype is TrainerFrame.STATS:
                self.stats = parse_json(body)
                self._stats_seq += 1
            elif ftype is TrainerFrame.SNAPSHOT_REQUEST:
                self.snapshot_wanted.set()
            elif ftype is TrainerFrame.STOPPING:
                self.daemon_stopping = True
                self.stop_asked.set()
            elif ftype is TrainerFrame.GOT_PART:
                self._got_part(decode_part(body))
            elif ftype is TrainerFrame.STORE_RESULT:
                result = parse_json(body)
                if isinstance(result.get("id"), int):
                    self._results[result["id"]] = result
            self._cond.notify_all()

    def _got_part(self, part: Part) -> None:
        version, compat, data, got = self._got.get(part.name, (-1, b"", bytearray(), 0))
        if version != part.version or len(data) != part.total:
            version, compat, data, got = part.version, part.compat, bytearray(part.total), 0
        data[part.offset : part.offset + len(part.data)] = part.data
        got += len(part.data)
        if got >= part.total:
            self._got.pop(part.name, None)
            self._done_objects[part.name] = (version, compat, data)
        else:
            self._got[part.name] = (version, compat, data, got)

    def _fail(self, why: str) -> None:
        with self._cond:
            if not self.closed:
                self.error = why
                self.closed = True
            self._cond.notify_all()

    def close(self) -> None:
        self._closing = True
        with self._cond:
            self.closed = True
            self._cond.notify_all()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self._thread.join(timeout=5)


def _send_all(sock: socket.socket, parts: Sequence[bytes | memoryview]) -> None:
    """Send ``parts`` whole, one ``sendmsg`` at a time (buffers gathered, not joined)."""
    views = [memoryview(p).cast("B") for p in parts]
    while views:
        sent = sock.sendmsg(views)
        while views and sent >= len(views[0]):
            sent -= len(views[0])
            views.pop(0)
        if views and sent:
            views[0] = views[0][sent:]
