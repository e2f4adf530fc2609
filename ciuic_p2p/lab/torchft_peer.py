"""torchft's DiLoCo as a real baseline peer: N replica processes, each with torchft's
``Manager`` and ``DiLoCo`` over a Gloo process group, and one torchft lighthouse, all
inside a network namespace of their own that holds only a loopback interface.

Why a namespace: torchft's manager binds ``[::]:port`` (every interface, not
configurable), and the project's tests and benchmarks may listen on loopback only. In
a fresh namespace every interface is loopback, and ``/proc/net/dev`` counts exactly the
bytes this baseline put on the wire (Gloo's all-reduces, the quorum RPCs, the
heartbeats), which is what its bytes per step report. Its links are not the emulated
WAN: its loss and bytes compare, its time does not.

    python -m ciuic_p2p.lab.torchft_peer --world 4 --task digits --steps 150 \\
        --inner-steps 5 --out runs/tft     # run under `unshare -n` (see command())

The replicas are ``python -m ciuic_p2p.lab.worker --mode torchft``: the same task,
model, batches, inner optimizer and learning-rate schedule as every other mode.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import time
from datetime import timedelta
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as installed_version
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

DILOCO_OUTER = {"outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": True}
"""DiLoCo's outer SGD (Douillard et al. 2023), as the bench's own DiLoCo mode uses."""


def available() -> str | None:
    """Why this baseline cannot run here, or None when it can."""
    if importlib.util.find_spec("torchft") is None:
        return "torchft is not installed (pip install 'ciuic-p2p[baselines]')"
    try:  # the compiled part (lighthouse, manager server): a broken install fails here
        importlib.import_module("torchft._torchft")
    except ImportError as exc:
        return f"torchft does not load: {exc}"
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return "needs unshare(1) and ip(8) for a loopback-only network namespace"
    probe = subprocess.run(["unshare", "-n", "true"], capture_output=True, check=False, timeout=10)
    if probe.returncode != 0:
        return f"cannot create a network namespace: {probe.stderr.decode().strip()[:200]}"
    return None


def version() -> str | None:
    """The installed torchft's version, or None."""
    try:
        return installed_version("torchft")
    except PackageNotFoundError:
        return None


def command(args: list[str]) -> list[str]:
    """The launcher's command line, inside a fresh network namespace."""
    return ["unshare", "-n", sys.executable, "-m", "ciuic_p2p.lab.torchft_peer", *args]


def loopback_tx_bytes() -> int:
    """Bytes sent on this namespace's loopback (``/proc/net/dev`` is per namespace)."""
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name.strip() == "lo":
            return int(rest.split()[8])
    raise RuntimeError("no loopback interface in /proc/net/dev")


