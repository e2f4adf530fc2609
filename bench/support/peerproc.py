"""A benchmark peer as a child process: its ``@@`` JSON lines are queued, everything
else goes to its log; commands go to its stdin; closing ends its whole tree."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from support.compare_meter import SocketMeter, cpu_seconds, tree_pids

PEER_SCRIPT = Path(__file__).resolve().parent / "compare_peers.py"


class Peer:
    """One peer process; its ``@@`` lines are queued, everything else goes to a log."""

    def __init__(self, args: list[str], log: Path, script: Path = PEER_SCRIPT) -> None:
        self.log = log.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, str(script), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )
        self.messages: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("@@ "):
                self.messages.put(json.loads(line[3:]))
            else:
                self.log.write(line)

    def expect(self, kind: str, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                msg = self.messages.get(timeout=max(0.1, min(1.0, deadline - time.monotonic())))
            except queue.Empty:
                if self.proc.poll() is not None:
                    why = f"peer exited ({self.proc.returncode}): see {self.log.name}"
                    raise RuntimeError(why) from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no {kind!r} from peer within {timeout_s} s") from None
                continue
            if msg["kind"] == kind:
                return msg

    def send(self, command: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        try:
            self.send("exit")
            self.proc.wait(30)
        except (OSError, subprocess.TimeoutExpired):
            for pid in tree_pids([self.proc.pid]):  # hivemind's DHT, averager and p2pd too
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()


def all_expect(peers: list[Peer], kind: str, timeout_s: float) -> list[dict[str, Any]]:
    return [p.expect(kind, timeout_s) for p in peers]


def free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def go_and_measure(
    peers: list[Peer], timeout_s: float
) -> tuple[list[dict[str, Any]], float, float, int]:
    """Send ``go`` to every peer and wait for every ``done``: (the done messages, wall
    seconds from the go to the last peer's ``t``, CPU seconds of the peers' trees,
    payload bytes their TCP sockets sent meanwhile)."""
    pids = tree_pids(p.proc.pid for p in peers)
    meter = SocketMeter(pids)
    meter.start()
    cpu0 = cpu_seconds(pids)
    t0 = time.time()
    for p in peers:
        p.send("go")
    done = all_expect(peers, "done", timeout_s)
    wall = max(float(d["t"]) for d in done) - t0
    cpu = cpu_seconds(pids) - cpu0
    return done, wall, cpu, meter.stop()
