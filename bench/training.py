#!/usr/bin/env python3
"""Training benchmark: the same task, seeds, data and steps three ways, side by side.

- ``async``: ciuic (the hook, asynchronous sparse gossip through the daemons);
- ``dense``: dense fp32 synchronous ring all-reduce of gradients through the same
  daemons and QUIC links (DIRECT frames), the ring ordered for least total RTT;
- ``single``: one node alone with the same total samples (N times the steps).

Every node is a daemon process and a trainer process on the emulated WAN built from
``--rtt`` (and ``--bandwidth``) with rates times ``--rate-scale``; the N nodes are the
matrix's regions farthest apart (greedy max-min RTT). Each figure is the mean over
``--seeds`` seeds (staleness: the largest). Bytes per step count every UDP payload
byte a node's socket sends during the run (its chunks, relayed chunks, control,
retransmissions, repair) over its local steps. Wait fraction: the trainer's wall time
minus forward, backward and optimizer time (and evaluations), over wall time.
Time to target: training time until the evaluation loss first reaches the dense
run's final loss plus 5%.

    python bench/training.py --json --nodes 4 --task digits
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ciuic_p2p.data import WAN_DIR
from ciuic_p2p.lab.cluster import LocalCluster, spread_nodes
from ciuic_p2p.lab.demo import DEMO_CONFIG
from ciuic_p2p.lab.report import final_consensus, summarize

SCENARIO = """seed = 11
rate_scale = 1.0

[matrix]
rtt_csv = "{rtt}"
{bandwidth}
bandwidth_column = "dtfm_gbps_2022"
default_rate_gbps = 1.0

