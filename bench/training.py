#!/usr/bin/env python3
"""Training benchmark: the same task, seeds, data and samples per node, four ways, side
by side in one run.

- ``outer``: ciuic's outer-step mode (``train.mode = "outer"``): H inner steps of the
  task's optimizer, then the round's pseudo-gradient, top-k with error feedback and
  low-bit values, through the daemons; the outer step applied one round late;
- ``diloco``: DiLoCo at the same H through the same daemons and mode: dense fp32
  pseudo-gradients, outer Nesterov (lr 0.7, momentum 0.9);
- ``step``: ciuic's per-step rule (top 1% of each step's progress, INT8, every 2 steps);
- ``ddp``: dense data parallelism, computed in one process: each step the exact mean of
  the N replicas' gradients, the same optimizer and schedule. Its bytes are the fp32
  ring all-reduce's, 2 (N-1)/N x 4 bytes per parameter and step, and its time per step
  the step time plus that ring's 2 (N-1) rounds on the emulated links (latency and
  rate), modelled, not run (``--measured-ring`` runs it for real, far slower).

Every node is a daemon process and a trainer process on the emulated WAN built from
``--rtt`` (and ``--bandwidth``) with rates times ``--rate-scale``; the N nodes are the
matrix's regions farthest apart. The trainer's compute is padded to an accelerator step
time (``--step-s``, default 0.5 s: the pad sleeps the step time minus the measured
compute, before the hook), so the host CPU is free as on a GPU node. Each figure is the
mean over ``--seeds`` seeds of the mean over nodes, after ``finish()``.

Bytes per step count every UDP payload byte a node's daemon sends during the run (its
chunks, relayed chunks, consensus fragments, control, acknowledgements, retransmissions)
over its steps; ``control_bytes_per_step`` is the same mesh's traffic while no one
trains (measured before each seed's runs, over the same wall time per step). Wait
fraction: the trainer's wall time minus its padded compute, over wall time (evaluations
excluded); utilization: steps x step time over wall time.
``<mode>_mesh_bytes_per_step_by_kind`` splits the same runs' mesh messages by kind
(CHUNK, HEADS, WANT, PING, ACK, GOSSIP, SYNC), before the transport's framing.

    python bench/training.py --json --task shakespeare
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ciuic_p2p.data import WAN_DIR
from ciuic_p2p.emulator.scenarios import load_scenario
from ciuic_p2p.lab import torchft_peer
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

VALUE_BITS = {"int8": 8, "int4": 4, "int2": 2, "fp16": 16}
DILOCO = {"outer_optimizer": "nesterov", "outer_lr": 0.7, "outer_momentum": 0.9}
MODES = ("outer", "diloco", "step", "ddp", "torchft")
DEFAULT_MODES = ("outer", "diloco", "step", "ddp")
"""``torchft`` (torchft's own DiLoCo, 4 replicas on loopback in a namespace of their
own: ciuic_p2p.lab.torchft_peer) joins them with ``--modes`` or ``--torchft``."""
OUTER_DEFAULTS: dict[str, dict[str, Any]] = {
    # Chosen by the sweeps in docs/concepts/outer-steps.md: digits (SGD, 85k parameters,
    # 150 steps) needs rounds and density more than it needs few bytes, and an outer lr
    # above 1 makes up the lag error feedback puts on a round's progress (1.6: the best
    # of 1-1.8 on the held-out seeds 10-13, bench/rounds.py); Shakespeare (AdamW, 425k,
    # 300 steps) SparseLoCo's H and density, with an outer lr above 1 (averaging Adam
    # trajectories shortens the step).
    "digits": {"inner_steps": 5, "outer_density": 0.05, "outer_values": "int4", "outer_lr": 1.6},
    "shakespeare": {
        "inner_steps": 30,
        "outer_density": 0.0156,
        "outer_values": "int2",
        "outer_lr": 2.0,
    },
}
LABELS = {
    "outer": "ciuic outer step",
    "diloco": "DiLoCo (fp32, Nesterov)",
    "step": "ciuic per-step rule",
    "ddp": "dense DDP (fp32 ring, modelled)",
    "torchft": "torchft DiLoCo (loopback)",
    "dense": "dense ring, measured",
}


def _arguments() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--rtt", default=str(WAN_DIR / "rtt_cloudping_11cities.csv"))
    ap.add_argument(
        "--bandwidth",
        default=None,
        help="bandwidth matrix CSV (default: the shipped one with the 11-city matrix, "
        "none otherwise: 1 Gbit/s links)",
    )
    ap.add_argument("--task", choices=["digits", "shakespeare"], default="digits")
    ap.add_argument("--steps", type=int, help="steps per node (digits 150, shakespeare 300)")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--rate-scale", type=float, default=0.1)
    ap.add_argument("--step-s", type=float, default=0.5, help="accelerator step time")
    ap.add_argument(
        "--lr-scale",
        type=float,
        default=1.0,
        help="times the task's learning rate, every mode (bench/rounds.py finds DDP's best)",
    )
    ap.add_argument("--modes", default=",".join(DEFAULT_MODES), help=f"of {', '.join(MODES)}")
    ap.add_argument(
        "--torchft", action="store_true", help="add torchft's DiLoCo (needs it installed)"
    )
    ap.add_argument("--inner-steps", type=int, help="H, outer and diloco (per task)")
    ap.add_argument("--outer-density", type=float, help="per task")
    ap.add_argument("--outer-values", choices=list(VALUE_BITS), help="per task")
    ap.add_argument("--outer-optimizer", choices=["average", "nesterov"], default="average")
    ap.add_argument("--outer-lr", type=float, help="per task")
    ap.add_argument("--outer-momentum", type=float, default=0.9)
    ap.add_argument(
        "--outer-consensus-interval",
        type=int,
        default=32,
        help="outer: train.consensus_interval_steps (a 1/64 dense INT8 fragment each)",
    )
    ap.add_argument("--density", type=float, default=0.01, help="the per-step rule's")
    ap.add_argument("--send-interval", type=int, default=2, help="the per-step rule's")
    ap.add_argument("--value-mode", choices=list(VALUE_BITS), default="int8", help="step's")
    ap.add_argument("--staleness-bound", type=int, default=64)
    ap.add_argument("--control-window-s", type=float, default=10.0)
    ap.add_argument("--control-settle-s", type=float, default=5.0)
    ap.add_argument("--measured-ring", action="store_true", help="also run the real ring")
    ap.add_argument("--plot", help="write loss against bytes and time here (PNG)")
    ap.add_argument("--out", help="keep the runs here (default: a temp dir)")
    ap.add_argument("--json", action="store_true", help="print one JSON object last")
    args = ap.parse_args()
    for key, value in OUTER_DEFAULTS[args.task].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.bandwidth is None and Path(args.rtt).name == "rtt_cloudping_11cities.csv":
        args.bandwidth = str(WAN_DIR / "bandwidth_11cities.csv")
    return args


def _env(section_values: dict[str, dict[str, Any]]) -> dict[str, str]:
    """Config overrides for the trainers, as ``CIUIC_<SECTION>_<KEY>`` variables."""
    out = {}
    for section, values in section_values.items():
        for key, value in values.items():
            text = f'"{value}"' if isinstance(value, str) else repr(value)
            out[f"CIUIC_{section.upper()}_{key.upper()}"] = text
    return out


def _mode_env(args: argparse.Namespace) -> dict[str, dict[str, str]]:
    outer_train = {
        "mode": "outer",
        "inner_steps": args.inner_steps,
        "outer_optimizer": args.outer_optimizer,
        "outer_lr": args.outer_lr,
        "outer_momentum": args.outer_momentum,
    }
    return {
        "outer": _env(
            {
                "train": {
                    **outer_train,
                    "min_density": min(0.0005, args.outer_density),
                    "consensus_interval_steps": args.outer_consensus_interval,
                },
                "codec": {"density": args.outer_density, "value_mode": args.outer_values},
            }
        ),
        "diloco": _env(
            {
                "train": {**outer_train, **DILOCO},
                "codec": {"dense_below_numel": 1 << 40, "dense_dtype": "fp32"},
            }
        ),
        "step": _env({"codec": {"value_mode": args.value_mode}}),
    }


def _ring_step_s(scenario: Path, ring: list[str], params: int, rate_scale: float) -> float:
    """A fp32 ring all-reduce's time on the emulated links: 2 (N-1) rounds, each the
    slowest hop's one-way delay plus 1/N of the vector at its rate."""
    sc = load_scenario(scenario)
    n = len(ring)
    seg_bits = 8 * 4 * params / n
    hops = list(zip(ring, ring[1:] + ring[:1], strict=True))
    per_round = max(
        sc.params(a, b).delay_s + seg_bits / ((sc.params(a, b).rate_bps or 1e9) * rate_scale)
        for a, b in hops
    )
    return 2 * (n - 1) * per_round


