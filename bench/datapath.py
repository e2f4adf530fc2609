#!/usr/bin/env python3
"""Data-path benchmark: real daemons and trainers of a big model, the trainer's compute
padded to an accelerator's step time, measured as a user with a GPU node would see it.

N ``ciuic-node run`` daemons on loopback (or an emulated scenario) form a mesh; one
trainer per node (bench/support/datapath_trainer.py) trains 4 x ``nn.Linear`` of
``--params`` parameters in all: a small real forward/backward (the last layer's; the
others keep a first gradient) and SGD's step over every parameter, then a sleep to
``--step-s`` (the accelerator's step: the host CPU is free, as on a GPU node), then
``sync.step()``. Reported from the run:

- ``step_frac_*``: the wall time the library adds to the training thread (``step()``;
  it registers no other hooks) over the step time (p50, p99, mean over all trainers'
  measured steps);
- ``merged_steps`` (steps not sent in their own send), ``backoffs`` (density back-offs);
- ``hook_extra_bytes_per_param``: the larger of the tensors the hook holds (counted
  by the update rule) and the trainer's RSS with the hook minus without it, over P;
- ``passes_per_send``: bytes the hook's code paths read and wrote (counted on the code
  path, not timed) per send over 4 x P;
- each daemon's MB/s of UDP payload sent and CPU ms per MB (sent plus received);
- ``backlog_peak_sends``: the largest backlog any daemon reported, sampled every
  0.5 s (every byte queued: updates, consensus, relays, repairs), in mean update
  sends (consensus fragments go out every ``--consensus-interval`` steps, so the
  peak covers them); its trend (last third over first third);
- ``staleness_*``: over all (send, receiver) pairs; a send never applied counts as
  unbounded (reported as ``null`` p99 when any is missing);
- the transport section, side by side in the same run: bench/transport.py's goodput
  and CPU per MB of the QUIC backend; bench/lanes.py's ``lanes_speedup``: what a
  receiving daemon delivers with ``transport.lanes = 2`` on both ends over 1.

``--lanes K`` runs the training daemons themselves with ``transport.lanes = K`` (their
CPU then counts their lane processes').

    python bench/datapath.py --json                       # 3 nodes, 100M, 2 s steps
    python bench/datapath.py --nodes 2 --step-s 0.5 --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ciuic_p2p.daemon.control import ControlError, request
from ciuic_p2p.lab.cluster import LocalCluster
from ciuic_p2p.lab.cluster import process_cpu_s as cpu_s

HERE = Path(__file__).resolve().parent

CONFIG = """preset = "wan"

[codec]
density = {density}

[train]
send_interval_steps = {send_interval}
consensus_interval_steps = {consensus_interval}
consensus_fragments = {fragments}
staleness_bound_steps = 64

[transport]
lanes = {lanes}

