#!/usr/bin/env python3
"""Lanes benchmark: what two real daemons deliver with 1 lane and with K lanes.

Two ``ciuic-node run`` daemons on loopback (no emulated WAN: lanes would pass it by),
``transport.lanes`` = 1 (chunks on the node's own link) or K (K lane processes a
side). The first daemon publishes 1 MiB chunks (control ``broadcast``: the daemon
makes, signs and sends them) keeping at most ``--window`` unacknowledged by the
second's count of delivered chunks; the rate is the verified payload bytes the second
daemon delivered (its mesh checked each origin signature) over the wall time from
the first publish to the last delivery. CPU is every process of both nodes (daemons
and lanes) per MB delivered. The two settings alternate ``--repeats`` times;
``lanes_speedup`` is the median of neighbouring pairs' ratios.

    python bench/lanes.py --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ciuic_p2p.daemon.control import request
from ciuic_p2p.lab.cluster import LocalCluster
from ciuic_p2p.lab.cluster import process_cpu_s as cpu_s

CHUNK = 1 << 20
CONFIG = """preset = "local"

[transport]
lanes = {lanes}

[log]
level = "warning"
"""


def run_once(lanes: int, megabytes: int, window: int, work: Path) -> dict[str, Any]:
    with LocalCluster(None, ["a", "b"], work, CONFIG.format(lanes=lanes)) as cluster:
        cluster.start()

        def status(name: str) -> dict[str, Any]:
            answer = request(cluster.control(name), {"cmd": "status"}, timeout_s=30)
            if not answer.get("ok"):
                raise RuntimeError(f"{name}: {answer}")
            return answer

        deadline = time.monotonic() + 60
        if lanes > 1:
            while not all(status(n)["lanes"]["paired"] for n in ("a", "b")):
                if time.monotonic() > deadline:
                    raise RuntimeError("lanes never paired")
                time.sleep(0.05)
        pids = [cluster.daemons[n].pid for n in ("a", "b")]
        for n in ("a", "b"):
            pids += (status(n).get("lanes") or {}).get("pids", [])
        base = status("b")["counters"].get("chunks_delivered", 0)
        total = max(1, megabytes * 1_000_000 // CHUNK)
        cpu0 = sum(cpu_s(p) for p in pids)
        t0 = time.perf_counter()
        sent = delivered = 0
        deadline = time.monotonic() + 600
        while delivered < total:
            while sent < total and sent - delivered < window:
                answer = request(cluster.control("a"), {"cmd": "broadcast", "size": CHUNK})
                if not answer.get("ok"):
                    raise RuntimeError(f"broadcast: {answer}")
                sent += 1
            delivered = status("b")["counters"].get("chunks_delivered", 0) - base
            if time.monotonic() > deadline:
                raise RuntimeError(f"{delivered} of {total} delivered in time")
            time.sleep(0.02)
        elapsed = time.perf_counter() - t0
        cpu = sum(cpu_s(p) for p in pids) - cpu0
        received_on_lanes = sum((status("b").get("lanes") or {}).get("frames_by_lane", [0]))
        mb = total * CHUNK / 1e6
    return {
        "lanes": lanes,
        "MBps": mb / elapsed,
        "cpu_ms_per_mb": cpu / mb * 1e3,
        "chunks": total,
        "frames_on_lanes": received_on_lanes,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--mb", type=int, default=150, help="megabytes per measurement")
    ap.add_argument("--lanes", type=int, default=2)
    ap.add_argument("--window", type=int, default=48, help="chunks in flight at most")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    pairs = []
    with tempfile.TemporaryDirectory(prefix="ciuic-lanes-") as tmp:
        for i in range(max(1, args.repeats)):
            one = run_once(1, args.mb, args.window, Path(tmp) / f"one{i}")
            many = run_once(args.lanes, args.mb, args.window, Path(tmp) / f"many{i}")
            pairs.append((one, many))
            print(
                f"pair {i}: 1 lane {one['MBps']:.1f} MB/s ({one['cpu_ms_per_mb']:.1f} ms CPU/MB), "
                f"{args.lanes} lanes {many['MBps']:.1f} MB/s ({many['cpu_ms_per_mb']:.1f} ms "
                f"CPU/MB, {many['frames_on_lanes']} chunks on lanes)",
                flush=True,
            )
    speedups = [many["MBps"] / one["MBps"] for one, many in pairs]
    result = {
        "benchmark": "lanes",
        "lanes": args.lanes,
        "megabytes": args.mb,
        "one_lane_MBps": statistics.median(one["MBps"] for one, _ in pairs),
        "lanes_MBps": statistics.median(many["MBps"] for _, many in pairs),
        "one_lane_cpu_ms_per_mb": statistics.median(one["cpu_ms_per_mb"] for one, _ in pairs),
        "lanes_cpu_ms_per_mb": statistics.median(many["cpu_ms_per_mb"] for _, many in pairs),
        "lanes_speedup": statistics.median(speedups),
        "lanes_speedup_runs": speedups,
        "cores": os.cpu_count(),
        "python": sys.version.split()[0],
    }
    print(
        f"daemons, 1 lane {result['one_lane_MBps']:.1f} MB/s, {args.lanes} lanes "
        f"{result['lanes_MBps']:.1f} MB/s on {result['cores']} cores: "
        f"{result['lanes_speedup']:.2f}x (pairs {', '.join(f'{s:.2f}' for s in speedups)})"
    )
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