def _control_rate(cluster: LocalCluster, window_s: float, settle_s: float) -> float:
    """UDP bytes per second and node the mesh sends while no one trains, after
    ``settle_s`` (the previous run's last repairs, the first link measurements)."""
    time.sleep(settle_s)

    def sent() -> float:
        st = cluster.status()
        return statistics.fmean(float((s or {}).get("udp_bytes_sent", 0)) for s in st.values())

    a, t0 = sent(), time.monotonic()
    time.sleep(window_s)  # a measurement window of wall time, not a wait for a condition
    return (sent() - a) / (time.monotonic() - t0)


def _mesh_bytes(cluster: LocalCluster) -> collections.Counter[str]:
    """Mesh message bytes the nodes have sent, summed, by message kind (before the
    transport's framing: the UDP count is the total)."""
    total: collections.Counter[str] = collections.Counter()
    for st in cluster.status().values():
        total.update((st or {}).get("mesh_bytes_sent", {}))
    return total


def _params_of(results: list[dict[str, Any]]) -> int:
    return int(results[0].get("params", 0))


def _seed_row(
    args: argparse.Namespace,
    cluster: LocalCluster,
    modes: list[str],
    steps: int,
    seed: int,
    out: Path,
    scenario: Path,
) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:
    envs = _mode_env(args)
    row: dict[str, Any] = {"seed": seed}
    control = _control_rate(cluster, args.control_window_s, args.control_settle_s)
    runs: dict[str, list[dict[str, Any]]] = {}
    by_kind: dict[str, dict[str, float]] = {}
    for mode in modes:
        worker_mode = "async" if mode in envs else mode
        before = _mesh_bytes(cluster)
        runs[mode] = cluster.train(
            worker_mode,
            args.task,
            steps,
            seed,
            out / f"{mode}-{seed}",
            step_s=0.0 if mode == "ddp" else args.step_s,
            env=envs.get(mode),
            inner_steps=args.inner_steps,
            lr_scale=args.lr_scale,
        )
        after, steps_run = _mesh_bytes(cluster), max(1, runs[mode][0]["steps"])
        by_kind[mode] = {
            kind: (after[kind] - before.get(kind, 0)) / len(runs[mode]) / steps_run
            for kind in after
        }
    if args.measured_ring:
        runs["dense"] = cluster.train(
            "dense",
            args.task,
            steps,
            seed,
            out / f"dense-{seed}",
            step_s=args.step_s,
            lr_scale=args.lr_scale,
        )
    ddp_step_s = None
    if "ddp" in runs:
        params = _params_of(runs["ddp"])
        ring = cluster.ring_order()
        ddp_step_s = args.step_s + _ring_step_s(scenario, ring, params, args.rate_scale)
        ring_bytes = 2 * (len(ring) - 1) / len(ring) * 4 * params
        for r in runs["ddp"]:  # the modelled ring: its bytes and its time
            r["bytes_per_step"] = ring_bytes
            r["udp_bytes_sent"] = ring_bytes * r["steps"]
            r["wall_s"] = ddp_step_s * r["steps"]
            r["wait_fraction"] = 1 - args.step_s / ddp_step_s
            r["curve"] = [
                [ddp_step_s * c[1], c[1], c[2], c[3], ring_bytes * c[1]] for c in r["curve"]
            ]
    target = None
    if "ddp" in runs:
        target = 1.05 * statistics.fmean(r["eval_loss"] for r in runs["ddp"])
    for mode, results in runs.items():
        row[mode] = summarize(results, target)
        row[mode]["utilization"] = (
            args.step_s / ddp_step_s
            if mode == "ddp" and ddp_step_s
            else statistics.fmean(args.step_s * r["steps"] / r["wall_s"] for r in results)
        )
    row["ddp_step_s"] = ddp_step_s
    row["control_bytes_per_s"] = control
    row["target_loss"] = target
    for mode, results in runs.items():
        if mode in envs:
            row[mode]["consensus_distance"] = final_consensus(out / f"{mode}-{seed}", len(results))
            wall_per_step = statistics.fmean(r["wall_s"] / r["steps"] for r in results)
            row[mode]["control_bytes_per_step"] = control * wall_per_step
            row[mode]["mesh_bytes_per_step_by_kind"] = by_kind[mode]
    return row, runs


