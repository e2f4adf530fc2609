#!/usr/bin/env python3
"""Membership at scale: the pure cores for 100 to 1000 members on virtual time,
without sockets: the path past one machine.

Members are spread round robin over the 11 cities of the CloudPing matrix (1 ms
within a city); every link gets the 11-city scenario's small jitter and loss. The
mesh starts formed (everyone knows everyone alive), runs ``--warmup`` seconds, then
one member crashes. Reported per N: the time until every survivor marks it failed
(median over ``--reps`` crashes), messages and bytes per member per second in steady
state, and the wall time the simulation took.

    python bench/scale.py --json
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import statistics
import sys
import time

from ciuic_p2p.config import Config
from ciuic_p2p.data import scenario_path
from ciuic_p2p.emulator.meshsim import RegionNetwork, SimMesh, random_names


def city_matrix() -> tuple[list[str], dict[tuple[str, str], float]]:
    path = scenario_path("cities11").parent.parent / "wan" / "rtt_cloudping_11cities.csv"
    rtts: dict[tuple[str, str], float] = {}
    with path.open() as f:
        for row in csv.DictReader(f):
            rtts[(row["city_a"], row["city_b"])] = float(row["rtt_ms"]) / 1000
    cities = sorted({c for pair in rtts for c in pair})
    return cities, rtts


def run(n: int, reps: int, warmup_s: float, seed: int) -> dict[str, float]:
    cities, rtts = city_matrix()
    names = random_names(n, seed)
    network = RegionNetwork(
        {name: cities[i % len(cities)] for i, name in enumerate(names)},
        rtts,
        jitter_s=0.0004,
        loss=0.0005,
        seed=seed,
    )
    sim = SimMesh(None, Config.wan().mesh, network=network, names=names, seed=seed)
    t0 = time.perf_counter()
    sim.start_formed()
    sim.run_for(warmup_s / 2)
    sent0 = sum(node.messages_sent for node in sim.nodes.values())
    bytes0 = sim.net.stats.sent
    window_start = sim.now
    sim.run_for(warmup_s / 2)
    window = sim.now - window_start
    msgs = sum(node.messages_sent for node in sim.nodes.values()) - sent0
    datagrams = sim.net.stats.sent - bytes0
    rng = random.Random(seed)
    detect = []
    false_declarations = 0
    for _ in range(reps):
        victim = rng.choice(sorted(sim.nodes))
        sim.kill(victim)
        detect.append(sim.run_until_true(lambda v=victim: sim.all_mark(v), 120, step_s=0.05))
    for name in sim.nodes:
        false_declarations += sum(
            1 for e in sim.member_events[name] if e.state.name == "DEAD" and e.node in sim.nodes
        )
    return {
        "members": n,
        "detect_p50_s": statistics.median(detect),
        "detect_max_s": max(detect),
        "msgs_per_member_s": msgs / (n * window),
        "datagrams_per_member_s": datagrams / (n * window),
        "false_declarations": false_declarations,
        "wall_s": time.perf_counter() - t0,
    }


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--members", default="100,250,500,1000", help="comma-separated N")
    ap.add_argument("--reps", type=int, default=3, help="crashes per N (3)")
    ap.add_argument("--warmup", type=float, default=20.0, help="virtual seconds before (20)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", action="store_true", help="print one JSON object last")
    args = ap.parse_args()
    rows = []
    for n in (int(x) for x in args.members.split(",")):
        row = run(n, args.reps, args.warmup, args.seed)
        rows.append(row)
        if not args.json:
            print(
                "  ".join(
                    f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
                ),
                flush=True,
            )
    mesh = Config.wan().mesh
    result = {
        "rows": rows,
        "probe_interval_s": mesh.probe_interval_s,
        "members_max": rows[-1]["members"],
        "detect_p50_s_at_max": rows[-1]["detect_p50_s"],
        "msgs_per_member_s_at_max": rows[-1]["msgs_per_member_s"],
    }
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
