"""Start N emulated nodes as separate processes on a scenario, and tear them down.

Every process is ours and ended by its PID (SIGTERM, then SIGKILL after a grace
period); nothing is looked up or killed by name. Start-up and every command are
bounded in time.
"""

from __future__ import annotations

import json
import os
import random
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from ciuic_p2p.emulator.scenarios import load_scenario
from ciuic_p2p.errors import CiuicError


class EmulatorProcessError(CiuicError):
    """An emulated node process failed to start or to answer in time."""


class ProcessMesh:
    def __init__(
        self,
        scenario: str | Path,
        nodes: int | None = None,
        base_port: int | None = None,
        startup_timeout_s: float = 20.0,
        namespaces: list[str] | None = None,
    ) -> None:
        """``namespaces``: run node i inside network namespace i (emulator.netns)."""
        self.scenario_path = str(scenario)
        names = load_scenario(scenario).node_names()
        if nodes is not None and not 2 <= nodes <= len(names):
            raise EmulatorProcessError(f"--nodes must be in [2, {len(names)}] for this scenario")
        if len(names) < 2:
            raise EmulatorProcessError(f"{scenario}: a scenario needs at least two nodes")
        self.names = names[: nodes or len(names)]
        self.base_port = base_port or random.Random(os.getpid()).randrange(20_000, 60_000, 100)
        self.startup_timeout_s = startup_timeout_s
        self.procs: dict[str, subprocess.Popen[str]] = {}
        self.namespaces = namespaces

    def start(self) -> ProcessMesh:
        start = time.monotonic()
        for i, name in enumerate(self.names):
            prefix = ["ip", "netns", "exec", self.namespaces[i]] if self.namespaces else []
            extra = ["--netns"] if self.namespaces else []
            self.procs[name] = subprocess.Popen(
                [
                    *prefix,
                    sys.executable,
                    "-m",
                    "ciuic_p2p.emulator.node",
                    "--scenario",
                    self.scenario_path,
                    "--name",
                    name,
                    "--base-port",
                    str(self.base_port),
                    "--start",
                    repr(start),
                    "--nodes",
                    str(len(self.names)),
                    *extra,
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
        try:
            for name, proc in self.procs.items():
                line = self._read_line(proc, self.startup_timeout_s)
                if line != f"ready {name}":
                    raise EmulatorProcessError(f"{name} did not start (said {line!r})")
        except BaseException:
            self.stop()
            raise
        return self

    def _read_line(self, proc: subprocess.Popen[str], timeout_s: float) -> str:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
        if not ready:
            raise EmulatorProcessError(f"process {proc.pid} said nothing in {timeout_s} s")
        return proc.stdout.readline().strip()

    def measure_rtts(self, pings: int = 5, timeout_s: float = 60.0) -> dict[str, dict[str, Any]]:
        """Each node pings every other; returns {node: {peer: median RTT or None}}."""
        for proc in self.procs.values():
            assert proc.stdin is not None
            proc.stdin.write(f"ping {pings}\n")
            proc.stdin.flush()
        out = {}
        for name, proc in self.procs.items():
            line = self._read_line(proc, timeout_s)
            if not line.startswith("rtt "):
                raise EmulatorProcessError(f"{name}: unexpected answer {line!r}")
            out[name] = json.loads(line[4:])
        return out

    def stop(self, grace_s: float = 5.0) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    stream.close()

    def __enter__(self) -> ProcessMesh:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