def main() -> int:
    args = _arguments()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if args.torchft and "torchft" not in modes:
        modes.append("torchft")
    if unknown := set(modes) - set(MODES):
        raise SystemExit(f"unknown modes {sorted(unknown)}: of {', '.join(MODES)}")
    if "torchft" in modes and (why := torchft_peer.available()):
        raise SystemExit(f"torchft: {why}")
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
    )
    per_seed: list[dict[str, Any]] = []
    all_runs: dict[str, list[dict[str, Any]]] = {}
    t0 = time.monotonic()
    with LocalCluster(str(scenario), names, out, config, rate_scale=args.rate_scale) as cluster:
        cluster.start()
        for seed in range(args.seeds):
            row, runs = _seed_row(args, cluster, modes, steps, seed, out, scenario)
            per_seed.append(row)
            for mode, results in runs.items():
                all_runs.setdefault(mode, []).extend(results)
            line = " | ".join(
                f"{m} {row[m]['eval_loss']:.4f} {row[m]['bytes_per_step']:.0f} B/step "
                f"wait {row[m]['wait_fraction']:.1%}"
                for m in runs
            )
            print(f"seed {seed}: {line}", file=sys.stderr if args.json else sys.stdout)
    result = _result(args, names, steps, per_seed, time.monotonic() - t0)
    if args.plot:
        from ciuic_p2p.lab.report import plot  # noqa: PLC0415

        title = f"{args.task}, {len(names)} nodes, {Path(args.rtt).stem}, step {args.step_s} s"
        written = plot(all_runs, Path(args.plot), title, labels=LABELS)
        result["plot"] = str(written) if written else None
    print(json.dumps(result))
    return 0


