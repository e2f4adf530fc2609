"""A local training cluster on the emulated WAN: one ``ciuic-node run`` daemon process
and one trainer process (lab.worker) per node, as in production, on loopback ports
shaped by a scenario's links (or on plain loopback, without a scenario). What
``ciuic-node demo``, bench/training.py and the training tests run.

Every process is started in its own session (a Ctrl+C in the terminal reaches only
the orchestrator, which then ends them in order) and ended by its PID: SIGTERM, then
SIGKILL after a grace period. Every wait is bounded.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import itertools
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

from ciuic_p2p.admission import ClusterCA, write_pem
from ciuic_p2p.daemon.control import ControlError, request
from ciuic_p2p.data import scenario_path
from ciuic_p2p.emulator.scenarios import load_scenario
from ciuic_p2p.errors import CiuicError
from ciuic_p2p.identity import NodeKey
from ciuic_p2p.lab import torchft_peer


class ClusterError(CiuicError):
    """A daemon or trainer of the local cluster failed or did not answer in time."""


def process_cpu_s(pid: int) -> float:
    """User plus system CPU seconds a process has used (Linux ``/proc``); 0 for one
    that has ended (a lane, say)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port_block(count: int) -> int:
    """A base port with ``count`` consecutive free UDP ports on loopback."""
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.bind(("127.0.0.1", 0))
            base = int(s.getsockname()[1])
        if base + count >= 65535:
            continue
        try:
            for port in range(base, base + count):
                with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise ClusterError("no block of free UDP ports on loopback")


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """Hold SIGINT and SIGTERM while processes are being ended (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def spread_nodes(scenario: str, count: int) -> list[str]:
    """``count`` nodes of a scenario as far apart as possible: start from the pair with
    the largest RTT, then add the node whose smallest RTT to those chosen is largest
    (greedy max-min)."""
    sc = load_scenario(scenario_path(scenario))
    names = sc.node_names()
    if not 2 <= count <= len(names):
        raise ClusterError(f"the scenario has {len(names)} nodes: ask for 2 to {len(names)}")
    a, b = max(
        ((x, y) for i, x in enumerate(names) for y in names[i + 1 :]),
        key=lambda p: sc.rtt_s(p[0], p[1]),
    )
    chosen = [a, b]
    while len(chosen) < count:
        rest = [n for n in names if n not in chosen]
        chosen.append(max(rest, key=lambda n: min(sc.rtt_s(n, c) for c in chosen)))
    return chosen


class JsonLines:
    """Read the JSON lines of several processes' stdout without blocking: each line
    comes back as (key, object); a closed pipe is dropped."""

    def __init__(self) -> None:
        self._sel = selectors.DefaultSelector()
        self._buffers: dict[int, bytes] = {}

    def add(self, key: Any, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        os.set_blocking(proc.stdout.fileno(), False)
        self._sel.register(proc.stdout, selectors.EVENT_READ, key)
        self._buffers[proc.stdout.fileno()] = b""

    def read(self, timeout_s: float) -> list[tuple[Any, dict[str, Any]]]:
        out: list[tuple[Any, dict[str, Any]]] = []
        for sk, _ in self._sel.select(timeout=timeout_s):
            fd = sk.fd
            chunk = sk.fileobj.read()  # type: ignore[union-attr]
            if not chunk:
                self._sel.unregister(sk.fileobj)
                sk.fileobj.close()  # type: ignore[union-attr]
                continue
            *lines, self._buffers[fd] = (self._buffers[fd] + chunk).split(b"\n")
            for line in lines:
                try:
                    obj = json.loads(line)
                except ValueError:
                    continue
                if isinstance(obj, dict):
                    out.append((sk.data, obj))
        return out

    def close(self) -> None:
        for sk in list(self._sel.get_map().values()):
            self._sel.unregister(sk.fileobj)
            sk.fileobj.close()  # type: ignore[union-attr]
        self._sel.close()


class LocalCluster:
    def __init__(
        self,
        scenario: str | None,
        names: list[str],
        workdir: Path,
        config_toml: str = "",
        rate_scale: float | None = None,
        loss: float | None = None,
        trainer_nice: int = 0,
    ) -> None:
        """``scenario`` None: plain loopback, no emulated WAN (``names`` as given).
        ``trainer_nice``: the trainers' CPU niceness (``nice -n``), above the daemons'."""
        self.scenario = None if scenario is None else str(scenario_path(scenario))
        self.trainer_nice = trainer_nice
        self.rate_scale = rate_scale
        self.loss = loss
        # Node i of the (subset) scenario listens on base + i, in the scenario's order.
        self.names = (
            list(names)
            if self.scenario is None
            else load_scenario(self.scenario).subset(names).node_names()
        )
        self.workdir = workdir
        self.config_path = workdir / "node.toml"
        self.config_toml = config_toml
        self.daemons: dict[str, subprocess.Popen[bytes]] = {}
        self.trainers: list[subprocess.Popen[bytes]] = []
        self._trainers_of: dict[str, list[subprocess.Popen[bytes]]] = {}
        self.base_port = 0
        self.ca: ClusterCA | None = None
        """The cluster's CA once started (a benchmark may issue more credentials)."""
        self._t0 = 0.0

    def state_dir(self, name: str) -> Path:
        return self.workdir / "nodes" / name

    def trainer_socket(self, name: str) -> Path:
        return self.state_dir(name) / "trainer.sock"

    def control(self, name: str) -> Path:
        return self.state_dir(name) / "control.sock"

    # -- daemons -------------------------------------------------------------------------

    def start(self, timeout_s: float = 60.0) -> float:
        """Start every daemon and join them into one mesh; seconds it took."""
        t0 = time.monotonic()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(self.config_toml)
        now = dt.datetime.now(dt.UTC)
        ca = self.ca = ClusterCA.create("ciuic-demo", now)
        self.base_port = free_port_block(len(self.names))
        self._t0 = t0
        for name in self.names:
            d = self.state_dir(name)
            d.mkdir(parents=True, exist_ok=True)
            key = NodeKey.generate()
            key.save(d / "node.key")
            write_pem(d / "node.pem", ca.issue(key.public_key, now))
            write_pem(d / "ca.pem", ca.certificate)
            self._spawn_daemon(name)
        deadline = t0 + timeout_s
        for name in self.names:
            self._until(functools.partial(self._answers, name), deadline, f"{name} started")
        seed = f"127.0.0.1:{self.base_port}"
        for name in self.names[1:]:
            answer = request(self.control(name), {"cmd": "join", "address": seed}, timeout_s=30)
            if not answer.get("ok"):
                raise ClusterError(f"{name} could not join: {answer.get('error')}")
        self._until(self._formed, deadline, "the mesh to form")
        return time.monotonic() - t0

    def _spawn_daemon(self, name: str) -> None:
        i = self.names.index(name)
        d = self.state_dir(name)
        cmd = [
            sys.executable, "-m", "ciuic_p2p.cli", "run",
            "--config", str(self.config_path),
            "--state-dir", str(d),
            "--name", name,
            "--region", name,
            "--listen", f"127.0.0.1:{self.base_port + i}",
            "--control", str(self.control(name)),
            "--trainer-socket", str(self.trainer_socket(name)),
        ]  # fmt: skip
        if self.scenario is not None:
            cmd += [
                "--emulate", self.scenario,
                "--emulate-node", name,
                "--emulate-nodes", ",".join(self.names),
                "--emulate-ports", str(self.base_port),
                "--emulate-start", repr(self._t0),
            ]  # fmt: skip
            if self.rate_scale:
                cmd += ["--emulate-rate-scale", repr(self.rate_scale)]
            if self.loss is not None:
                cmd += ["--emulate-loss", repr(self.loss)]
        # Each daemon's status page on a port of its own (status shows the URL).
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "CIUIC_WEB_PORT": "0"}
        with (d / "daemon.log").open("ab") as log:
            self.daemons[name] = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def kill(self, name: str) -> None:
        """SIGKILL the node's daemon and the trainers started on it (a crash)."""
        procs = [self.daemons[name], *self._trainers_of.pop(name, [])]
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(OSError):
                    proc.kill()
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
            if proc in self.trainers:
                self.trainers.remove(proc)

    def stop_daemon(self, name: str, grace_s: float = 30.0) -> int:
        """SIGTERM the node's daemon alone, as ``systemctl stop`` does, its trainers
        left running; its exit status."""
        proc = self.daemons[name]
        with contextlib.suppress(OSError):
            proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait(10)

    def restart(self, name: str, timeout_s: float = 60.0) -> float:
        """Start the node's daemon again (same key and state: a higher incarnation) and
        join it through another live member; seconds it took."""
        t0 = time.monotonic()
        self._spawn_daemon(name)
        deadline = t0 + timeout_s
        self._until(functools.partial(self._answers, name), deadline, f"{name} restarted")
        seed = next(n for n in self.names if n != name and self.daemons[n].poll() is None)
        address = f"127.0.0.1:{self.base_port + self.names.index(seed)}"
        answer = request(self.control(name), {"cmd": "join", "address": address}, timeout_s=30)
        if not answer.get("ok"):
            raise ClusterError(f"{name} could not rejoin: {answer.get('error')}")
        return time.monotonic() - t0

    def _nice(self) -> list[str]:
        return ["nice", "-n", str(self.trainer_nice)] if self.trainer_nice else []

    def spawn_trainer(
        self, name: str, rank: int, args: list[str], out: Path
    ) -> subprocess.Popen[bytes]:
        """One async trainer process on ``name``'s daemon (worker arguments ``args``),
        its JSON lines on stdout; ended by :meth:`kill` or :meth:`stop`."""
        cmd = [
            *self._nice(), sys.executable, "-m", "ciuic_p2p.lab.worker", "--mode", "async",
            "--rank", str(rank), "--socket", str(self.trainer_socket(name)),
            "--config", str(self.config_path), "--out", str(out), *args,
        ]  # fmt: skip
        out.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        with (out / f"trainer-{rank}.log").open("ab") as err:
            proc = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=err, env=env, start_new_session=True
            )
        self.trainers.append(proc)
        self._trainers_of.setdefault(name, []).append(proc)
        return proc

    def _status(self, name: str) -> dict[str, Any] | None:
        proc = self.daemons[name]
        if proc.poll() is not None:
            log = (self.state_dir(name) / "daemon.log").read_text(errors="replace")
            raise ClusterError(f"daemon {name} exited {proc.returncode}: {log[-1500:]}")
        try:
            answer = request(self.control(name), {"cmd": "status"}, timeout_s=5)
        except ControlError:
            return None
        return answer if answer.get("ok") else None

    def _answers(self, name: str) -> bool:
        return self._status(name) is not None

    def _formed(self) -> bool:
        for name in self.names:
            status = self._status(name)
            if status is None or status["alive"] != len(self.names):
                return False
        return True

    def status(self) -> dict[str, dict[str, Any] | None]:
        return {name: self._status(name) for name in self.names}

    @staticmethod
    def _until(cond: Callable[[], bool], deadline: float, what: str) -> None:
        while not cond():
            if time.monotonic() > deadline:
                raise ClusterError(f"timed out waiting for {what}")
            time.sleep(0.05)

    def ring_order(self) -> list[str]:
        """The ring with the least total RTT (every ordering for up to 8 nodes)."""
        first, rest = self.names[0], self.names[1:]
        if len(rest) > 7 or self.scenario is None:
            return self.names
        sc = load_scenario(self.scenario).subset(self.names)
        best = min(
            itertools.permutations(rest),
            key=lambda p: sum(sc.rtt_s(a, b) for a, b in itertools.pairwise([first, *p, first])),
        )
        return [first, *best]

    def ring_peers(self) -> list[str]:
        peers = []
        for name in self.ring_order():
            status = self._status(name)
            if status is None:
                raise ClusterError(f"daemon {name} does not answer")
            peers.append(str(status["peer"]))
        return peers

    # -- trainers ------------------------------------------------------------------------

    def train(
        self,
        mode: str,
        task: str,
        steps: int,
        seed: int,
        out: Path,
        on_progress: Callable[[str, dict[str, Any]], None] | None = None,
        timeout_s: float = 1800.0,
        evals: int = 20,
        time_limit_s: float = 0.0,
        step_s: float = 0.0,
        env: dict[str, str] | None = None,
        inner_steps: int = 1,
        lr_scale: float = 1.0,
    ) -> list[dict[str, Any]]:
        """Run one trainer per node (``single`` and ``ddp``: one trainer, no daemon;
        ``torchft``: torchft's DiLoCo at ``inner_steps``, one replica per node, in a
        loopback-only namespace of its own, ciuic_p2p.lab.torchft_peer); the results in
        node order. ``step_s``: pad each step to this accelerator time; ``env``: more
        variables for the trainers (``CIUIC_TRAIN_MODE=outer``: their config over the
        nodes' file); ``lr_scale``: times the task's learning rate, in every mode."""
        names = self.names[:1] if mode in ("single", "ddp", "torchft") else self.names
        world = len(self.names) if mode in ("ddp", "torchft") else len(names)
        run = f"{mode}-{task}-{seed}-{time.time_ns()}"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
        procs: dict[int, tuple[str, subprocess.Popen[bytes]]] = {}
        sel = selectors.DefaultSelector()
        for rank, name in enumerate(names):
            cmd = [
                *self._nice(), sys.executable, "-m", "ciuic_p2p.lab.worker",
                "--mode", mode, "--task", task, "--steps", str(steps), "--seed", str(seed),
                "--lr-scale", repr(lr_scale),
                "--rank", str(rank), "--world", str(world), "--run", run,
                "--config", str(self.config_path), "--out", str(out), "--evals", str(evals),
                "--step-s", repr(step_s),
            ]  # fmt: skip
            if mode == "torchft":  # the launcher starts the world's replicas itself
                # Its own deadline first, so that it ends its replicas before ours ends it.
                cmd = [*self._nice(), *torchft_peer.command([
                    "--world", str(world), "--inner-steps", str(inner_steps),
                    "--out", str(out), "--timeout-s", repr(max(30.0, timeout_s - 90)),
                    *cmd[cmd.index("--task"):cmd.index("--rank")], "--evals", str(evals),
                    "--step-s", repr(step_s),
                ])]  # fmt: skip
            elif mode not in ("single", "ddp"):
                cmd += ["--socket", str(self.trainer_socket(name))]
            if mode == "dense":
                cmd += ["--ring", ",".join(self.ring_peers())]
                cmd += ["--time-limit-s", repr(time_limit_s)]
            out.mkdir(parents=True, exist_ok=True)
            with (out / f"trainer-{rank}.log").open("ab") as err:
                proc = subprocess.Popen(
                    cmd, stdout=subprocess.PIPE, stderr=err, env=env, start_new_session=True
                )
            self.trainers.append(proc)
            procs[rank] = (name, proc)
            assert proc.stdout is not None
            os.set_blocking(proc.stdout.fileno(), False)
            sel.register(proc.stdout, selectors.EVENT_READ, rank)
        try:
            self._read_progress(procs, sel, mode, out, timeout_s, on_progress)
        finally:  # on every path: no pipe left open
            sel.close()
            for _, proc in procs.values():
                if proc.stdout is not None:
                    proc.stdout.close()
        codes = {rank: proc.wait(60) for rank, (_, proc) in procs.items()}
        for _, proc in procs.values():
            self.trainers.remove(proc)
        results = []
        ranks = range(world) if mode == "torchft" else procs
        for rank in ranks:
            name = self.names[rank]
            code = codes.get(rank, codes[0])
            path = out / f"result-{rank}.json"
            if code != 0 or not path.exists():
                log = (out / f"trainer-{rank}.log").read_text(errors="replace")
                raise ClusterError(f"{mode} trainer on {name} exited {code}: {log[-2000:]}")
            result = json.loads(path.read_text())
            result["node"] = name
            results.append(result)
        return results

    @staticmethod
    def _read_progress(
        procs: dict[int, tuple[str, subprocess.Popen[bytes]]],
        sel: selectors.BaseSelector,
        mode: str,
        out: Path,
        timeout_s: float,
        on_progress: Callable[[str, dict[str, Any]], None] | None,
    ) -> None:
        """Read the trainers' JSON lines until every pipe closes; raise as soon as one
        trainer fails or the time is up."""
        buffers = {rank: b"" for rank in procs}
        deadline = time.monotonic() + timeout_s
        open_pipes = len(procs)
        while open_pipes:
            if time.monotonic() > deadline:
                raise ClusterError(f"{mode} training did not finish within {timeout_s:g} s")
            for rank, (name, proc) in procs.items():
                if proc.poll() not in (None, 0):  # one failed: do not wait out the others
                    log = (out / f"trainer-{rank}.log").read_text(errors="replace")
                    raise ClusterError(
                        f"{mode} trainer on {name} exited {proc.returncode}: {log[-2000:]}"
                    )
            for key, _ in sel.select(timeout=0.5):
                rank = int(key.data)
                chunk = key.fileobj.read()  # type: ignore[union-attr]
                if not chunk:
                    sel.unregister(key.fileobj)
                    open_pipes -= 1
                    continue
                buffers[rank] += chunk
                *lines, buffers[rank] = buffers[rank].split(b"\n")
                for line in lines:
                    try:
                        obj = json.loads(line)
                    except ValueError:
                        continue
                    if on_progress is not None and isinstance(obj, dict):
                        on_progress(procs[rank][0], obj)

    # -- teardown ------------------------------------------------------------------------

    def stop(self, grace_s: float = 10.0) -> None:
        """End every process started here, by PID: SIGTERM, then SIGKILL. Survives a
        second Ctrl+C and errors: each process is seen to, whatever happens to one."""
        procs = list(self.trainers) + list(self.daemons.values())
        with _signals_deferred():
            for proc in procs:
                if proc.poll() is None:
                    with contextlib.suppress(OSError):
                        proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            for proc in procs:
                try:
                    proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(OSError):
                        proc.kill()
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(5)
        # A caller's reader may have left early (a failed wait): its pipes close here,
        # or a later test's garbage collection reports them as leaked.
        for proc in procs:
            for pipe in (proc.stdout, proc.stderr):
                if pipe is not None:
                    with contextlib.suppress(OSError):
                        pipe.close()
        self.trainers.clear()

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