[defaults]
jitter_ms = 0.4
jitter_dist = "normal"
reorder = false
loss = 0.0005
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--rtt", default=str(WAN_DIR / "rtt_cloudping_11cities.csv"))
    ap.add_argument("--bandwidth", default=str(WAN_DIR / "bandwidth_11cities.csv"))
    ap.add_argument("--task", choices=["digits", "shakespeare"], default="digits")
    ap.add_argument("--steps", type=int, help="steps per node (digits 150, shakespeare 300)")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--rate-scale", type=float, default=0.1)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--send-interval", type=int, default=2)
    ap.add_argument(
        "--value-mode",
        choices=["int8", "int4", "int2", "fp16"],
        default="int8",
        help="codec.value_mode: the selected values' encoding",
    )
    ap.add_argument("--staleness-bound", type=int, default=64)
    ap.add_argument("--skip-dense", action="store_true", help="async and single only")
    ap.add_argument("--trainer-nice", type=int, default=0, help="trainers' CPU niceness")
    ap.add_argument("--skip-single", action="store_true", help="async and dense only")
    ap.add_argument("--out", help="keep the runs here (default: a temp dir)")
    ap.add_argument("--json", action="store_true", help="print one JSON object last")
    args = ap.parse_args()
    steps = args.steps or {"digits": 150, "shakespeare": 300}[args.task]
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="ciuic-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    bandwidth = f'bandwidth_csv = "{Path(args.bandwidth).resolve()}"' if args.bandwidth else ""
    scenario = out / "scenario.toml"
    scenario.write_text(SCENARIO.format(rtt=Path(args.rtt).resolve(), bandwidth=bandwidth))
    names = spread_nodes(str(scenario), args.nodes)
    config = DEMO_CONFIG.format(
        density=args.density,
        send_interval=args.send_interval,
        max_interval=max(args.send_interval, min(16, args.staleness_bound // 2)),
        bound=args.staleness_bound,
    ).replace("[codec]\n", f'[codec]\nvalue_mode = "{args.value_mode}"\n', 1)
    per_seed: list[dict[str, Any]] = []
    t0 = time.monotonic()
    with LocalCluster(
        str(scenario), names, out, config, rate_scale=args.rate_scale,
        trainer_nice=args.trainer_nice,
    ) as cluster:  # fmt: skip
        cluster.start()
        for seed in range(args.seeds):
            row: dict[str, Any] = {"seed": seed}
            runs = {}
            runs["async"] = cluster.train("async", args.task, steps, seed, out / f"async-{seed}")
            if not args.skip_dense:
                runs["dense"] = cluster.train(
                    "dense", args.task, steps, seed, out / f"dense-{seed}"
                )
            if not args.skip_single:
                runs["single"] = cluster.train(
                    "single", args.task, steps * len(names), seed, out / f"single-{seed}"
                )
            target = None
            if "dense" in runs:
                target = 1.05 * statistics.fmean(r["eval_loss"] for r in runs["dense"])
            for mode, results in runs.items():
                row[mode] = summarize(results, target)
            row["target_loss"] = target
            row["consensus_distance"] = final_consensus(out / f"async-{seed}", len(names))
            per_seed.append(row)
            if not args.json:
                print(json.dumps(row))
            else:
                a = row["async"]
                print(
                    f"seed {seed}: async loss {a['eval_loss']:.4f} acc {a['accuracy']:.3f} "
                    f"{a['bytes_per_step']:.0f} B/step wait {a['wait_fraction']:.1%}"
                    + (
                        f" | dense loss {row['dense']['eval_loss']:.4f} "
                        f"{row['dense']['bytes_per_step']:.0f} B/step"
                        if "dense" in row
                        else ""
                    ),
                    file=sys.stderr,
                )

    def mean(mode: str, key: str) -> float | None:
        values = [r[mode][key] for r in per_seed if mode in r and r[mode].get(key) is not None]
        if len(values) < len(per_seed):
            return None
        return statistics.fmean(values)

    result: dict[str, Any] = {
        "task": args.task,
        "nodes": len(names),
        "regions": names,
        "seeds": args.seeds,
        "steps": steps,
        "rate_scale": args.rate_scale,
        "density": args.density,
        "trainer_nice": args.trainer_nice,
        "send_interval_steps": args.send_interval,
        "value_mode": args.value_mode,
        "value_bits": {"int8": 8, "int4": 4, "int2": 2, "fp16": 16}[args.value_mode],
        "async_eval_loss": mean("async", "eval_loss"),
        "dense_eval_loss": mean("dense", "eval_loss"),
        "single_eval_loss": mean("single", "eval_loss"),
        "async_accuracy": mean("async", "accuracy"),
        "dense_accuracy": mean("dense", "accuracy"),
        "single_accuracy": mean("single", "accuracy"),
        "async_time_to_target_s": mean("async", "time_to_target_s"),
        "dense_time_to_target_s": mean("dense", "time_to_target_s"),
        "async_wall_s": mean("async", "wall_s"),
        "dense_wall_s": mean("dense", "wall_s"),
        "async_bytes_per_step": mean("async", "bytes_per_step"),
        "dense_bytes_per_step": mean("dense", "bytes_per_step"),
        "async_wait_fraction": mean("async", "wait_fraction"),
        "dense_wait_fraction": mean("dense", "wait_fraction"),
        "async_blocked_fraction": mean("async", "blocked_fraction"),
        "async_hook_ms_per_step": mean("async", "hook_ms_per_step"),
        "step_ms": mean("async", "step_ms"),
        "dense_step_wall_ms": None,
        "staleness_bound_steps": args.staleness_bound,
        "staleness_p50_steps": max(r["async"]["staleness_p50"] for r in per_seed),
        "staleness_p99_steps": max(r["async"]["staleness_p99"] for r in per_seed),
        "consensus_distance": max(r["consensus_distance"] for r in per_seed),
        "exactly_once": all(r["async"]["exactly_once"] for r in per_seed),
        "refused_chunks": sum(r["async"]["refused"] for r in per_seed),
        "wall_s": round(time.monotonic() - t0, 1),
    }
    if result["dense_eval_loss"] is not None:
        d = [r["dense"] for r in per_seed]
        result["dense_step_wall_ms"] = statistics.fmean(1000 * x["wall_s"] / x["steps"] for x in d)
        a_loss, d_loss = result["async_eval_loss"], result["dense_eval_loss"]
        result["loss_vs_dense_pct"] = 100 * (a_loss - d_loss) / d_loss
        result["accuracy_vs_dense_pts"] = 100 * (
            result["async_accuracy"] - result["dense_accuracy"]
        )
        result["bytes_ratio_dense_over_async"] = (
            result["dense_bytes_per_step"] / result["async_bytes_per_step"]
        )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
