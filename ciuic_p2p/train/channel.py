"""The trainer's end of the trainer socket (daemon.trainer): frames out with one
``sendmsg`` each (header and payload buffers gathered, not joined), frames in on a
reader thread, so that the training loop never blocks on the network; it only takes
what has arrived."""

from __future__ import annotations

import collections
import contextlib
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ciuic_p2p.core.trainwire import (
    FrameReader,
    FrameType,
    TrainWireError,
    frame_header,
    json_frame,
    parse_json,
    peer_prefix,
    split_peer,
)
from ciuic_p2p.errors import CiuicError


class ChannelError(CiuicError):
    """The daemon could not be reached, refused the trainer, or went away."""


class DaemonChannel:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.sock.setblocking(True)
        self._send_lock = threading.Lock()
        self._cond = threading.Condition()
        self.deliveries: collections.deque[Any] = collections.deque()
        """Delivered payloads: ``(peer, payload)``, or what ``prepare`` made of them."""
        self.prepare: Callable[[str, memoryview], Any] | None = None
        self.direct: collections.deque[tuple[str, memoryview]] = collections.deque()
        self.alive: list[str] = []
        self.welcome: dict[str, Any] | None = None
        self.stats: dict[str, Any] = {}
        self._stats_seq = 0
        self.error: str | None = None
        self.closed = False
        self._thread = threading.Thread(target=self._read_loop, name="ciuic-channel", daemon=True)
        self._thread.start()

    @classmethod
    def connect(cls, path: str | Path, timeout_s: float = 10.0) -> DaemonChannel:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                sock.connect(str(Path(path).expanduser()))
                return cls(sock)
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
        with self._send_lock:
            views = [memoryview(p).cast("B") for p in parts]
            try:
                while views:
                    sent = self.sock.sendmsg(views)
                    while views and sent >= len(views[0]):
                        sent -= len(views[0])
                        views.pop(0)
                    if views and sent:
                        views[0] = views[0][sent:]
            except OSError as exc:
                self._fail(f"the daemon connection broke: {exc.strerror or exc}")
                raise ChannelError(self.error or "closed") from None

    def hello(self, run: str, timeout_s: float = 10.0) -> dict[str, Any]:
        self._send(json_frame(FrameType.HELLO, {"run": run}))
        self.wait(lambda: self.welcome is not None, timeout_s)
        if self.welcome is None:
            raise ChannelError(self.error or "the daemon did not answer the trainer's hello")
        if "error" in self.welcome:
            raise ChannelError(f"the daemon refused this trainer: {self.welcome['error']}")
        return self.welcome

    def publish(self, payload: bytes | memoryview) -> None:
        self._send(frame_header(FrameType.PUBLISH, len(payload)), payload)

    def send_direct(self, peer: str, payload: bytes | memoryview) -> None:
        prefix = peer_prefix(peer)
        self._send(frame_header(FrameType.DIRECT_OUT, len(prefix) + len(payload)), prefix, payload)

    def request_stats(self) -> None:
        """Ask for statistics; the answer lands in ``stats`` when it comes."""
        self._send(frame_header(FrameType.STATS_REQUEST, 0))

    def fetch_stats(self, timeout_s: float = 5.0) -> dict[str, Any]:
        with self._cond:
            seq = self._stats_seq
        self.request_stats()
        self.wait(lambda: self._stats_seq > seq, timeout_s)
        return self.stats

    # -- receiving -----------------------------------------------------------------------

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

    def _read_loop(self) -> None:
        reader = FrameReader()
        try:
            while True:
                data = self.sock.recv(1 << 20)
                if not data:
                    self._fail("the daemon closed the trainer socket")
                    return
                for ftype, body in reader.feed(data):
                    self._on_frame(ftype, body)
        except (OSError, TrainWireError) as exc:
            self._fail(f"trainer socket: {exc}")
        except Exception as exc:  # e.g. out of device memory while decoding: never die silently
            self._fail(f"trainer socket reader failed: {exc!r}")

    def _on_frame(self, ftype: FrameType, body: memoryview) -> None:
        item: Any = None
        if ftype is FrameType.DELIVER:
            peer, payload = split_peer(body)
            # Decode here, on the reader thread, while the trainer computes.
            prepare = self.prepare
            item = (peer, payload) if prepare is None else prepare(peer, payload)
        with self._cond:
            if ftype is FrameType.DELIVER:
                self.deliveries.append(item)
            elif ftype is FrameType.DIRECT_IN:
                self.direct.append(split_peer(body))
            elif ftype is FrameType.MEMBERS:
                self.alive = list(parse_json(body).get("alive", []))
            elif ftype is FrameType.WELCOME:
                self.welcome = parse_json(body)
                self.alive = list(self.welcome.get("members", []))
            elif ftype is FrameType.STATS:
                self.stats = parse_json(body)
                self._stats_seq += 1
            self._cond.notify_all()

    def _fail(self, why: str) -> None:
        with self._cond:
            if not self.closed:
                self.error = why
                self.closed = True
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self._thread.join(timeout=5)
