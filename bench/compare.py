#!/usr/bin/env python3
"""ciuic-p2p beside hivemind and torch.distributed: one synchronization round on
loopback among 4 peers of an ``--elements`` fp32 update (default 10M), N(0, 1) per
peer, seeded.

- ``gloo``: torch.distributed all-reduce (gloo), dense fp32, divided by 4;
- ``hivemind_none`` / ``_fp16`` / ``_u8``: hivemind's DecentralizedAverager (group of
  4, min_matchmaking_time 5 s, ended early once the group is full) with
  NoCompression, Float16Compression, Uniform8BitQuantization;
- ``ciuic_1pct`` / ``ciuic_01pct``: each peer encodes its update with the codec
  (top-k at 1% / 0.1%, INT8 values, error feedback), broadcasts the chunks through
  four real daemons (QUIC, membership, routing), and every peer applies every peer's
  chunks; the result is the mean of the applied updates.

Every system first runs one warm-up round of the same size (connections, DHT keys),
then the measured round. Wall time: from the driver's go to the last peer holding
the result. gloo and hivemind run one process per peer; bytes are the TCP payload
bytes (``bytes_sent`` of tcp_info, read with ``ss``) of every socket of the peers'
process trees, CPU the tree's user + system time (bench/support/compare_meter.py).
ciuic runs its four daemons in one process (so its four encodes run one after the
other): bytes are the daemons' UDP payload bytes sent, CPU the process's time.
Error: relative L2 error of each peer's result against the exact mean (the largest
over peers); for ciuic also over ``--rounds`` rounds with error feedback: the sum of
the applied means against the sum of the exact means.

Runs in the environment ``make bench-deps`` builds:

    .venv-bench/bin/python bench/compare.py --json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from support import plots, train_runs, wan_runs
from support.compare_peers import PEERS, exact_mean, rel_error
from support.peerproc import Peer, all_expect, free_tcp_port, go_and_measure

SYSTEMS = ("gloo", "hivemind_none", "hivemind_fp16", "hivemind_u8", "ciuic_1pct", "ciuic_01pct")


def measured_round(peers: list[Peer], elements: int, work: Path) -> dict[str, Any]:
    """go → every peer done: wall, CPU and socket bytes of the peers' trees; then the
    results are saved and compared with the exact mean."""
    done, wall, cpu, sent = go_and_measure(peers, 300)
    for p in peers:
        p.send("save")
    all_expect(peers, "saved", 120)
    exact = exact_mean(elements)
    errors = [
        rel_error(torch.from_numpy(np.fromfile(work / f"out{r}.f32", dtype=np.float32)), exact)
        for r in range(PEERS)
    ]
    row = {"round_s": wall, "round_bytes": sent, "cpu_s": cpu, "error": max(errors)}
    if "group" in done[0]:
        row["group_size"] = min(d["group"] for d in done)
    return row


def run_gloo(elements: int, work: Path) -> dict[str, Any]:
    port = free_tcp_port()
    peers = [
        Peer(
            ["gloo", str(r), str(elements), str(port), str(work / f"out{r}.f32")], work / f"{r}.log"
        )
        for r in range(PEERS)
    ]
    try:
        all_expect(peers, "ready", 300)
        return measured_round(peers, elements, work)
    finally:
        for p in peers:
            p.close()


def run_hivemind(elements: int, compression: str, work: Path) -> dict[str, Any]:
    def args(r: int, initial: list[str]) -> list[str]:
        return ["hivemind", str(r), str(elements), compression, str(work / f"out{r}.f32"), *initial]

    first = Peer(args(0, []), work / "0.log")
    peers = [first]
    try:
        maddrs = first.expect("addr", 120)["maddrs"]
        peers += [Peer(args(r, maddrs), work / f"{r}.log") for r in range(1, PEERS)]
        all_expect(peers[1:], "addr", 120)
        time.sleep(2.0)  # averagers started and DHTs joined
        for p in peers:
            p.send("warm")
        all_expect(peers, "ready", 300)
        return measured_round(peers, elements, work)
    finally:
        for p in peers:
            p.close()


def run_ciuic(elements: int, density: float, rounds: int, work: Path) -> dict[str, Any]:
    peer = Peer(["ciuic", "0", str(elements), str(density), str(rounds)], work / "0.log")
    try:
        res = peer.expect("result", 600 + 60 * rounds)
    finally:
        peer.close()
    first, rows = res["rounds"][0], res["rounds"]
    return {
        "round_s": first["wall"],
        "round_bytes": first["bytes"],
        "cpu_s": first["cpu"],
        "error": res["error"],
        f"ef{rounds}_error": res["ef_error"],
        "encode_s": first["encode"],
        "chunk_bytes": first["chunk"],
        "daemon_counters": first["counters"],
        "round_s_mean": sum(r["wall"] for r in rows) / len(rows),
        "round_bytes_mean": sum(r["bytes"] for r in rows) / len(rows),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--elements", type=int, default=10_000_000)
    ap.add_argument("--rounds", type=int, default=20, help="ciuic rounds with error feedback")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset")
    ap.add_argument(
        "--workloads",
        default="round,train",
        help="comma-separated: round (workload 1), train (workload 2), wan (workload 3)",
    )
    ap.add_argument("--train-peers", default="2,4", help="workload 2: peer counts")
    ap.add_argument(
        "--train-steps",
        type=int,
        default=60,
        help="workload 2: global steps (hivemind takes about 7 s each on 2 cores)",
    )
    ap.add_argument("--train-seed", type=int, default=0)
    ap.add_argument(
        "--train-systems", default=",".join(train_runs.SYSTEMS), help="workload 2 subset"
    )
    ap.add_argument("--wan-scenarios", default="cities11,multicloud8", help="workload 3")
    ap.add_argument("--wan-seeds", type=int, default=1, help="workload 3: seeds per scenario")
    ap.add_argument("--wan-steps", type=int, default=150, help="workload 3: steps per node")
    ap.add_argument("--plots", help="workload 2 and 3: write PNG plots into this directory")
    ap.add_argument("--json", action="store_true", help="print one JSON object last")
    args = ap.parse_args()
    workloads = args.workloads.split(",")
    systems = args.systems.split(",") if "round" in workloads else []
    train_systems = args.train_systems.split(",") if "train" in workloads else []
    wanted_hivemind = any(s.startswith("hivemind") for s in [*systems, *train_systems])
    if wanted_hivemind and not importlib.util.find_spec("hivemind"):
        print(f"hivemind is not installed for {sys.executable}: run make bench-deps", flush=True)
        return 2
    result: dict[str, Any] = {
        "workload": "one round, 4 peers on loopback, fp32 update",
        "elements": args.elements,
        "peers": PEERS,
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "torch": torch.__version__,
        "bytes_method": "gloo/hivemind: tcp_info bytes_sent of the peers' sockets (ss); "
        "ciuic: daemons' UDP payload bytes",
    }
    if importlib.util.find_spec("hivemind"):
        result["hivemind"] = importlib.import_module("hivemind").__version__
    rows: dict[str, dict[str, Any]] = {}
    for name in systems:
        with tempfile.TemporaryDirectory(prefix=f"compare-{name}-") as tmp:
            work = Path(tmp)
            t0 = time.monotonic()
            try:
                if name == "gloo":
                    row = run_gloo(args.elements, work)
                elif name.startswith("hivemind_"):
                    row = run_hivemind(args.elements, name.removeprefix("hivemind_"), work)
                elif name in ("ciuic_1pct", "ciuic_01pct"):
                    density = 0.01 if name == "ciuic_1pct" else 0.001
                    row = run_ciuic(args.elements, density, args.rounds, work)
                else:
                    ap.error(f"--systems: unknown {name!r}")
            except (RuntimeError, TimeoutError) as exc:
                logs = "".join(p.read_text()[-1500:] for p in sorted(work.glob("*.log")))
                print(f"{name}: FAILED: {exc}\n{logs}", file=sys.stderr, flush=True)
                row = {"failed": str(exc)}
            print(f"{name}: {json.dumps(row)} ({time.monotonic() - t0:.0f} s)", flush=True)
        rows[name] = row
        for key, value in row.items():
            result[f"{name}_{key}"] = value
    if rows:
        print_table(rows, args.elements, args.rounds)
    if train_systems:
        result.update(workload_train(args, train_systems))
    if "wan" in workloads:
        result.update(
            wan_runs.workload_wan(args.wan_scenarios.split(","), args.wan_seeds, args.wan_steps)
        )
    if args.plots:
        for path in plots.write_all(result, Path(args.plots)):
            print(f"plot: {path}", flush=True)
    if args.json:
        print(json.dumps(result))
    return 0


def workload_train(args: argparse.Namespace, systems: list[str]) -> dict[str, Any]:
    """Workload 2; keys ``{system}_{n}p_{field}``, and ``{system}_{field}`` for the
    largest peer count."""
    out: dict[str, Any] = {"train_steps": args.train_steps, "train_seed": args.train_seed}
    counts = [int(n) for n in args.train_peers.split(",")]
    out["train_peers"] = counts
    table: dict[tuple[str, int], dict[str, Any]] = {}
    for n in counts:
        for name in systems:
            with tempfile.TemporaryDirectory(prefix=f"compare-train-{name}-") as tmp:
                work = Path(tmp)
                t0 = time.monotonic()
                try:
                    row = train_runs.SYSTEMS[name](n, args.train_steps, args.train_seed, work)
                except (RuntimeError, TimeoutError, OSError) as exc:
                    logs = "".join(p.read_text()[-1500:] for p in sorted(work.glob("*.log")))
                    print(f"{name} x{n}: FAILED: {exc}\n{logs}", file=sys.stderr, flush=True)
                    row = {"failed": str(exc)}
                print(f"train {name} x{n}: {json.dumps(row)} ({time.monotonic() - t0:.0f} s)")
            table[(name, n)] = row
            for key, value in row.items():
                out[f"{name}_{n}p_{key}"] = value
                if n == max(counts):
                    out[f"{name}_{key}"] = value
    print(f"\ntraining: digits MLP, {args.train_steps} global steps of peers x 256 samples")
    print(f"{'system':<10} {'peers':>5} {'loss':>7} {'acc':>6} {'samples/s':>10} {'B/sample':>10}")
    for (name, n), r in table.items():
        if "failed" in r:
            print(f"{name:<10} {n:>5} failed: {r['failed']}")
            continue
        print(
            f"{name:<10} {n:>5} {r['loss']:>7.4f} {r['accuracy']:>6.3f} "
            f"{r['samples_per_s']:>10.0f} {r['bytes_per_sample']:>10.1f}"
        )
    return out


def print_table(rows: dict[str, dict[str, Any]], elements: int, rounds: int) -> None:
    dense = 4 * elements
    print(
        f"\none round, {PEERS} peers on loopback, {elements:,} fp32 elements ({dense / 1e6:.0f} MB)"
    )
    print(
        f"{'system':<15} {'round s':>8} {'MB sent':>9} {'x dense':>8} {'CPU s':>7} "
        f"{'error':>8} {f'err {rounds}r EF':>11}"
    )
    for name, r in rows.items():
        if "failed" in r:
            print(f"{name:<15} failed: {r['failed']}")
            continue
        ef = r.get(f"ef{rounds}_error")
        print(
            f"{name:<15} {r['round_s']:>8.3f} {r['round_bytes'] / 1e6:>9.2f} "
            f"{r['round_bytes'] / dense:>8.3f} {r['cpu_s']:>7.2f} {r['error']:>8.2e} "
            f"{'' if ef is None else f'{ef:.3f}':>11}"
        )
    print("x dense: bytes sent by all peers over one peer's dense fp32 update")


if __name__ == "__main__":
    sys.exit(main())