class Replica:
    """One replica's torchft parts (used by ``ciuic_p2p.lab.worker --mode torchft``):
    its own store, a Gloo process group, the manager and DiLoCo's optimizer hooks."""

    def __init__(
        self,
        model: torch.nn.Module,
        inner: torch.optim.Optimizer,
        *,
        replica: int,
        world: int,
        lighthouse: str,
        inner_steps: int,
    ) -> None:
        # torchft is optional (the `baselines` extra), and this module is imported by
        # the cluster, which must not need torch: both load only when a replica starts.
        import torch  # noqa: PLC0415
        from torch.distributed import TCPStore  # type: ignore[attr-defined]  # noqa: PLC0415
        from torchft import Manager, ProcessGroupGloo  # noqa: PLC0415
        from torchft.local_sgd import DiLoCo  # noqa: PLC0415

        self.model, self.inner = model, inner
        timeout = timedelta(seconds=60)
        # One replica group of one rank: the group's store is this process's own.
        self.store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout),
            load_state_dict=self._load,
            state_dict=self._state,
            min_replica_size=world,
            use_async_quorum=False,
            replica_id=f"replica{replica}",
            store_addr="127.0.0.1",
            store_port=self.store.port,
            rank=0,
            world_size=1,
            lighthouse_addr=lighthouse,
            hostname="127.0.0.1",
            timeout=timeout,
            quorum_timeout=timeout,
            connect_timeout=timeout,
            # Every replica starts from the same seeded model. With init_sync the first
            # quorum (at step H) heals the others from one replica, its inner state
            # and its first round's progress included, so the first round would
            # average one replica's work instead of all of them.
            init_sync=False,
        )
        self.outer = torch.optim.SGD(
            model.parameters(),
            lr=DILOCO_OUTER["outer_lr"],
            momentum=DILOCO_OUTER["outer_momentum"],
            nesterov=True,
        )
        self.diloco = DiLoCo(
            self.manager,
            [model],
            inner,
            self.outer,
            sync_every=inner_steps,
            backup_device=torch.device("cpu"),
            pin_memory=False,
        )
        self.inner_done_at = 0.0
        """When the last inner step ended: what DiLoCo's hook (the round's all-reduce and
        outer step) then spends is the trainer's wait, not compute."""
        # Post hooks run in the order registered: this one before DiLoCo's.
        self._timer = inner.register_step_post_hook(self._inner_done)
        self.diloco.__enter__()  # its hooks on the inner optimizer's step

    def _inner_done(self, *_: Any) -> None:
        self.inner_done_at = time.perf_counter()

    def _state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "inner": self.inner.state_dict()}

    def _load(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.inner.load_state_dict(state["inner"])

    @property
    def rounds(self) -> int:
        """Outer steps committed (the manager's step)."""
        return int(self.manager.current_step())

    def close(self) -> None:
        self.diloco.__exit__(None, None, None)
        self._timer.remove()
        self.manager.shutdown(wait=False)


def _relay(procs: list[subprocess.Popen[bytes]], deadline: float) -> None:
    """Copy the replicas' JSON lines to stdout (the cluster reads progress from it)."""
    sel = selectors.DefaultSelector()
    for p in procs:
        assert p.stdout is not None
        os.set_blocking(p.stdout.fileno(), False)
        sel.register(p.stdout, selectors.EVENT_READ)
    buffers: dict[Any, bytes] = {}
    open_pipes = len(procs)
    while open_pipes and time.monotonic() < deadline:
        if any(p.poll() not in (None, 0) for p in procs):
            break
        for key, _ in sel.select(timeout=0.5):
            data = key.fileobj.read()  # type: ignore[union-attr]
            if not data:
                sel.unregister(key.fileobj)
                open_pipes -= 1
                continue
            *lines, buffers[key.fileobj] = (buffers.get(key.fileobj, b"") + data).split(b"\n")
            for line in lines:
                sys.stdout.buffer.write(line + b"\n")
            sys.stdout.flush()
    sel.close()


def _terminated(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ciuic_p2p.lab.torchft_peer")
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--inner-steps", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--timeout-s", type=float, default=1800.0)
    args, worker_args = p.parse_known_args(argv)
    # Ended by its caller (LocalCluster.stop, a test's timeout): SIGTERM unwinds, so the
    # finally below ends the replicas instead of leaving them in the namespace.
    signal.signal(signal.SIGTERM, _terminated)
    from torchft._torchft import LighthouseServer  # noqa: PLC0415  (optional, see Replica)

    subprocess.run(["ip", "link", "set", "lo", "up"], check=True, timeout=10)
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=args.world)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tx0 = loopback_tx_bytes()
    procs = []
    for rank in range(args.world):
        cmd = [
            sys.executable, "-m", "ciuic_p2p.lab.worker", "--mode", "torchft",
            "--rank", str(rank), "--world", str(args.world), "--out", str(out),
            "--lighthouse", lighthouse.address(), "--inner-steps", str(args.inner_steps),
            *worker_args,
        ]  # fmt: skip
        with (out / f"trainer-{rank}.log").open("ab") as err:
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err))
    codes = [1] * len(procs)
    try:
        _relay(procs, time.monotonic() + args.timeout_s)
        for i, proc in enumerate(procs):
            with contextlib.suppress(subprocess.TimeoutExpired):
                codes[i] = proc.wait(60)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(10)
        lighthouse.shutdown()
    sent = loopback_tx_bytes() - tx0
    for rank in range(args.world):  # every byte on the wire, shared out per replica
        path = out / f"result-{rank}.json"
        if not path.exists():
            continue
        result = json.loads(path.read_text())
        result["udp_bytes_sent"] = sent / args.world  # TCP here: the key the others use
        result["wire_bytes_sent"] = sent / args.world
        result["bytes_per_step"] = sent / args.world / max(1, result["steps"])
        path.write_text(json.dumps(result))
    return max(codes)


if __name__ == "__main__":
    sys.exit(main())
