#!/usr/bin/env python3
"""Sharded replicas: N nodes (real ``ciuic-node run`` daemons on loopback), each of R
FSDP2 ranks under torchrun with gloo (or one unsharded process where ``--layout`` says
1), P parameters in all per replica, compute padded to ``--step-s`` as in
bench/datapath.py, SGD, ``--density`` (1%), a send every step.

Each node's trainer (bench/support/sharded_trainer.py) shards 4 x ``nn.Linear`` with
``fully_shard`` (one FSDP2 unit per layer). Its timed compute holds FSDP2's own
collectives of the step (the four layers' forward all-gathers and the last layer's
backward reduce-scatter); the hook's time is what ``sync.step()`` adds after it.

Reported: ``nodes``, ``ranks`` (per node), ``params``, ``step_s``, ``steps``,
``compute_s_mean`` (the run's own compute, for scale), ``step_frac_mean`` and
``step_frac_p99`` (``step()`` over the step time, over every rank's measured steps),
``merged_steps``, ``hook_extra_bytes_per_shard_param`` (the larger of the tensors the
hook holds on a rank and that rank's peak RSS with the hook minus without it, over
its shard's parameters; the largest over the ranks), ``full_model_tensors`` (tensors
the update rule holds on a sharded rank with more elements than its shard),
``node_bytes_per_step_over_unsharded`` (a node's UDP payload per step over an
unsharded replica's of the same P: the ``--layout``'s unsharded node where it has
one, else a baseline run of unsharded nodes after the sharded one), its parts,
``staleness_p99_steps``, ``param_distance_after_finish`` (relative L2 between the
nodes' gathered models) and ``cores``.

    python bench/sharded.py --json                   # 2 nodes x 2 ranks, 1e8, 2 s steps
    python bench/sharded.py --layout 2,1 --json      # a node of 2 ranks, an unsharded one
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from datapath import quantile

from ciuic_p2p.core.replica.rule import consensus_distance
from ciuic_p2p.daemon.control import ControlError, request
from ciuic_p2p.lab.cluster import LocalCluster, free_port_block

HERE = Path(__file__).resolve().parent

CONFIG = """preset = "wan"

[codec]
density = {density}

[train]
send_interval_steps = 1
staleness_bound_steps = 64
stall_grace_s = 60.0

[log]
level = "warning"
"""


def run(layout: list[int], args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """One run of nodes with these rank counts (1: an unsharded process)."""
    work.mkdir(parents=True, exist_ok=True)
    config = CONFIG.format(density=args.density)
    with LocalCluster(None, [f"n{i}" for i in range(len(layout))], work / "c", config) as cluster:
        cluster.start()
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        port = free_port_block(len(layout))
        procs = []
        for node, ranks in enumerate(layout):
            name = cluster.names[node]
            trainer = [
                str(HERE / "support" / "sharded_trainer.py"),
                "--socket", str(cluster.trainer_socket(name)),
                "--config", str(cluster.config_path), "--params", repr(args.params),
                "--step-s", repr(args.step_s), "--steps", str(args.steps),
                "--warmup", str(args.warmup), "--replicas", str(len(layout)),
                "--node-index", str(node), "--out", str(work),
            ]  # fmt: skip
            if ranks == 1:
                cmd = [sys.executable, *trainer, "--plain"]
            else:
                cmd = [
                    sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
                    "--nproc-per-node", str(ranks), "--master-addr", "127.0.0.1",
                    "--master-port", str(port + node), *trainer,
                ]  # fmt: skip
            err = (work / f"node-{node}.log").open("wb")
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, env=env))
        sent = sample_sent(cluster, procs, args)
        lines: list[dict[str, Any]] = []
        for node, p in enumerate(procs):
            out = p.stdout.read().decode() if p.stdout else ""
            p.wait()
            found = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
            if p.returncode != 0 or len(found) != layout[node]:
                log = (work / f"node-{node}.log").read_text(errors="replace")
                raise SystemExit(f"node {node} failed ({p.returncode}):\n{log[-3000:]}")
            lines += found
    models = [torch.load(work / f"params-{n}.pt") for n in range(len(layout))]
    return {"lines": lines, "sent": sent, "distance": consensus_distance(models)}


def sample_sent(
    cluster: LocalCluster, procs: list[subprocess.Popen[bytes]], args: argparse.Namespace
) -> dict[str, list[tuple[float, int]]]:
    """Each daemon's UDP bytes sent, sampled every 0.5 s while the trainers run."""
    sent: dict[str, list[tuple[float, int]]] = {n: [] for n in cluster.names}
    deadline = time.monotonic() + (args.steps + args.warmup) * args.step_s * 3 + 600
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        for n in cluster.names:
            try:
                st = request(cluster.control(n), {"cmd": "status"}, timeout_s=5)
            except ControlError:
                continue
            sent[n].append((time.monotonic(), int(st.get("udp_bytes_sent", 0))))
        time.sleep(0.5)
    for p in procs:
        if p.poll() is None:
            p.kill()
    return sent