[log]
level = "warning"
"""


def quantile(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def staleness(trainers: list[dict[str, Any]]) -> dict[str, Any]:
    """Quantiles over all applied (send, receiver) pairs; missing ones are unbounded."""
    hist: dict[int, int] = {}
    missing = 0
    for t in trainers:
        for steps, count in t["staleness_hist"]:
            hist[steps] = hist.get(steps, 0) + count
        for origin, sent in t["sent_by_origin"].items():
            missing += max(0, sent - t["applied_by_origin"].get(origin, 0))
    total = sum(hist.values()) + missing

    def q(p: float) -> int | None:
        need = p * total
        seen = 0
        for steps in sorted(hist):
            seen += hist[steps]
            if seen >= need:
                return steps
        return None  # in the unbounded tail

    return {"staleness_p50_steps": q(0.5), "staleness_p99_steps": q(0.99), "never_applied": missing}


def run_transport(mb: int) -> dict[str, Any]:
    if mb <= 0:
        return {}
    out = subprocess.run(
        [sys.executable, str(HERE / "transport.py"), "--mb", str(mb), "--json"],
        capture_output=True,
        text=True,
        timeout=900,
        check=True,
    )
    t = json.loads(out.stdout.strip().splitlines()[-1])
    return {
        "backend": t["backend"],
        "transport_goodput_MBps": t["goodput_MBps"],
        "transport_cpu_ms_per_mb": t["cpu_s_per_MB"] * 1e3,
        "transport_aioquic_cpu_ms_per_mb": t["aioquic_cpu_s_per_MB"] * 1e3,
        "transport_aioquic_goodput_MBps": t["aioquic_goodput_MBps"],
        "transport_over_aioquic_cpu": t["backend_over_aioquic_cpu"],
        "transport_over_aioquic_cpu_runs": t["backend_over_aioquic_cpu_runs"],
        "transport_no_gso_cpu_ms_per_mb": t["no_gso_cpu_s_per_MB"] * 1e3,
        "transport_bare_aioquic_MBps": t["raw_aioquic_MBps"],
        "transport_one_lane_MBps": t["one_lane_goodput_MBps"],
        "transport_two_lanes_MBps": t["lanes_goodput_MBps"],
        "transport_lanes_speedup": t["lanes_speedup"],
        "bare_aioquic_cpu_ms_per_mb": t["raw_aioquic_cpu_s_per_MB"] * 1e3,
        "bare_qh3_cpu_ms_per_mb": t["raw_qh3_cpu_s_per_MB"] * 1e3,
    }


def run_lanes(mb: int) -> dict[str, Any]:
    """bench/lanes.py: two real daemons, 1 lane against 2, alternated."""
    if mb <= 0:
        return {}
    out = subprocess.run(
        [sys.executable, str(HERE / "lanes.py"), "--mb", str(mb), "--repeats", "3", "--json"],
        capture_output=True,
        text=True,
        timeout=1800,
        check=True,
    )
    t = json.loads(out.stdout.strip().splitlines()[-1])
    return {
        "one_lane_MBps": t["one_lane_MBps"],
        "two_lanes_MBps": t["lanes_MBps"],
        "one_lane_daemons_cpu_ms_per_mb": t["one_lane_cpu_ms_per_mb"],
        "two_lanes_daemons_cpu_ms_per_mb": t["lanes_cpu_ms_per_mb"],
        "lanes_speedup": t["lanes_speedup"],
        "lanes_speedup_runs": t["lanes_speedup_runs"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--params", type=float, default=1e8)
    ap.add_argument("--step-s", type=float, default=2.0)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--send-interval", type=int, default=1)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--consensus-interval", type=int, default=8)
    ap.add_argument("--fragments", type=int, default=64)
    ap.add_argument("--scenario", default=None, help="emulated WAN scenario (default loopback)")
    ap.add_argument(
        "--lanes", type=int, default=1, help="the daemons' transport.lanes in the training run"
    )
    ap.add_argument("--transport-mb", type=int, default=100, help="0: no transport section")
    ap.add_argument(
        "--lanes-mb", type=int, default=800, help="bench/lanes.py's megabytes (0: no lanes row)"
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    names = [f"n{i}" for i in range(args.nodes)]
    config = CONFIG.format(
        density=args.density,
        send_interval=args.send_interval,
        consensus_interval=args.consensus_interval,
        fragments=args.fragments,
        lanes=args.lanes,
    )
    with tempfile.TemporaryDirectory(prefix="ciuic-datapath-") as tmp:
        work = Path(tmp)
        cluster = LocalCluster(args.scenario, names, work, config_toml=config)
        try:
            cluster.start(timeout_s=120)
            result = measure(cluster, args, work)
        finally:
            cluster.stop()
    result["cores"] = os.cpu_count()
    # The training figures first (they took the longest): a failing transport section
    # must not lose them.
    print("training: " + json.dumps(result), file=sys.stderr, flush=True)
    try:
        result.update(run_transport(args.transport_mb))
    except (subprocess.SubprocessError, OSError, ValueError, KeyError) as exc:
        result["transport_error"] = str(exc)[-500:]
    try:
        result.update(run_lanes(args.lanes_mb))
    except (subprocess.SubprocessError, OSError, ValueError, KeyError) as exc:
        result["lanes_error"] = str(exc)[-500:]
    print(
        f"{args.nodes} nodes, {result['params'] / 1e6:.0f}M parameters, {args.step_s:g} s steps, "
        f"{args.density:g} density: step fraction mean {result['step_frac_mean']:.2%} "
        f"p99 {result['step_frac_p99']:.2%}; merged {result['merged_steps']}; "
        f"{result['hook_extra_bytes_per_param']:.2f} B/param; "
        f"{result['passes_per_send']:.2f} passes/send; backlog peak "
        f"{result['backlog_peak_sends']:.2f} sends; staleness p99 {result['staleness_p99_steps']}"
    )
    if args.json:
        print(json.dumps(result))
    return 0


def measure(cluster: LocalCluster, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    procs = []
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    for rank, name in enumerate(cluster.names):
        cmd = [
            sys.executable, str(HERE / "support" / "datapath_trainer.py"),
            "--socket", str(cluster.trainer_socket(name)), "--config", str(cluster.config_path),
            "--params", repr(args.params), "--step-s", repr(args.step_s),
            "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--replicas", str(args.nodes), "--rank", str(rank),
        ]  # fmt: skip
        err = (work / f"trainer-{rank}.log").open("wb")
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, env=env))
    pids = {n: cluster.daemons[n].pid for n in cluster.names}
    samples: list[tuple[float, dict[str, int], dict[str, int], dict[str, float]]] = []
    deadline = time.monotonic() + (args.steps + args.warmup) * args.step_s * 3 + 600
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        backlog, sent, cpu = {}, {}, {}
        for n in cluster.names:
            try:
                st = request(cluster.control(n), {"cmd": "status"}, timeout_s=5)
            except ControlError:  # a daemon busy past 5 s: skip the sample
                continue
            backlog[n] = int(st.get("backlog_bytes", 0))
            sent[n] = int(st.get("udp_bytes_sent", 0))
            lane_pids = (st.get("lanes") or {}).get("pids", [])
            cpu[n] = cpu_s(pids[n]) + sum(cpu_s(p) for p in lane_pids)
        samples.append((time.monotonic(), backlog, sent, cpu))
        time.sleep(0.5)
    trainers = []
    for rank, p in enumerate(procs):
        if p.poll() is None:
            p.kill()
        out = p.stdout.read().decode() if p.stdout else ""
        p.wait()
        lines = [line for line in out.splitlines() if line.startswith("{")]
        if not lines:
            log = (work / f"trainer-{rank}.log").read_text(errors="replace")
            raise SystemExit(f"trainer {rank} failed:\n{log[-3000:]}")
        trainers.append(json.loads(lines[-1]))
    return summarize(args, trainers, samples)


def summarize(
    args: argparse.Namespace,
    trainers: list[dict[str, Any]],
    samples: list[tuple[float, dict[str, int], dict[str, int], dict[str, float]]],
) -> dict[str, Any]:
    params = trainers[0]["params"]
    fracs = [h / args.step_s for t in trainers for h in t["hook_s"]]
    # The part of the hook's time spent waiting for a peer behind the staleness bound
    # (the others' slowness), apart from the hook's own work on this thread.
    waits = [w / args.step_s for t in trainers for w in t.get("wait_s", [])]
    own = [
        (h - w) / args.step_s
        for t in trainers
        for h, w in zip(t["hook_s"], t.get("wait_s", [0.0] * len(t["hook_s"])), strict=True)
    ]
    sends = sum(t["sends"] for t in trainers)
    mean_send = statistics.mean(t["bytes_published"] / max(1, t["sends_total"]) for t in trainers)
    held = max(t["held_bytes"] for t in trainers)
    rss = max(t["rss_peak"] - t["rss_without"] for t in trainers)
    extra = max(held, rss)
    # Daemons: MB/s sent and CPU per MB (sent + received on loopback: every byte sent
    # by one daemon is received by another).
    first, last = samples[len(samples) // 10], samples[-1]
    span = last[0] - first[0]
    daemon = {}
    total_sent = 0
    total_cpu = 0.0
    for n in last[2]:
        b = last[2][n] - first[2].get(n, 0)
        c = last[3][n] - first[3].get(n, 0.0)
        total_sent += b
        total_cpu += c
        daemon[n] = {"MBps_sent": b / 1e6 / max(span, 1e-9), "cpu_s": c}
    backlogs = [max(s[1].values(), default=0) for s in samples]
    third = max(1, len(backlogs) // 3)
    trend = (statistics.mean(backlogs[-third:]) + 1) / (statistics.mean(backlogs[:third]) + 1)
    result: dict[str, Any] = {
        "benchmark": "datapath",
        "nodes": args.nodes,
        "params": params,
        "step_s": args.step_s,
        "density": args.density,
        "send_interval_steps": args.send_interval,
        "transport_lanes": args.lanes,
        "steps": args.steps,
        "warmup_steps": args.warmup,
        "consensus_interval_steps": args.consensus_interval,
        "consensus_fragments": args.fragments,
        "consensus_rounds": max(len(t["consensus_steps"]) for t in trainers),
        "params_mixed": sum(t["params_mixed"] for t in trainers),
        "backoffs": sum(t["backoffs"] for t in trainers),
        "step_frac_mean": statistics.mean(fracs),
        "step_frac_p50": quantile(fracs, 0.5),
        "step_frac_p99": quantile(fracs, 0.99),
        "step_frac_own_mean": statistics.mean(own),
        "step_frac_own_p99": quantile(own, 0.99),
        "wait_frac_mean": statistics.mean(waits) if waits else 0.0,
        "wait_frac_p99": quantile(waits, 0.99) if waits else 0.0,
        "encoder_busy_frac": max(
            t.get("encode_busy_s", 0.0) / max(1e-9, t["elapsed_s"]) for t in trainers
        ),
        "snapshots_sent": sum(t["snapshots_sent"] for t in trainers),
        "slow_steps": [x for t in trainers for x in t.get("slow_steps", [])][:40],
        "rss_jumps_in_step": [x for t in trainers for x in t.get("rss_jumps", [])][:40],
        "hook_ms_p50": quantile([h * 1e3 for t in trainers for h in t["hook_s"]], 0.5),
        "compute_ms_p50": quantile([c * 1e3 for t in trainers for c in t["compute_s"]], 0.5),
        "merged_steps": sum(t["merged_steps"] for t in trainers),
        "hook_extra_bytes_per_param": extra / params,
        "hook_held_bytes_per_param": max(t["held_bytes"] for t in trainers) / params,
        "hook_rss_bytes_per_param": max(t["rss_peak"] - t["rss_without"] for t in trainers)
        / params,
        "rss_at_attach_bytes_per_param": max(t["rss_attached"] - t["rss_without"] for t in trainers)
        / params,
        "passes_per_send": sum(t["traffic_bytes"] for t in trainers) / max(1, sends) / (4 * params),
        "mean_send_bytes": mean_send,
        "daemon_MBps_sent": {n: round(d["MBps_sent"], 3) for n, d in daemon.items()},
        "daemon_cpu_ms_per_mb": total_cpu * 1e3 / max(1e-9, 2 * total_sent / 1e6),
        "backlog_peak_sends": max(backlogs, default=0) / max(1.0, mean_send),
        "backlog_trend": trend,
        "refused": {k: v for t in trainers for k, v in t["refused"].items()},
        "finished_complete": all(t["complete"] for t in trainers),
        # finish(): the residual sent dense, then the last round (each replica's fp16
        # copy published once, the others' averaged in).
        "finish_s_max": max(t.get("finish_s", 0.0) for t in trainers),
        "finish_published_mb_max": max(t.get("finish_published_bytes", 0) for t in trainers) / 1e6,
        "final_round_complete": all(
            (t.get("final_round") or {}).get("complete", False) for t in trainers
        ),
        "final_round_s_max": max(
            (t.get("final_round") or {}).get("seconds", 0.0) for t in trainers
        ),
        "machine_note": "trainers' compute padded to step_s with sleep (host CPU free)",
    }
    result.update(staleness(trainers))
    return result


if __name__ == "__main__":
    sys.exit(main())