def _result(
    args: argparse.Namespace,
    names: list[str],
    steps: int,
    per_seed: list[dict[str, Any]],
    wall_s: float,
) -> dict[str, Any]:
    def mean(mode: str, key: str) -> float | None:
        values = [r[mode][key] for r in per_seed if mode in r and r[mode].get(key) is not None]
        return statistics.fmean(values) if values and len(values) == len(per_seed) else None

    result: dict[str, Any] = {
        "task": args.task,
        "lr_scale": args.lr_scale,
        "rtt": Path(args.rtt).name,
        "nodes": len(names),
        "regions": names,
        "seeds": args.seeds,
        "steps": steps,
        "step_s": args.step_s,
        "rate_scale": args.rate_scale,
        "inner_steps": args.inner_steps,
        "outer_density": args.outer_density,
        "outer_value_mode": args.outer_values,
        "value_bits": VALUE_BITS[args.outer_values],
        "outer_optimizer": args.outer_optimizer,
        "outer_lr": args.outer_lr,
        "outer_momentum": args.outer_momentum if args.outer_optimizer == "nesterov" else None,
        "outer_consensus_interval_steps": args.outer_consensus_interval,
        "diloco": {**DILOCO, "inner_steps": args.inner_steps, "values": "fp32 dense"},
        "torchft": {
            **torchft_peer.DILOCO_OUTER,
            "inner_steps": args.inner_steps,
            "version": torchft_peer.version(),
            "links": "loopback in its own namespace (not the emulated WAN): its time "
            "does not compare, its loss and bytes (every byte on that loopback) do",
        }
        if any("torchft" in r for r in per_seed)
        else None,
        "step_density": args.density,
        "step_send_interval_steps": args.send_interval,
        "step_value_mode": args.value_mode,
        "control_bytes_per_s": statistics.fmean(r["control_bytes_per_s"] for r in per_seed),
        "control_bytes_per_step": mean("outer", "control_bytes_per_step"),
        "dense_model": "ddp: exact mean of the N replicas' gradients in one process; "
        "bytes and time of the fp32 ring modelled on the emulated links",
        "ddp_step_s": statistics.fmean(r["ddp_step_s"] for r in per_seed if r["ddp_step_s"])
        if any(r["ddp_step_s"] for r in per_seed)
        else None,
    }
    keys = (
        "eval_loss", "accuracy", "bytes_per_step", "wait_fraction", "utilization",
        "time_to_target_s", "wall_s", "hook_ms_per_step", "step_ms", "consensus_distance",
    )  # fmt: skip
    for mode in (*MODES, "dense"):
        name = "dense" if mode == "ddp" else ("ring" if mode == "dense" else mode)
        for key in keys:
            result[f"{name}_{key}"] = mean(mode, key)
        kinds = [
            r[mode]["mesh_bytes_per_step_by_kind"]
            for r in per_seed
            if mode in r and "mesh_bytes_per_step_by_kind" in r[mode]
        ]
        if kinds:
            result[f"{name}_mesh_bytes_per_step_by_kind"] = {
                k: round(statistics.fmean(d.get(k, 0.0) for d in kinds), 1)
                for k in sorted(set().union(*kinds))
            }
        if any(mode in r and "staleness_p99" in r[mode] for r in per_seed):
            result[f"{name}_staleness_p99_steps"] = max(
                r[mode]["staleness_p99"] for r in per_seed if mode in r
            )
            result[f"{name}_merged_steps"] = sum(
                r[mode]["merged_steps"] for r in per_seed if mode in r
            )
            result[f"{name}_refused_chunks"] = sum(
                r[mode]["refused"] for r in per_seed if mode in r
            )
            result[f"{name}_exactly_once"] = all(
                r[mode]["exactly_once"] for r in per_seed if mode in r
            )
    o, d, di = (result.get(f"{m}_eval_loss") for m in ("outer", "dense", "diloco"))
    ob, db, dib = (result.get(f"{m}_bytes_per_step") for m in ("outer", "dense", "diloco"))
    if o is not None and d:
        result["outer_loss_vs_dense_pct"] = 100 * (o - d) / d
    if o is not None and di:
        result["outer_loss_over_diloco"] = o / di
    if ob and db:
        result["bytes_ratio_dense_over_outer"] = db / ob
    if ob and dib:
        result["bytes_ratio_diloco_over_outer"] = dib / ob
    t, tb = result.get("torchft_eval_loss"), result.get("torchft_bytes_per_step")
    if o is not None and t:
        result["outer_loss_over_torchft"] = o / t
    if ob and tb:
        result["bytes_ratio_torchft_over_outer"] = tb / ob
    result["wall_s"] = round(wall_s, 1)
    result["per_seed"] = per_seed
    return result


if __name__ == "__main__":
    sys.exit(main())