def bytes_per_step(samples: list[tuple[float, int]], step_s: float) -> float:
    """UDP bytes per step over the middle half of the run (past warm-up and attach,
    before the finish's dense update and last round)."""
    if len(samples) < 8:
        return 0.0
    a, b = samples[len(samples) // 4], samples[3 * len(samples) // 4]
    return (b[1] - a[1]) / max(1e-9, b[0] - a[0]) * step_s


def summarize(layout: list[int], result: dict[str, Any], base: float, args: argparse.Namespace
              ) -> dict[str, Any]:  # fmt: skip
    lines = result["lines"]
    fracs = [h / args.step_s for x in lines for h in x["hook_s"]]
    computes = [c for x in lines for c in x["compute_s"]]
    sharded = [x for x in lines if not x["plain"]]
    per_node = {int(name[1:]): bytes_per_step(s, args.step_s) for name, s in result["sent"].items()}
    node_bytes = max((per_node[n] for n, r in enumerate(layout) if r > 1), default=0.0)
    extra = max(
        (max(x["held_bytes"], x["rss_extra_bytes"]) / x["shard"] for x in sharded), default=0.0
    )
    return {
        "nodes": len(layout),
        "ranks": layout,
        "params": lines[0]["params"],
        "step_s": args.step_s,
        "steps": args.steps,
        "compute_s_mean": round(sum(computes) / max(1, len(computes)), 4),
        "step_frac_mean": round(sum(fracs) / max(1, len(fracs)), 4),
        "step_frac_p99": round(quantile(fracs, 0.99), 4),
        "merged_steps": sum(x["merged_steps"] for x in lines),
        "hook_extra_bytes_per_shard_param": round(extra, 2),
        "hook_held_bytes_per_shard_param": round(
            max((x["held_bytes"] / x["shard"] for x in sharded), default=0.0), 2
        ),
        "rss_extra_bytes_per_shard_param": round(
            max((x["rss_extra_bytes"] / x["shard"] for x in sharded), default=0.0), 2
        ),
        "full_model_tensors": sum(x["full_model_tensors"] for x in sharded),
        "node_bytes_per_step": round(node_bytes),
        "unsharded_bytes_per_step": round(base),
        "node_bytes_per_step_over_unsharded": round(node_bytes / base, 3) if base else None,
        "staleness_p99_steps": max(x["staleness_p99"] for x in lines),
        "param_distance_after_finish": result["distance"],
        "complete": all(x["complete"] for x in lines),
        "refused": sum(sum(x["refused"].values()) for x in lines),
        "cores": os.cpu_count(),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layout", default="2,2", help="ranks per node (1: unsharded)")
    ap.add_argument("--params", type=float, default=1e8)
    ap.add_argument("--step-s", type=float, default=2.0)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--work", default=None, help="keep the runs' logs here (default: a temp dir)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    layout = [int(x) for x in args.layout.split(",")]
    if len(layout) < 2 or min(layout) < 1 or max(layout) < 2:
        raise SystemExit("--layout names two nodes or more, one of them sharded (2 ranks+)")
    with tempfile.TemporaryDirectory(prefix="ciuic-sharded-") as scratch:
        tmp = args.work or scratch
        result = run(layout, args, Path(tmp) / "sharded")
        plain = [n for n, r in enumerate(layout) if r == 1]
        if plain:  # the same run's unsharded node is the baseline
            base = bytes_per_step(result["sent"][f"n{plain[0]}"], args.step_s)
        else:
            baseline = run([1] * len(layout), args, Path(tmp) / "baseline")
            base = sum(bytes_per_step(s, args.step_s) for s in baseline["sent"].values())
            base /= len(layout)
        out = summarize(layout, result, base, args)
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:>36}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
