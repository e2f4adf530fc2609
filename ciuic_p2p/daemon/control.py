"""The control socket: a Unix socket on which ``ciuic-node join/leave/status`` (and
later the trainer hook) talk to the running daemon.

One JSON object per line each way. Requests: ``{"cmd": "status"}``, ``{"cmd":
"routes"}`` (each destination's path with its RTT beside the direct one),
``{"cmd": "join", "address": "HOST:PORT"}``, ``{"cmd": "leave"}``,
``{"cmd": "broadcast", "size": N}`` (a test payload of N bytes),
``{"cmd": "store_put", "name", "path", "local"}`` (hold the file's bytes, and have
``store.replicas`` members hold them unless ``local``), ``{"cmd": "store_get", "name",
"path", "min_version", "writer"}`` (fetch into the file, atomically, the version of
``writer``, a peer ID or node name; without one this node's own, else that of the
name's first writer held here, else the newest of any writer; the answer's
``writer`` says whose it is).

What operators of serf and consul reach for: ``{"cmd": "members"}`` (every member,
this node included and marked), ``{"cmd": "force_leave", "node"}`` (a failed member
taken as departed here), ``{"cmd": "rtt", "node", "other"}`` (measured and estimated
RTT), ``{"cmd": "reload"}`` (what SIGHUP does), ``{"cmd": "runs"}`` (the training
runs and their replicas), ``{"cmd": "store_ls"}``, ``{"cmd": "store_rm", "name"}``
(this node's own versions only), and ``{"cmd": "monitor"}``: after its answer the
connection carries one JSON object per line for each event the daemon logs
(daemon.events), until the client or the daemon closes it; a ``monitor_dropped`` line
counts events lost because the client read too slowly.

Every answer has ``"ok"``; a failure has ``"error"`` with a sentence for the user,
and ``"user_error": true`` when the request itself was the mistake (an unknown or
live member, another writer's object, a field of the wrong type). A request line is
at most 64 KiB; its fields are checked for type and range. The socket is created
with mode 0600: only the daemon's user (and root) may steer it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import time
from collections.abc import Awaitable, Callable, Generator
from pathlib import Path
from typing import Any, Protocol

from ciuic_p2p.core.link.keys import PEER_ID_PREFIX
from ciuic_p2p.daemon.events import EventFeed
from ciuic_p2p.daemon.node import MeshDaemon
from ciuic_p2p.daemon.store import StoreError, StoreService
from ciuic_p2p.errors import CiuicError
from ciuic_p2p.logsetup import get_logger
from ciuic_p2p.transport.quic import TransportError

MAX_REQUEST_BYTES = 64 * 1024
MAX_NAME_CHARS = 1024
"""A member's or object's name in a request is at most this long."""
MIN_PREFIX_CHARS = 8
"""A peer ID may be given by its first characters, at least this many."""
log = get_logger("ciuic.control")


class ControlError(CiuicError):
    """The control socket could not be reached or answered with an error."""


class Refused(CiuicError):
    """The request was the mistake: the client says so in one line and exits 2."""


class Reloadable(Protocol):
    async def reload(self) -> dict[str, Any]:
        """What SIGHUP does (daemon.service); what it did."""


class RunSource(Protocol):
    def runs(self) -> list[dict[str, Any]]:
        """The training runs the daemon knows (daemon.trainer)."""


class ControlServer:
    def __init__(self, daemon: MeshDaemon, path: Path, store: StoreService | None = None) -> None:
        self.daemon = daemon
        self.path = path
        self.server: asyncio.AbstractServer | None = None
        self.leave_requested = asyncio.Event()
        self.store = store
        self.service: Reloadable | None = None
        """The service (``ciuic-node run``'s), which reloads; it sets itself here."""
        self.trainers: RunSource | None = None
        self._closing = asyncio.Event()
        """Set at close: every monitor stream ends."""

    async def start(self) -> None:
        self.server = await serve_unix(self.path, self._client, 0o600, MAX_REQUEST_BYTES)

    async def close(self) -> None:
        self._closing.set()
        if self.server is not None:
            self.server.close()
            with contextlib.suppress(Exception):
                await self.server.wait_closed()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while line := await reader.readline():
                answer = await self._answer(line)
                writer.write(json.dumps(answer).encode() + b"\n")
                await writer.drain()
                if answer.get("monitor"):
                    await self._stream(reader, writer)
                    break
        except (ValueError, ConnectionError):  # over-long line or client gone
            pass
        finally:
            writer.close()

    async def _stream(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """The events, one JSON line each, until the client goes or the daemon stops.
        Only this connection's task waits on a slow client: the feed between drops
        the oldest events and counts them (daemon.events)."""
        with EventFeed() as feed:
            gone = asyncio.ensure_future(_until_closed(reader))
            closing = asyncio.ensure_future(self._closing.wait())
            try:
                while not gone.done() and not closing.done():
                    taking = asyncio.ensure_future(feed.take())
                    await asyncio.wait((taking, gone, closing), return_when=asyncio.FIRST_COMPLETED)
                    if not taking.done():
                        taking.cancel()
                        break
                    events, lost = taking.result()
                    if lost:
                        events.insert(0, {"event": "monitor_dropped", "dropped": lost})
                    writer.writelines(json.dumps(e).encode() + b"\n" for e in events)
                    await writer.drain()
            finally:
                for task in (gone, closing):
                    task.cancel()

    async def _answer(self, line: bytes) -> dict[str, Any]:
        try:
            request = json.loads(line)
            if not isinstance(request, dict):
                raise ValueError("not an object")
        except ValueError:
            return {"ok": False, "error": "a request is one JSON object per line"}
        cmd = request.get("cmd")
        d = self.daemon
        try:
            if cmd in self._operator_commands:
                return await self._operator(str(cmd), request)
            if cmd == "status":
                return {"ok": True, **d.status()}
            if cmd == "routes":
                return {"ok": True, "routes": d.route_table()}
            if cmd == "join":
                view = await d.join(str(request.get("address", "")))
                return {"ok": True, "members": len(view)}
            if cmd == "leave":
                self.leave_requested.set()
                return {"ok": True}
            if cmd in ("store_put", "store_get") and self.store is not None:
                return await self._store(cmd, request)
            if cmd == "broadcast":
                size = int(request.get("size", 0))
                if not 0 < size <= 1 << 20:
                    return {"ok": False, "error": "size must be in (0, 1 MiB]"}
                return {"ok": True, "seq": d.broadcast(os.urandom(size))}
        except TransportError as exc:
            return {"ok": False, "error": f"cannot join through {request.get('address')}: {exc}"}
        except Refused as exc:
            return {"ok": False, "error": str(exc), "user_error": True}
        except (TimeoutError, ValueError, StoreError) as exc:
            return {"ok": False, "error": str(exc)}
        except OSError as exc:
            return {"ok": False, "error": f"{exc.filename or ''}: {exc.strerror or exc}"}
        return {"ok": False, "error": f"unknown command {cmd!r}"}

    _operator_commands = frozenset(
        {"members", "monitor", "force_leave", "rtt", "reload", "runs", "store_ls", "store_rm"}
    )

    async def _operator(self, cmd: str, request: dict[str, Any]) -> dict[str, Any]:
        """The commands of serf's and consul's CLIs (module docstring)."""
        d = self.daemon
        if cmd == "members":
            return {"ok": True, **members(d.status())}
        if cmd == "monitor":
            return {"ok": True, "monitor": True, "peer": d.peer_id}
        if cmd == "force_leave":
            peer = self._member(_text(request, "node"))
            refused = d.force_leave(peer)
            if refused is not None:
                raise Refused(refused)
            m = d.mesh.members()[peer]
            return {"ok": True, "peer": peer, "name": m.name, "state": m.state.name.lower()}
        if cmd == "rtt":
            node = self._member(_text(request, "node"))
            if request.get("other") in (None, ""):  # from this node
                return {"ok": True, **self._rtt(d.peer_id, node)}
            return {"ok": True, **self._rtt(node, self._member(_text(request, "other")))}
        if cmd == "reload":
            if self.service is None:
                raise Refused("this daemon runs no service that reloads (`ciuic-node run` does)")
            return {"ok": True, **await self.service.reload()}
        if cmd == "runs":
            if self.trainers is None:
                return {"ok": True, "runs": [], "serves_trainer": False}
            return {"ok": True, "runs": self.trainers.runs(), "serves_trainer": True}
        if self.store is None:
            raise Refused("this daemon has no store")
        if cmd == "store_ls":
            held = self.store.status()["held"]
            for h in held:
                h["own"] = h["writer"] == self.store.writer
            return {"ok": True, "writer": self.store.writer, "held": held}
        name = _text(request, "name")
        try:
            removed = self.store.remove_own(name)
        except StoreError as exc:
            raise Refused(str(exc)) from None
        return {"ok": True, "name": name, "removed": removed}

    def _member(self, who: str) -> str:
        """The peer ID of ``who``: this node or a member known here, by peer ID, node
        name, or the first ``MIN_PREFIX_CHARS`` or more characters of its peer ID."""
        d = self.daemon
        members = d.mesh.members()
        if who in (d.peer_id, "self") or (who and who == d.config.node.name):
            return d.peer_id
        if who in members:
            return who
        found = {p for p, m in members.items() if m.name == who}
        if not found and len(who) >= MIN_PREFIX_CHARS:
            found = {p for p in (*members, d.peer_id) if p.startswith(who)}
        if len(found) == 1:
            return found.pop()
        if found:
            raise Refused(f"{who!r} names {len(found)} members: give the peer ID")
        hint = "" if who.startswith(PEER_ID_PREFIX) else " (a node name or a peer ID)"
        raise Refused(f"no member {who!r} is known here{hint}: see `ciuic-node members`")

    def _rtt(self, a: str, b: str) -> dict[str, Any]:
        """RTT between ``a`` and ``b``: as this node measured it by its probes (when
        one end is this node), as the RTT map has it, and by Vivaldi coordinates."""
        d = self.daemon
        node = d.mesh
        probes: dict[str, Any] | None = None
        far = b if a == d.peer_id else a if b == d.peer_id else None
        member = node.members().get(far) if far is not None else None
        if member is not None and member.rtt.samples:
            est = member.rtt
            probes = {
                "samples": est.samples,
                "min_ms": _ms(est.min_s),
                "smoothed_ms": _ms(est.smoothed_s),
                "variance_ms": _ms(est.var_s),
            }
        names = {p: m.name for p, m in node.members().items()} | {d.peer_id: d.config.node.name}
        return {
            "from": a,
            "from_name": names.get(a, ""),
            "to": b,
            "to_name": names.get(b, ""),
            "rtt_ms": _ms(node.rtt_s(a, b)) if a != b else 0.0,
            "rtt_source": node.rtt_source(a, b) if a != b else "self",
            "probes": probes,
            "vivaldi_ms": _ms(node.rtt_estimate_s(a, b)),
        }

    async def _store(self, cmd: str, request: dict[str, Any]) -> dict[str, Any]:
        assert self.store is not None
        name, path = str(request.get("name", "")), Path(str(request.get("path", "")))
        if cmd == "store_put":
            data = path.read_bytes()
            if request.get("local"):
                version = int(request.get("version") or 1)
                m = self.store.put_local(name, version, data)
                return {"ok": True, "version": m.version, "held_by": []}
            m, held = await self.store.put(name, data, request.get("version"))
            return {"ok": True, "version": m.version, "held_by": held}
        writer = request.get("writer")
        data, fetch = await self.store.get_any(
            name, int(request.get("min_version", 0)), str(writer) if writer else None
        )
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
        return {
            "ok": True,
            "version": fetch.version,
            "writer": fetch.writer,
            "writers": sorted(set(fetch.writers_used.values())),
            "bytes": len(data),
            "donors": dict(fetch.stats.pieces_by_donor),
            "restarts": fetch.stats.restarts,
            "corrupt": fetch.stats.corrupt,
            "donors_lost": fetch.stats.donors_lost,
            "donor_timeouts": fetch.stats.donor_timeouts,
            "busy": fetch.stats.busy,
        }


async def _until_closed(reader: asyncio.StreamReader) -> None:
    """Returns when the client closed its end; what it sends meanwhile is dropped."""
    with contextlib.suppress(ConnectionError):
        while await reader.read(4096):
            pass


def members(status: dict[str, Any]) -> dict[str, Any]:
    """Every member from a daemon's status, this node first and marked ``self``."""
    own = {
        "peer": status["peer"],
        "name": status["name"],
        "address": status["address"],
        "region": status["region"],
        "state": "alive",
        "incarnation": status["incarnation"],
        "rtt_ms": None,
        "rtt_source": "self",
        "self": True,
    }
    keys = ("peer", "name", "address", "region", "state", "incarnation", "rtt_ms", "rtt_source")
    others = [{**{k: m.get(k) for k in keys}, "self": False} for m in status["members"]]
    return {"peer": status["peer"], "members": [own, *others]}


def _text(request: dict[str, Any], field: str) -> str:
    """A request's text field, checked: a string of at most ``MAX_NAME_CHARS``."""
    value = request.get(field)
    if not isinstance(value, str) or not value or len(value) > MAX_NAME_CHARS:
        raise Refused(f"{field} must be a non-empty string of at most {MAX_NAME_CHARS} characters")
    return value


def _ms(value_s: float | None) -> float | None:
    return None if value_s is None else round(value_s * 1e3, 3)


async def serve_unix(
    path: Path,
    client: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
    mode: int,
    limit: int = 1 << 16,
) -> asyncio.AbstractServer:
    """A Unix socket server at ``path`` created with ``mode`` (no window in which it is
    more open); a stale socket left by a dead daemon is replaced, a live one refused."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() or path.is_symlink():
        if _in_use(path):
            raise ControlError(f"{path}: another daemon is running on this socket")
        path.unlink()
    old = os.umask(0o777 & ~mode)
    try:
        return await asyncio.start_unix_server(client, path=str(path), limit=limit)
    finally:
        os.umask(old)


def _in_use(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(str(path))
        except OSError:
            return False
        return True


def request(path: Path, payload: dict[str, Any], timeout_s: float = 30.0) -> dict[str, Any]:
    """Send one request to a daemon's control socket and return its answer."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout_s)
            s.connect(str(path))
            s.sendall(json.dumps(payload).encode() + b"\n")
            buf = b""
            while not buf.endswith(b"\n"):
                chunk = s.recv(65536)
                if not chunk:
                    break
                buf += chunk
    except FileNotFoundError:
        raise ControlError(f"{path}: no daemon here (is `ciuic-node run` running?)") from None
    except OSError as exc:
        raise ControlError(f"{path}: {exc.strerror or exc}") from None
    try:
        answer = json.loads(buf)
    except ValueError:
        raise ControlError(f"{path}: the daemon gave no answer") from None
    if not isinstance(answer, dict):
        raise ControlError(f"{path}: unexpected answer")
    return answer


def stream(
    path: Path, payload: dict[str, Any], until: float | None = None
) -> Generator[dict[str, Any], None, None]:
    """Send one request and yield its answer, then each object the daemon streams
    after it (``monitor``), until the daemon closes the connection or ``until`` (on
    ``time.monotonic``) passes. Ctrl+C (KeyboardInterrupt) passes through."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(30.0)
            s.connect(str(path))
            s.sendall(json.dumps(payload).encode() + b"\n")
            buf = b""
            while True:
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    yield _object(path, line)
                    s.settimeout(None)  # answered: the events come when they happen
                if until is not None:
                    left_s = until - time.monotonic()
                    if left_s <= 0:
                        return
                    s.settimeout(left_s)
                try:
                    chunk = s.recv(65536)
                except TimeoutError:
                    if until is not None:
                        return
                    raise
                if not chunk:
                    return
                buf += chunk
    except FileNotFoundError:
        raise ControlError(f"{path}: no daemon here (is `ciuic-node run` running?)") from None
    except OSError as exc:
        raise ControlError(f"{path}: {exc.strerror or exc}") from None


def _object(path: Path, line: bytes) -> dict[str, Any]:
    try:
        value = json.loads(line)
    except ValueError:
        raise ControlError(f"{path}: the daemon sent something that is not JSON") from None
    if not isinstance(value, dict):
        raise ControlError(f"{path}: unexpected answer")
    return value
