"""The daemon's HTTP endpoint: the live status page, its JSON and Prometheus metrics.

    web = WebServer(daemon, config.web, trainer=trainers, extra_status=service.status)
    port = await web.start()        # on the daemon's running loop
    ...
    await web.close()

Routes:

- ``/``: one self-contained page (status.html next to this module: HTML, CSS, JS and
  an SVG graph, nothing fetched from elsewhere) that polls ``/api/status`` every
  ``web.refresh_s`` and updates in place: the mesh as a graph with RTT on the links,
  this node's relay routes and dissemination tree, bytes/s on its own links, each
  node's training progress and health.
- ``/api/status``: the daemon's ``status()`` plus what the page draws (``links``,
  ``tree``, ``traffic``, ``training``, ``route_changes``, ``refresh_s``, ``clock_s``).
- ``/metrics``: the Prometheus text format from daemon.metrics's collector, in a
  registry of this daemon's own.

aiohttp serves it on the daemon's own loop, so every handler reads the daemon's state
between two of its callbacks and never needs a lock. The endpoint listens on loopback
by default (the page names every member's address); while it does, requests whose
``Host`` is a name other than ``localhost`` are refused, so a web page in the
operator's browser cannot read it by rebinding its own DNS name to 127.0.0.1.

Who may read what: ``/api/status`` shows what the control socket shows (members,
addresses, counters), so it answers only a request that carries the endpoint's token
(``Authorization: Bearer TOKEN``), a random secret written at start to ``web.token``
in the runtime directory with mode 0640: the daemon's user and group, like the trainer
socket. The page itself holds no data: open ``http://HOST:PORT/#token=TOKEN`` (``ciuic-node
status`` prints it to whoever can read the file), and it sends the token from the URL's
fragment, which no browser sends to a server or a log. ``/metrics`` stays open to local
users (Prometheus scrapes it; its labels name peers, not addresses).

Local users are strangers too: a request's headers must arrive within
``web.header_timeout_s`` and an idle connection closes after it; a connection whose
answers stay unread (its send buffer not drained) for that long is closed too. At most
``web.max_connections`` are open at once, and those that are *half-open* (no request
head completed since they were made or last answered: a connection in the middle of a
request is not) are bounded apart: one source address holds at most half of them, and
a new connection past either bound closes the oldest half-open one (of that address,
or of all; one that sent part of a head first) instead of being refused. A connection
that has sent nothing yet is not closed for ``FRESH_S`` (a client sends its head as
soon as it is connected), and while none may be closed new ones open up to twice
``web.max_connections``; past that a new one is closed at once. Every local user shares
127.0.0.1, so a user who holds 64 half-finished requests, and opens a new one for each
closed, only ever loses its own: a whole request, sent at once, is answered. A user who
pipelines requests and never reads takes neither the page nor the daemon's file
descriptors (the unit raises ``LimitNOFILE``).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import hashlib
import hmac
import ipaddress
import os
import re
import secrets
from collections.abc import Awaitable, Callable
from importlib import resources
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ciuic_p2p.config import WebSection
from ciuic_p2p.core.mesh.members import State
from ciuic_p2p.daemon.metrics import DaemonCollector, RouteWatch, new_registry, traffic_by_peer
from ciuic_p2p.daemon.node import MeshDaemon
from ciuic_p2p.daemon.trainer import TrainerServer
from ciuic_p2p.logsetup import get_logger

MAX_GRAPH_NODES = 48
"""Past this many live nodes the page gets only this node's own links: every pair's
RTT would be N²/2 labels nobody can read (and a large JSON every refresh)."""
FRESH_S = 0.5
"""A new connection that has sent nothing yet is not closed to make room for this
long: a client sends its request head as soon as it is connected (and a burst of new
connections accepted in one turn of the loop would otherwise close each other)."""
SHUTDOWN_S = 1.0
"""How long close() lets a request in flight finish (the page's polls are short)."""
log = get_logger("ciuic.web")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _load_page() -> tuple[bytes, str]:
    """The page, and a Content-Security-Policy that allows its one inline script by
    hash and nothing from anywhere else."""
    html = resources.files(__package__).joinpath("status.html").read_text("utf-8")
    scripts = re.findall(r"<script>(.*?)</script>", html, flags=re.DOTALL)
    hashes = " ".join(
        "'sha256-" + base64.b64encode(hashlib.sha256(s.encode()).digest()).decode() + "'"
        for s in scripts
    )
    csp = (
        f"default-src 'none'; script-src {hashes}; style-src 'unsafe-inline'; "
        "connect-src 'self'; img-src 'self' data:; base-uri 'none'; frame-ancestors 'none'"
    )
    return html.encode("utf-8"), csp


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    with contextlib.suppress(ValueError):
        return ipaddress.ip_address(host).is_loopback
    return False


def _names_an_address(host: str | None) -> bool:
    """Whether a request's Host names this endpoint by address (or ``localhost``)."""
    if not host:
        return False
    if host.startswith("["):  # [v6] or [v6]:port
        name = host[1 : host.find("]")]
    else:
        name = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    if name == "localhost":
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


@dataclasses.dataclass(eq=False, slots=True)
class _Connection:
    """One open connection as the endpoint's bounds see it."""

    host: str
    transport: asyncio.BaseTransport
    since: float
    """When it was made, or when its last request was answered: the age of a
    half-open connection."""
    requests: int = 0
    """Requests being handled on it now."""
    head: bool = False
    """A request head came whole since ``since`` (its handling is about to start)."""
    partial: bool = False
    """Bytes came since ``since``, but no whole head: a client sends its head at once,
    so a connection that sent part of one is the first closed to make room."""
    tail: bytes = b""
    """The last bytes received while looking for the head's end."""

    @property
    def half_open(self) -> bool:
        return self.requests == 0 and not self.head

    def may_close(self, now: float) -> bool:
        """Half-open and past its chance: it sent part of a head, or nothing for
        ``FRESH_S``."""
        return self.half_open and (self.partial or now - self.since >= FRESH_S)

    def received(self, data: bytes) -> None:
        if self.half_open:
            self.partial = True
            self.head = b"\r\n\r\n" in self.tail + data[:3] or b"\r\n\r\n" in data
            self.tail = data[-3:]

    def answered(self, now: float) -> None:
        self.since, self.head, self.partial, self.tail = now, False, False, b""


class _Admitted(asyncio.Protocol):
    """aiohttp's request handler behind the endpoint's connection bounds: the bounds
    decide when the connection is made (the source address is known then), and
    everything else goes to aiohttp's handler unchanged."""

    def __init__(self, server: WebServer, inner: asyncio.Protocol) -> None:
        self.server = server
        self.inner: asyncio.Protocol | None = inner
        self.connection: _Connection | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if self.inner is not None:
            self.connection = self.server._admit(self.inner, transport)
        if self.inner is None or self.connection is None:
            self.inner = None
            transport.close()
            return
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.inner is not None and self.connection is not None:
            self.connection.received(data)
            self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return None if self.inner is None else self.inner.eof_received()

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.inner is not None:
            self.server._connections.pop(self.inner, None)
            self.inner.connection_lost(exc)


def trainers_by_peer(runs: list[dict[str, Any]], live: set[str]) -> dict[str, dict[str, Any]]:
    """Each peer's trainer as the page's row shows it: of the run it trains (the one
    its chunks came in last, a live trainer before an ended one), never another run's
    step; ``run`` names it (``run_id`` where its name is not known here). A trainer of a
    member no longer alive or suspected is shown ``left``, with no rate. Marks the
    same rows of ``runs`` too."""
    out: dict[str, dict[str, Any]] = {}
    for run in runs:  # ours first, then by the newest chunk
        for peer, row in run["trainers"].items():
            if row["state"] == "live" and peer not in live:
                row["state"], row["steps_per_s"] = "left", None
            row["run"] = run["name"] or run["run_id"]
            mine = out.get(peer)
            if mine is None or (mine["state"] != "live" and row["state"] == "live"):
                out[peer] = row
    return out


def page_announcement(url: str, token: str, token_path: Path) -> tuple[str, dict[str, str]]:
    """What ``ciuic-node run`` says once the page is up: the line for a terminal, and
    the fields of the JSON event. The terminal's line is the page's whole URL, token
    included, to open as it is: whoever reads it started the daemon as its user, who
    may read the token file anyway. The JSON event (journald, log shippers, read by
    more than the daemon's user and group) gives the URL without the token, and where
    the token is."""
    text = (
        f"status page {url}#token={token} (the token is also in {token_path}; "
        f"metrics at {url}metrics)"
    )
    fields = {
        "url": url,
        "token_file": str(token_path),
        "hint": f"open {url}#token=TOKEN, TOKEN from the file; `ciuic-node status` prints it",
    }
    return text, fields


def write_token(path: Path, token: str) -> None:
    """The endpoint's token, readable by the daemon's user and group only (0640),
    created with that mode (no window in which it is wider)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o640)
    try:
        os.fchmod(fd, 0o640)
        os.write(fd, (token + "\n").encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


class WebServer:
    """The status page, ``/api/status`` and ``/metrics`` of one daemon."""

    def __init__(
        self,
        daemon: MeshDaemon,
        settings: WebSection,
        *,
        trainer: TrainerServer | None = None,
        extra_status: Callable[[], dict[str, Any]] | None = None,
        token_path: Path | None = None,
    ) -> None:
        self.daemon = daemon
        self.settings = settings
        self.trainer = trainer
        self.extra_status = extra_status
        self.token = secrets.token_urlsafe(24)
        """What ``/api/status`` asks of every request (see the module docstring)."""
        self.token_path = token_path
        self.routes = RouteWatch()
        self.collector = DaemonCollector(
            daemon, training=None if trainer is None else trainer.progress, routes=self.routes
        )
        self.registry = new_registry(self.collector)
        self.port = 0
        self._page, self._csp = _load_page()
        self._runner: web.AppRunner | None = None
        self._listener: asyncio.Server | None = None
        self._sampler: asyncio.Task[None] | None = None
        self._reaper: asyncio.Task[None] | None = None
        self._connections: dict[asyncio.BaseProtocol, _Connection] = {}
        """Open connections by aiohttp's handler, oldest first."""
        self.connections_refused = 0
        """Connections closed by the bounds: refused at once, or half-open ones closed
        to make room (``half_open_closed``)."""
        self.half_open_closed = 0

    async def start(self) -> int:
        """Listen on ``settings.listen_host:settings.port`` (0: a free port); the port."""
        middlewares = [self._track]
        if _is_loopback(self.settings.listen_host):
            middlewares.append(self._check_host)
        app = web.Application(middlewares=middlewares)
        app.router.add_get("/", self._handle_page)
        app.router.add_get("/api/status", self._handle_status)
        app.router.add_get("/metrics", self._handle_metrics)
        # keepalive_timeout also closes a connection whose request never completes
        # (aiohttp arms it when the connection is made and only a whole request
        # disarms it): the header timeout of the module docstring.
        runner = web.AppRunner(
            app,
            access_log=None,
            shutdown_timeout=SHUTDOWN_S,
            keepalive_timeout=self.settings.header_timeout_s,
        )
        await runner.setup()
        try:
            self._listener = await asyncio.get_running_loop().create_server(
                self._protocol, self.settings.listen_host, self.settings.port
            )
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        self.port = int(self._listener.sockets[0].getsockname()[1])
        if self.token_path is not None:
            write_token(self.token_path, self.token)
        self._sampler = asyncio.get_running_loop().create_task(self._sample_routes())
        self._reaper = asyncio.get_running_loop().create_task(self._reap_unread())
        log.info("web_started", host=self.settings.listen_host, port=self.port)
        return self.port

    @property
    def open_connections(self) -> int:
        """Connections open now."""
        return len(self._connections)

    @property
    def half_open_connections(self) -> int:
        """Connections open now with no request being handled (module docstring)."""
        return sum(1 for c in self._connections.values() if c.half_open)

    def _protocol(self) -> asyncio.BaseProtocol:
        """A new connection: aiohttp's handler behind the bounds (``_admit``)."""
        assert self._runner is not None and self._runner.server is not None
        return _Admitted(self, self._runner.server())

    def _admit(
        self, handler: asyncio.BaseProtocol, transport: asyncio.BaseTransport
    ) -> _Connection | None:
        """A new connection, after closing a half-open one where it makes room (see the
        module docstring); None: every open one is in the middle of a request."""
        peer = transport.get_extra_info("peername")
        host = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        now = asyncio.get_running_loop().time()
        cap = self.settings.max_connections
        closable = [c for c in self._connections.values() if c.may_close(now)]
        of_host = [c for c in closable if c.host == host]
        host_half_open = sum(c.half_open and c.host == host for c in self._connections.values())
        if of_host and host_half_open >= max(1, cap // 2):
            self._close_half_open(of_host)
        elif len(self._connections) >= cap:
            if closable:
                self._close_half_open(closable)
            elif len(self._connections) >= 2 * cap:
                self.connections_refused += 1
                return None
        c = _Connection(host, transport, now)
        self._connections[handler] = c
        return c

    def _close_half_open(self, candidates: list[_Connection]) -> None:
        """Close the one that sent part of a head longest ago, else the oldest."""
        oldest = min(candidates, key=lambda c: (not c.partial, c.since))
        for handler, c in self._connections.items():
            if c is oldest:
                del self._connections[handler]
                break
        self.connections_refused += 1
        self.half_open_closed += 1
        oldest.transport.close()

    async def _reap_unread(self) -> None:
        """Close connections whose answers went unread for a whole ``header_timeout_s``
        (see the module docstring)."""
        stuck: set[int] = set()
        while True:
            await asyncio.sleep(self.settings.header_timeout_s)
            server = None if self._runner is None else self._runner.server
            now_stuck: set[int] = set()
            for handler in [] if server is None else server.connections:
                transport = handler.transport
                if transport is None or not transport.get_write_buffer_size():
                    continue
                if id(handler) in stuck:
                    self.connections_refused += 1
                    transport.abort()  # close() would wait for the unread bytes to go
                else:
                    now_stuck.add(id(handler))
            stuck = now_stuck

    async def close(self) -> None:
        for task in (self._sampler, self._reaper):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._sampler = self._reaper = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()
        if self.token_path is not None:
            with contextlib.suppress(FileNotFoundError):
                self.token_path.unlink()

    # -- what the page shows -------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """``daemon.status()`` and what the page draws from it."""
        d = self.daemon
        node = d.mesh
        out = d.status()
        now_s = d.clock()
        for row in out["members"]:
            row["loss"] = node.loss_of(d.peer_id, row["peer"])
        live = node.view()
        if len(live) <= MAX_GRAPH_NODES:
            pairs = [(a, b) for i, a in enumerate(live) for b in live[i + 1 :]]
        else:
            pairs = [(d.peer_id, b) for b in live if b != d.peer_id]
        links = []
        for a, b in pairs:
            rtt_s = node.rtt_s(a, b)
            if rtt_s is not None:
                source = node.rtt_source(a, b)
                links.append({"a": a, "b": b, "rtt_ms": round(rtt_s * 1000, 2), "source": source})
        routes = node.routes()
        self.routes.sample(routes)
        traffic = {peer: dataclasses.asdict(t) for peer, t in traffic_by_peer(d).items()}
        tree = node.tree(d.peer_id)
        runs = [] if self.trainer is None else self.trainer.progress.runs_status(d.peer_id, now_s)
        alive = {p for p, m in node.members().items() if m.state <= State.SUSPECT} | {d.peer_id}
        out.update(
            refresh_s=self.settings.refresh_s,
            clock_s=round(now_s, 3),
            links=links,
            tree=[[parent, child] for parent, children in tree.items() for child in children],
            traffic=traffic,
            runs=runs,
            training=trainers_by_peer(runs, alive),
            route_changes=dict(self.routes.changes),
        )
        if self.extra_status is not None:
            out.update(self.extra_status())
        return out

    async def _sample_routes(self) -> None:
        # Routes move when link state or the view changes, seconds apart: one sample per
        # refresh counts them whether or not anyone is looking.
        while True:
            await asyncio.sleep(self.settings.refresh_s)
            if self.daemon.node is not None and not self.daemon.closed.is_set():
                self.routes.sample(self.daemon.mesh.routes())

    # -- handlers ------------------------------------------------------------------------------

    @web.middleware
    async def _track(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """A request head is complete: its connection is no longer half-open until
        the request is answered."""
        c = self._connections.get(request.protocol)
        if c is None:
            return await handler(request)
        c.requests += 1
        try:
            return await handler(request)
        finally:
            c.requests -= 1
            c.answered(asyncio.get_running_loop().time())

    @web.middleware
    async def _check_host(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if not _names_an_address(request.headers.get("Host")):
            raise web.HTTPForbidden(text="address this endpoint by IP address or localhost\n")
        return await handler(request)

    async def _handle_page(self, request: web.Request) -> web.StreamResponse:
        return web.Response(
            body=self._page,
            content_type="text/html",
            charset="utf-8",
            headers={
                "Content-Security-Policy": self._csp,
                "Cache-Control": "no-store",
                "X-Content-Type-Options": "nosniff",
                "Referrer-Policy": "no-referrer",
            },
        )

    async def _handle_status(self, request: web.Request) -> web.StreamResponse:
        given = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), self.token.encode()):
            raise web.HTTPUnauthorized(
                text="send the endpoint's token (web.token in the runtime directory) as "
                "'Authorization: Bearer TOKEN'\n"
            )
        if self.daemon.node is None:
            raise web.HTTPServiceUnavailable(text="the daemon has not started\n")
        return web.json_response(self.status(), headers={"Cache-Control": "no-store"})

    async def _handle_metrics(self, request: web.Request) -> web.StreamResponse:
        return web.Response(
            body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )
