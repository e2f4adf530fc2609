"""systemd's notify protocol: READY, STATUS, RELOADING, STOPPING and WATCHDOG
keep-alives as datagrams to ``$NOTIFY_SOCKET`` (sd_notify(3)).

The protocol is one datagram of ``KEY=value`` lines to a Unix socket, abstract when the
path starts with ``@``; a dependency on libsystemd for that is not worth its build. The
watchdog interval comes from ``$WATCHDOG_USEC`` (for our PID only, per
``$WATCHDOG_PID``); keep-alives are sent from the daemon's event loop at half the
interval, so a loop that hangs stops them and systemd restarts the service.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import Mapping

from ciuic_p2p.logsetup import get_logger

log = get_logger("ciuic.systemd")


class Notifier:
    """Sends to ``$NOTIFY_SOCKET``; every method is a no-op when it is unset."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        path = env.get("NOTIFY_SOCKET", "")
        self.address: str | bytes | None = None
        if path.startswith("@"):
            self.address = b"\0" + path[1:].encode()
        elif path.startswith("/"):
            self.address = path
        self.watchdog_s: float | None = None
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        if usec.isdigit() and int(usec) > 0 and (not pid or pid == str(os.getpid())):
            self.watchdog_s = int(usec) / 1e6
        self._sock: socket.socket | None = None
        self._keepalive: asyncio.TimerHandle | None = None

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, **fields: str | int) -> bool:
        """Send ``KEY=value`` lines (keys upper-cased); False when not under systemd or
        the socket is gone (systemd restarting: nothing to do about it here)."""
        if self.address is None:
            return False
        if self._sock is None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        text = "\n".join(f"{k.upper()}={v}" for k, v in fields.items())
        try:
            self._sock.sendto(text.encode(), self.address)
        except OSError as exc:
            log.warning("sd_notify_failed", error=str(exc))
            return False
        return True

    def ready(self, status: str) -> None:
        self.send(ready=1, status=status)

    def status(self, status: str) -> None:
        self.send(status=status)

    def reloading(self) -> None:
        # MONOTONIC_USEC lets a newer systemd (Type=notify-reload) tell this reload
        # from an earlier one; older ones ignore it.
        self.send(reloading=1, monotonic_usec=time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000)

    def stopping(self, status: str) -> None:
        self.stop_watchdog()
        self.send(stopping=1, status=status)

    def start_watchdog(self, loop: asyncio.AbstractEventLoop) -> None:
        """Keep-alives every half interval from ``loop`` (none without WATCHDOG_USEC)."""
        if self.watchdog_s is None or not self.enabled:
            return
        period_s = self.watchdog_s / 2

        def beat() -> None:
            self.send(watchdog=1)
            self._keepalive = loop.call_later(period_s, beat)

        beat()

    def stop_watchdog(self) -> None:
        if self._keepalive is not None:
            self._keepalive.cancel()
            self._keepalive = None

    def close(self) -> None:
        self.stop_watchdog()
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None
