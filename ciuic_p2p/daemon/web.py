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
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import hashlib
import ipaddress
import re
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ciuic_p2p.config import WebSection
from ciuic_p2p.daemon.metrics import DaemonCollector, RouteWatch, new_registry, traffic_by_peer
from ciuic_p2p.daemon.node import MeshDaemon
from ciuic_p2p.daemon.trainer import TrainerServer
from ciuic_p2p.logsetup import get_logger

MAX_GRAPH_NODES = 48
"""Past this many live nodes the page gets only this node's own links: every pair's
RTT would be N²/2 labels nobody can read (and a large JSON every refresh)."""
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


class WebServer:
    """The status page, ``/api/status`` and ``/metrics`` of one daemon."""

    def __init__(
        self,
        daemon: MeshDaemon,
        settings: WebSection,
        *,
        trainer: TrainerServer | None = None,
        extra_status: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.daemon = daemon
        self.settings = settings
        self.trainer = trainer
        self.extra_status = extra_status
        self.routes = RouteWatch()
        self.collector = DaemonCollector(
            daemon, training=None if trainer is None else trainer.progress, routes=self.routes
        )
        self.registry = new_registry(self.collector)
        self.port = 0
        self._page, self._csp = _load_page()
        self._runner: web.AppRunner | None = None
        self._sampler: asyncio.Task[None] | None = None

    async def start(self) -> int:
        """Listen on ``settings.listen_host:settings.port`` (0: a free port); the port."""
        middlewares = [self._check_host] if _is_loopback(self.settings.listen_host) else []
        app = web.Application(middlewares=middlewares)
        app.router.add_get("/", self._handle_page)
        app.router.add_get("/api/status", self._handle_status)
        app.router.add_get("/metrics", self._handle_metrics)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=SHUTDOWN_S)
        await runner.setup()
        try:
            site = web.TCPSite(runner, self.settings.listen_host, self.settings.port)
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        self.port = int(runner.addresses[0][1])
        self._sampler = asyncio.get_running_loop().create_task(self._sample_routes())
        log.info("web_started", host=self.settings.listen_host, port=self.port)
        return self.port

    async def close(self) -> None:
        if self._sampler is not None:
            self._sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sampler
            self._sampler = None
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    # -- what the page shows -------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """``daemon.status()`` and what the page draws from it."""
        d = self.daemon
        node = d.mesh
        out = d.status()
        now_s = d.clock()
        for row in out["members"]:
            row["loss"] = node.rttmap.loss_of(d.peer_id, row["peer"])
        live = node.view()
        if len(live) <= MAX_GRAPH_NODES:
            pairs = [(a, b) for i, a in enumerate(live) for b in live[i + 1 :]]
        else:
            pairs = [(d.peer_id, b) for b in live if b != d.peer_id]
        links = []
        for a, b in pairs:
            rtt_s = node.rttmap.rtt_s(a, b)
            if rtt_s is not None:
                source = node.rttmap.source(a, b)
                links.append({"a": a, "b": b, "rtt_ms": round(rtt_s * 1000, 2), "source": source})
        routes = node.routes()
        self.routes.sample(routes)
        traffic = {peer: dataclasses.asdict(t) for peer, t in traffic_by_peer(d).items()}
        tree = node.tree(d.peer_id)
        out.update(
            refresh_s=self.settings.refresh_s,
            clock_s=round(now_s, 3),
            links=links,
            tree=[[parent, child] for parent, children in tree.items() for child in children],
            traffic=traffic,
            training={} if self.trainer is None else self.trainer.progress.rows(d.peer_id, now_s),
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
        if self.daemon.node is None:
            raise web.HTTPServiceUnavailable(text="the daemon has not started\n")
        return web.json_response(self.status(), headers={"Cache-Control": "no-store"})

    async def _handle_metrics(self, request: web.Request) -> web.StreamResponse:
        return web.Response(
            body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )
