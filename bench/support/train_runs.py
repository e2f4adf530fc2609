"""bench/compare.py's workload 2: the digits task trained by DDP over gloo, by
hivemind.Optimizer and by ciuic-p2p, WORLD peers on loopback, the same model, data
shards, batch size, seeds and number of global steps (WORLD x 256 samples each).

Each run: the mean final evaluation loss and accuracy over the peers, samples per
second (every peer's samples over the wall time from the go to the last peer done),
and bytes per sample (every payload byte the peers' sockets sent over those samples:
TCP ``bytes_sent`` for DDP and hivemind, the daemons' UDP payload bytes for ciuic).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from ciuic_p2p.lab.cluster import LocalCluster
from ciuic_p2p.lab.demo import DEMO_CONFIG
from support.compare_meter import cpu_seconds, tree_pids
from support.peerproc import Peer, all_expect, free_tcp_port, go_and_measure

TRAIN_SCRIPT = Path(__file__).resolve().parent / "compare_train.py"
BATCH = 256  # DigitsTask.batch_size


def _measured(peers: list[Peer], timeout_s: float) -> dict[str, Any]:
    done, wall, cpu, sent = go_and_measure(peers, timeout_s)
    samples = sum(int(d["samples"]) for d in done)
    row: dict[str, Any] = {
        "loss": statistics.fmean(float(d["loss"]) for d in done),
        "loss_max": max(float(d["loss"]) for d in done),
        "accuracy": statistics.fmean(float(d["accuracy"]) for d in done),
        "wall_s": wall,
        "samples": samples,
        "samples_per_s": samples / wall,
        "bytes": sent,
        "bytes_per_sample": sent / samples,
        "cpu_s": cpu,
    }
    if "epoch" in done[0]:
        row["epochs"] = min(int(d["epoch"]) for d in done)
    return row


def run_ddp(world: int, steps: int, seed: int, work: Path) -> dict[str, Any]:
    args = [str(world), str(free_tcp_port()), str(steps), str(seed)]
    peers = [
        Peer(["ddp", str(r), *args], work / f"ddp-{r}.log", TRAIN_SCRIPT) for r in range(world)
    ]
    try:
        all_expect(peers, "ready", 300)
        return _measured(peers, 1800)
    finally:
        for p in peers:
            p.close()


def run_hivemind(world: int, steps: int, seed: int, work: Path) -> dict[str, Any]:
    def args(r: int, initial: list[str]) -> list[str]:
        return ["hivemind", str(r), str(world), str(steps), str(seed), *initial]

    first = Peer(args(0, []), work / "hivemind-0.log", TRAIN_SCRIPT)
    peers = [first]
    try:
        maddrs = first.expect("addr", 120)["maddrs"]
        peers += [
            Peer(args(r, maddrs), work / f"hivemind-{r}.log", TRAIN_SCRIPT) for r in range(1, world)
        ]
        all_expect(peers, "ready", 300)
        row = _measured(peers, 3600)
    finally:
        for p in peers:
            p.close()
    logs = [(work / f"hivemind-{r}.log").read_text(errors="replace") for r in range(world)]
    # Mentions in the peers' logs: about two per failed round (the error line and
    # its traceback's last line).
    row["averaging_failures"] = sum(log.count("could not find a group") for log in logs)
    return row


def run_ciuic(
    world: int, steps: int, seed: int, work: Path, density: float = 0.01
) -> dict[str, Any]:
    """Real daemons (QUIC) and trainer processes, as in production, on plain loopback;
    the config of bench/training.py (1% density, a send every 2 steps, bound 64)."""
    config = DEMO_CONFIG.format(density=density, send_interval=2, max_interval=16, bound=64)
    names = [f"n{i}" for i in range(world)]
    with LocalCluster(None, names, work / "ciuic", config) as cluster:
        cluster.start()
        daemons = tree_pids(p.pid for p in cluster.daemons.values())
        cpu0 = cpu_seconds(daemons)
        t0 = time.monotonic()
        results = cluster.train("async", "digits", steps, seed, work / "ciuic-run", evals=2)
        elapsed = time.monotonic() - t0
        daemon_cpu = cpu_seconds(daemons) - cpu0
    samples = world * steps * BATCH
    sent = sum(int(r["udp_bytes_sent"]) for r in results)
    # The trainers' own clocks, from the first step until every chunk of every peer
    # is applied (finish): the others' go-to-done span, without the processes' start
    # and the mesh join (evaluations taken out).
    wall = max(float(r["wall_s"]) + float(r["finish_s"]) for r in results)
    return {
        "loss": statistics.fmean(float(r["eval_loss"]) for r in results),
        "accuracy": statistics.fmean(float(r["accuracy"]) for r in results),
        "wall_s": wall,
        "samples": samples,
        "samples_per_s": samples / wall,
        "bytes": sent,
        "bytes_per_sample": sent / samples,
        "daemon_cpu_s": daemon_cpu,
        "elapsed_with_start_s": elapsed,
        "staleness_p99": max(int(r["sync"]["staleness_p99"]) for r in results),
    }


def run_ciuic_10pct(world: int, steps: int, seed: int, work: Path) -> dict[str, Any]:
    """ciuic at 10% density: what the loss costs in bytes."""
    return run_ciuic(world, steps, seed, work, density=0.1)


SYSTEMS = {
    "ddp": run_ddp,
    "hivemind": run_hivemind,
    "ciuic": run_ciuic,
    "ciuic_10pct": run_ciuic_10pct,
}
