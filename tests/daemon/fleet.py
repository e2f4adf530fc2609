"""Daemons as processes (`ciuic-node run`), each with its own state directory and
credentials from one throwaway cluster CA. Only processes the test started are ever
signalled, by PID."""

from __future__ import annotations

import datetime as dt
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ciuic_p2p.admission import ClusterCA, write_pem
from ciuic_p2p.daemon.control import ControlError, request
from ciuic_p2p.identity import NodeKey
from ciuic_p2p.lab.cluster import free_port_block

__all__ = ["NOW", "Fleet", "free_port_block"]

NOW = dt.datetime.now(dt.UTC)


class Fleet:
    """Daemon processes of one cluster."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.ca = ClusterCA.create("test-fleet", NOW)
        self.procs: dict[str, subprocess.Popen[str]] = {}
        self.logs: dict[str, Path] = {}

    def state_dir(self, name: str, ca: ClusterCA | None = None) -> Path:
        d = self.root / name
        if not (d / "node.key").exists():
            d.mkdir(parents=True, exist_ok=True)
            key = NodeKey.generate()
            key.save(d / "node.key")
            issuer = ca or self.ca
            write_pem(d / "node.pem", issuer.issue(key.public_key, NOW))
            write_pem(d / "ca.pem", issuer.certificate)  # another cluster: its own CA
        return d

    def control(self, name: str) -> Path:
        return self.root / name / "control.sock"

    def start(self, name: str, *args: str, env: dict[str, str] | None = None) -> None:
        d = self.state_dir(name)
        log = d / "daemon.log"
        self.logs[name] = log
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "CIUIC_WEB_PORT": "0", **(env or {})}
        with log.open("a") as out:
            self.procs[name] = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "ciuic_p2p.cli",
                    "run",
                    "--state-dir",
                    str(d),
                    "--name",
                    name,
                    "--trainer-socket",
                    str(d / "trainer.sock"),
                    *args,
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                text=True,
                env=env,
            )

    def status(self, name: str) -> dict[str, Any] | None:
        try:
            answer = request(self.control(name), {"cmd": "status"}, timeout_s=5)
        except ControlError:
            return None
        return answer if answer.get("ok") else None

    def wait(self, condition: Any, timeout_s: float, what: str) -> float:
        t0 = time.monotonic()
        while not condition():
            for name, proc in self.procs.items():
                if proc.poll() is not None and proc.returncode not in (0, -signal.SIGKILL):
                    raise AssertionError(
                        f"{name} exited {proc.returncode}: {self.logs[name].read_text()[-2000:]}"
                    )
            if time.monotonic() - t0 > timeout_s:
                raise AssertionError(f"{what}: not within {timeout_s} s")
            time.sleep(0.1)
        return time.monotonic() - t0

    def kill(self, name: str) -> None:
        proc = self.procs[name]
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
