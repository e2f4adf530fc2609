"""``ciuic-node demo``: N local nodes on the emulated 11-city WAN, each a real daemon
and a real trainer process, train a real model; then the same model is trained by
dense synchronous all-reduce through the same daemons; a summary table and a PNG plot
(loss against time and against bytes sent) close the run.

Ctrl+C stops everything: the orchestrator ends every process it started, by PID.
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ciuic_p2p.config import config_from_toml
from ciuic_p2p.errors import ConfigError
from ciuic_p2p.lab.cluster import ClusterError, LocalCluster, spread_nodes

DEMO_CONFIG = """# The demo's node config: the WAN preset, with every tensor in one sparse bucket
# (the demo's models are small: dense fp16 biases would cost more than the rest).
preset = "wan"

[codec]
density = {density}
dense_below_numel = 0

[train]
send_interval_steps = {send_interval}
max_send_interval_steps = {max_interval}
staleness_bound_steps = {bound}

[log]
level = "warning"
"""

TASK_STEPS = {"digits": 150, "shakespeare": 300}


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nodes", type=int, default=4, help="nodes to start (2-11, default 4)")
    p.add_argument(
        "--task",
        choices=["digits", "shakespeare"],
        default="digits",
        help="digits: an MLP on 8x8 handwritten digits (default); shakespeare: a small "
        "character-level transformer on twelve plays",
    )
    p.add_argument("--steps", type=int, help="steps per node (digits 150, shakespeare 300)")
    p.add_argument("--scenario", default="cities11", help="emulated WAN (default cities11)")
    p.add_argument(
        "--rate-scale",
        type=float,
        default=0.1,
        help="multiply the measured link rates (default 0.1: 33-110 Mbit/s)",
    )
    p.add_argument(
        "--density", type=float, default=0.01, help="fraction of values sent (default 0.01)"
    )
    p.add_argument("--send-interval", type=int, default=2, help="steps per update sent (default 2)")
    p.add_argument("--staleness-bound", type=int, default=64, help="steps (default 64)")
    p.add_argument("--seed", type=int, default=0, help="model, data and sampling seed")
    p.add_argument("--no-baseline", action="store_true", help="skip the dense baseline")
    p.add_argument(
        "--baseline-s",
        type=float,
        default=60.0,
        help="stop the dense baseline after this much training time (0: run every step)",
    )
    p.add_argument("--out", help="where results and the plot go (default: a new temp dir)")


class LiveView:
    """Per-node progress, redrawn in place on a terminal, a line every 5 s otherwise."""

    def __init__(self, names: list[str], mode: str) -> None:
        self.names = names
        self.mode = mode
        self.rows: dict[str, dict[str, Any]] = {}
        self.tty = sys.stdout.isatty()
        self.drawn = 0
        self.last = 0.0

    def update(self, name: str, obj: dict[str, Any]) -> None:
        if obj.get("event") != "progress":
            return
        self.rows[name] = obj
        now = time.monotonic()
        if now - self.last < (0.5 if self.tty else 5.0):
            return
        self.last = now
        self.draw()

    def draw(self) -> None:
        lines = []
        for name in self.names:
            r = self.rows.get(name)
            if r is None:
                lines.append(f"  {name:<12} starting")
                continue
            rate = r["step"] / r["t"] if r["t"] > 0 else 0.0
            stale = f"  staleness p99 {r['staleness']:>3}" if "staleness" in r else ""
            lines.append(
                f"  {name:<12} step {r['step']:>5}  loss {r['loss']:.3f}  "
                f"{rate:6.1f} steps/s  sent {r['bytes'] / 1e6:7.2f} MB{stale}"
            )
        if self.tty and self.drawn:
            sys.stdout.write(f"\x1b[{self.drawn}F")
        sys.stdout.write("\n".join(f"{line}\x1b[K" if self.tty else line for line in lines) + "\n")
        sys.stdout.flush()
        self.drawn = len(lines)


def _row(label: str, s: dict[str, Any]) -> str:
    stale = f"{s['staleness_p99']:>4}/{s['staleness_bound']}" if "staleness_p99" in s else "   -"
    return (
        f"  {label:<22} {s['steps']:>6} {s['wall_s']:>8.1f} {s['eval_loss']:>9.4f} "
        f"{s['accuracy']:>8.3f} {s['udp_bytes_sent'] / 1e6:>9.2f} {s['bytes_per_step']:>11.0f} "
        f"{100 * s['wait_fraction']:>7.1f}% {stale:>8}"
    )


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run_demo(args: argparse.Namespace) -> int:
    # torch only here: `ciuic-node --help` and the daemon run on hosts without it.
    from ciuic_p2p.lab.report import final_consensus, plot, summarize  # noqa: PLC0415

    # A closed terminal (SIGHUP) or `kill` (SIGTERM) stops everything like Ctrl+C: the
    # nodes run in their own sessions and would outlive the orchestrator otherwise.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGHUP, _interrupt)
    steps = args.steps or TASK_STEPS[args.task]
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="ciuic-demo-"))
    names = spread_nodes(args.scenario, args.nodes)
    config = DEMO_CONFIG.format(
        density=args.density,
        send_interval=args.send_interval,
        max_interval=max(args.send_interval, min(16, args.staleness_bound // 2)),
        bound=args.staleness_bound,
    )
    try:
        config_from_toml(config, "the demo's config")
    except ConfigError as exc:
        print(f"ciuic-node demo: error: {exc}", file=sys.stderr)
        return 2
    print(f"ciuic-node demo: {args.task}, {steps} steps on each of {len(names)} nodes")
    print(f"  nodes (farthest apart on {args.scenario}): {', '.join(names)}")
    print(f"  results in {out}")
    cluster = LocalCluster(args.scenario, names, out, config, rate_scale=args.rate_scale)
    runs: dict[str, list[dict[str, Any]]] = {}
    try:
        took = cluster.start()
        print(f"  mesh of {len(names)} daemons formed in {took:.1f} s\n")
        print("ciuic: asynchronous sparse gossip")
        view = LiveView(cluster.names, "async")
        runs["async"] = cluster.train(
            "async", args.task, steps, args.seed, out / "async", view.update
        )
        view.draw()
        if not args.no_baseline:
            limit = f", stopped after {args.baseline_s:g} s" if args.baseline_s else ""
            print(f"\nbaseline: dense fp32 synchronous ring all-reduce, same network{limit}")
            view = LiveView(cluster.names, "dense")
            runs["dense"] = cluster.train(
                "dense",
                args.task,
                steps,
                args.seed,
                out / "dense",
                view.update,
                time_limit_s=args.baseline_s,
            )
            view.draw()
    except KeyboardInterrupt:
        print("\ninterrupted: stopping every node ...", flush=True)
        cluster.stop()
        print("stopped; no process left behind")
        return 130
    except ClusterError as exc:
        cluster.stop()
        print(f"ciuic-node demo: error: {exc}", file=sys.stderr)
        return 1
    finally:
        cluster.stop()
    summaries = {mode: summarize(results) for mode, results in runs.items()}
    consensus = final_consensus(out / "async", len(names))
    print(
        "\n  run                     steps   wall s  eval loss accuracy   MB/node  bytes/step"
        " off-step    stale"
    )
    labels = {"async": "ciuic async sparse", "dense": "dense sync all-reduce"}
    for mode, s in summaries.items():
        print(_row(labels[mode], s))
    print(
        "  off-step: a trainer's wall time outside its own steps (the hook, and the CPU\n"
        "  the other nodes' processes take on this one machine); the async trainers never\n"
        "  wait for the network. bytes/step: every UDP byte a node sent, control included.\n"
        "  stale: how many steps the 99th percentile of peers' updates lagged this node's\n"
        "  when applied, over the bound (train.staleness_bound_steps). On one machine the\n"
        "  nodes' CPU shares differ, so they drift apart; a lag at the bound is the rule at\n"
        "  work (the node ahead waits, or excuses the laggard), not lost updates. Across\n"
        "  a real WAN it stays a few steps; near the bound run after run, a node is too slow."
    )
    a = summaries["async"]
    print(f"\n  consensus distance of the async replicas: {consensus:.4f}")
    if "dense" in summaries:
        d = summaries["dense"]
        a_ms = 1000 * a["wall_s"] / a["steps"]
        d_ms = 1000 * d["wall_s"] / max(1, d["steps"])
        print(
            f"  bytes per step: {d['bytes_per_step'] / max(1.0, a['bytes_per_step']):.0f}x fewer "
            f"than dense; time per step: {a_ms:.1f} ms against {d_ms:.0f} ms"
        )
    png = plot(runs, out / "demo.png", f"{args.task} on {len(names)} nodes ({args.scenario})")
    if png is None:
        print("  (no plot: install matplotlib, e.g. pip install 'ciuic-p2p[demo]')")
    else:
        print(f"  plot: {png}")
    return 0
