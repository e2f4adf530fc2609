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
``writer`` says whose it is). Every answer has
``"ok"``; a failure has ``"error"`` with a sentence for the user. A request line is
at most 64 KiB. The socket is created with mode 0600: only the daemon's user (and
root) may steer it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from ciuic_p2p.daemon.node import MeshDaemon
from ciuic_p2p.daemon.store import StoreError, StoreService
from ciuic_p2p.errors import CiuicError
from ciuic_p2p.logsetup import get_logger
from ciuic_p2p.transport.quic import TransportError

MAX_REQUEST_BYTES = 64 * 1024
log = get_logger("ciuic.control")


class ControlError(CiuicError):
    """The control socket could not be reached or answered with an error."""


class ControlServer:
    def __init__(self, daemon: MeshDaemon, path: Path, store: StoreService | None = None) -> None:
        self.daemon = daemon
        self.path = path
        self.server: asyncio.AbstractServer | None = None
        self.leave_requested = asyncio.Event()
        self.store = store

    async def start(self) -> None:
        self.server = await serve_unix(self.path, self._client, 0o600, MAX_REQUEST_BYTES)

    async def close(self) -> None:
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
        except (ValueError, ConnectionError):  # over-long line or client gone
            pass
        finally:
            writer.close()

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
        except (TimeoutError, ValueError, StoreError) as exc:
            return {"ok": False, "error": str(exc)}
        except OSError as exc:
            return {"ok": False, "error": f"{exc.filename or ''}: {exc.strerror or exc}"}
        return {"ok": False, "error": f"unknown command {cmd!r}"}

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
