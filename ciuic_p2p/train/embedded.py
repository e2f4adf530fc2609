"""Embedded mode: the node's daemon on a thread of the training process (notebooks,
tests). It is the same daemon (QUIC, membership, routing, signing) on its own event
loop; the trainer talks to it over a socket pair with the trainer-socket protocol, so
nothing differs from production but the process boundary.

    daemon = EmbeddedDaemon(config, key, certificate, trust, state_dir=..., join="HOST:PORT")
    sync = ciuic_p2p.attach(model, optimizer, daemon=daemon)
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

from cryptography import x509

from ciuic_p2p.addresses import format_address
from ciuic_p2p.admission import Trust
from ciuic_p2p.config import Config
from ciuic_p2p.daemon.assembly import NodeAssembly
from ciuic_p2p.guard import install_loop_handler
from ciuic_p2p.identity import NodeKey
from ciuic_p2p.train.channel import ChannelError, DaemonChannel
from ciuic_p2p.transport.loop import new_event_loop

T = TypeVar("T")


class EmbeddedDaemon:
    def __init__(
        self,
        config: Config,
        key: NodeKey,
        certificate: x509.Certificate,
        trust: Trust,
        *,
        state_dir: Path,
        join: str | None = None,
        wrap_udp: Callable[[asyncio.DatagramTransport], asyncio.DatagramTransport] | None = None,
    ) -> None:
        self.config = config
        self.join_address = join
        # The node as `ciuic-node run` assembles it, minus the sockets a process serves.
        self.node = NodeAssembly(
            config, key, certificate, trust, state_dir=state_dir, wrap_udp=wrap_udp
        )
        self.daemon = self.node.daemon
        assert self.node.trainers is not None
        self.server = self.node.trainers
        self.loop = new_event_loop()
        install_loop_handler(self.loop, self.daemon.guard)  # as `ciuic-node run` does
        self.address = ""
        self.web_url: str | None = None
        """The status page and ``/metrics`` of this daemon (``config.web``), once
        started; None when disabled or its port was taken."""
        self.web_error: str | None = None
        self._thread: threading.Thread | None = None

    def start(self, timeout_s: float = 30.0) -> str:
        """Start the daemon thread (and join); the node's address."""
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="ciuic-daemon", daemon=True
        )
        self._thread.start()
        self.address = self._call(self.daemon.start(), timeout_s)
        if self.config.web.enabled:
            self._start_web(timeout_s)
        if self.join_address:
            self._call(self.daemon.join(self.join_address), timeout_s)
        return self.address

    def _start_web(self, timeout_s: float) -> None:
        """As the daemon process does: a port that is taken costs the page, not the
        training (``web_error`` says why)."""
        web = self.config.web
        try:
            port = self._call(
                self.node.start_web(self.node.daemon.state_dir / "web.token"), timeout_s
            )
        except OSError as exc:
            self.web_error = f"cannot listen on {web.listen_host}:{web.port}: {exc.strerror or exc}"
            return
        self.web_url = f"http://{format_address(web.listen_host, port)}/"

    def join(self, address: str, timeout_s: float = 30.0) -> None:
        self._call(self.daemon.join(address), timeout_s)

    def connect(self) -> DaemonChannel:
        """A trainer channel to this daemon."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._call(self.server.serve_socket(theirs), 10.0)
        return DaemonChannel(ours)

    def _call(self, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        if self._thread is None:
            raise ChannelError("the embedded daemon is not started")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def stop(self, leave: bool = True) -> None:
        if self._thread is None:
            return

        async def _stop() -> None:
            if self.node.web is not None:
                await self.node.web.close()
            await self.server.close()
            await self.node.store.close()
            if leave and self.daemon.node is not None:
                await self.daemon.leave()
            else:
                await self.daemon.close()

        try:
            self._call(_stop(), 30.0)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
            self._thread = None
            self.loop.close()
