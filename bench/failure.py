#!/usr/bin/env python3
"""Failure detection benchmark on the 11-city scenario, on virtual time (the pure
membership cores on emulator.model.simulator; the same code the daemon runs).

With one configuration throughout (the WAN preset's mesh section):

- detection: a formed 11-node mesh, one random node crashes (stops sending); the time
  until every survivor marks it failed; median and max over ``--reps`` seeds;
- false positives: every link with 2% loss and 30 ms jitter (normal, reordering) for
  ``--fp-hours`` of virtual time; every failure declaration about a live node counts;
  reported per node-hour, with the node-hours run;
- join convergence: a new node joins a formed mesh of 10 through one member; the
  time until every member knows it alive; median over the seeds.
- messages per node per second in steady state, and the simulation's speed.

    python bench/failure.py --json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
import time

from ciuic_p2p.config import Config
from ciuic_p2p.core.mesh.members import State
from ciuic_p2p.data import scenario_path
from ciuic_p2p.emulator.meshsim import SimMesh
from ciuic_p2p.emulator.model.scenario import Scenario
from ciuic_p2p.emulator.scenarios import load_scenario


def cities(loss: float = 0.0, jitter_s: float | None = None, seed: int = 11) -> Scenario:
    scenario = load_scenario(scenario_path("cities11"))
    links = scenario.links
    if loss or jitter_s is not None:
        links = {
            k: dataclasses.replace(
                v,
                loss=loss,
                jitter_s=v.jitter_s if jitter_s is None else jitter_s,
                reorder=jitter_s is not None or v.reorder,
            )
            for k, v in links.items()
        }
    return dataclasses.replace(scenario, links=links, seed=seed)


def formed(scenario: Scenario, seed: int, names: list[str] | None = None) -> SimMesh:
    settings = Config.wan().mesh
    sim = SimMesh(scenario, settings, names=names, seed=seed)
    names = sim.names
    sim.start(names[0])
    for n in names[1:]:
        sim.start(n, join_through=names[0])
    sim.run_until_true(lambda: sim.agree(names), limit_s=60)
    sim.run_for(20)  # RTTs measured: probe deadlines follow them
    return sim


def detection(reps: int) -> dict[str, float]:
    times = []
    for seed in range(reps):
        sim = formed(cities(seed=seed), seed)
        rng = random.Random(seed)
        sim.run_for(rng.uniform(0, 5))
        victim = rng.choice(sim.names)
        sim.kill(victim)
        times.append(sim.run_until_true(lambda s=sim, v=victim: s.all_mark(v), 60, step_s=0.01))
    return {
        "detect_p50_s": statistics.median(times),
        "detect_max_s": max(times),
        "detect_reps": reps,
    }


def false_positives(hours: float) -> dict[str, float]:
    sim = formed(cities(loss=0.02, jitter_s=0.03), seed=1000)
    t0 = time.perf_counter()
    sent0 = sum(n.messages_sent for n in sim.nodes.values())
    start = sim.now
    sim.run_for(hours * 3600)
    wall = time.perf_counter() - t0
    declared = sum(
        1
        for events in sim.member_events.values()
        for e in events
        if e.state >= State.DEAD and e.at >= start
    )
    suspected = sum(
        1
        for events in sim.member_events.values()
        for e in events
        if e.state == State.SUSPECT and e.at >= start
    )
    node_hours = len(sim.nodes) * hours
    sent = sum(n.messages_sent for n in sim.nodes.values()) - sent0
    return {
        "false_positives": declared,
        "false_positives_per_node_hour": declared / node_hours,
        "fp_node_hours": node_hours,
        "fp_suspicions_refuted": suspected,
        "msgs_per_node_s": sent / (len(sim.nodes) * hours * 3600),
        "sim_speedup": hours * 3600 / wall,
    }


def join_convergence(reps: int) -> dict[str, float]:
    times = []
    for seed in range(reps):
        scenario = cities(seed=seed)
        names = scenario.node_names()
        rng = random.Random(seed)
        newcomer = rng.choice(names)
        sim = formed(scenario, seed, names=[n for n in names if n != newcomer])
        sim.names.append(newcomer)
        sim.start(newcomer, join_through=rng.choice(sim.names[:-1]))
        times.append(sim.run_until_true(lambda s=sim, n=names: s.agree(n), 30, step_s=0.01))
    return {"join_converge_s": statistics.median(times), "join_converge_max_s": max(times)}


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--reps", type=int, default=20, help="seeds for detection and joins (20)")
    ap.add_argument(
        "--fp-hours",
        type=float,
        default=5.0,
        help="virtual hours of loss and jitter (5: 55 node-hours)",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object last")
    args = ap.parse_args()
    result: dict[str, object] = {"scenario": "cities11", "nodes": 11, "preset": "wan"}
    result |= detection(args.reps)
    result |= join_convergence(args.reps)
    result |= false_positives(args.fp_hours)
    mesh = Config.wan().mesh
    result |= {"probe_interval_s": mesh.probe_interval_s, "suspicion_mult": mesh.suspicion_mult}
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:>32}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
