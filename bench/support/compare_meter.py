"""Measuring peer processes from outside: CPU time of a process tree and the payload
bytes its TCP sockets sent.

CPU: utime + stime + cutime + cstime from /proc/PID/stat of every process under the
peers (hivemind's DHT and averager processes and its p2pd daemon included).

Bytes: the kernel's per-socket ``bytes_sent`` (tcp_info.tcpi_bytes_sent: TCP payload
bytes handed to the network, retransmissions included; no IP/TCP headers), read with
``ss -tinpH`` for the sockets whose owning PID is in the tree. A socket closed between
two polls loses what it sent since the last poll, so the meter polls while a round
runs and keeps each socket's largest value.
"""

from __future__ import annotations

import os
import re
import subprocess
import threading
from collections.abc import Iterable

_TICK = os.sysconf("SC_CLK_TCK")
_PID = re.compile(r"pid=(\d+)")
_SENT = re.compile(r"bytes_sent:(\d+)")


def tree_pids(roots: Iterable[int]) -> set[int]:
    """The roots and all their descendants."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    found: set[int] = set()
    todo = list(roots)
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(children.get(pid, []))
    return found


def cpu_seconds(pids: Iterable[int]) -> float:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
    return total / _TICK


def socket_bytes(pids: set[int]) -> dict[tuple[str, str], int]:
    """bytes_sent of every TCP socket owned by one of ``pids``, by (local, peer)."""
    out = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, check=True).stdout
    found: dict[tuple[str, str], int] = {}
    key: tuple[str, str] | None = None
    for line in out.splitlines():
        if line and not line[0].isspace():
            cols = line.split()
            owners = {int(p) for p in _PID.findall(line)}
            key = (cols[3], cols[4]) if len(cols) >= 5 and owners & pids else None
            if key is not None:
                found[key] = 0
        elif key is not None:
            m = _SENT.search(line)
            if m:
                found[key] = int(m.group(1))
    return found


class SocketMeter:
    """Bytes sent by the tree's TCP sockets between :meth:`start` and :meth:`stop`."""

    def __init__(self, pids: set[int], interval_s: float = 0.2) -> None:
        self.pids = pids
        self.interval_s = interval_s
        self.before: dict[tuple[str, str], int] = {}
        self.peak: dict[tuple[str, str], int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def start(self) -> None:
        self.before = socket_bytes(self.pids)
        self.peak = dict(self.before)
        self._thread.start()

    def _sample(self) -> None:
        for k, v in socket_bytes(self.pids).items():
            self.peak[k] = max(v, self.peak.get(k, 0))

    def _poll(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        self._sample()
        return sum(v - self.before.get(k, 0) for k, v in self.peak.items())
