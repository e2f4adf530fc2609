#!/usr/bin/env python3
"""Dissemination benchmark: real daemons (QUIC, membership, routing, forwarding) in
one process on an emulated WAN built from an RTT matrix (and optionally a bandwidth
matrix), one node per region unless ``--nodes`` says otherwise.

From every origin in turn, one broadcast at a time: ``--small`` broadcasts of 4 KB
and ``--large`` of 1 MB. For each, the time from the broadcast call until the last
live node has delivered the chunk, divided by the optimum computed from the same
matrix: the largest, over destinations, of the least sum over a path's hops of the
one-way delay plus the serialization time of the chunk at that link's rate (store and
forward, as relays do). Without ``--bandwidth`` every link gets ``--default-gbps``
(1 Gbit/s). Rates are multiplied by ``--rate-scale`` (default 0.01: pure-Python QUIC
for several nodes on one machine cannot fill real inter-region links) and reported.

The same runs for three strategies, each a fresh mesh with the same seed:
``tree`` (ours: routed trees, each shaped for the chunk's size; the nodes are told
their links are independent, ``mesh.node_uplink_bps = inf``, as the emulator's are,
unless ``--node-uplink-bps`` says otherwise), ``direct`` (origin to every node) and
``gossip`` (random push to 3 peers, with the same repair).

    python bench/dissemination.py --rtt ciuic_p2p/data/wan/rtt_multicloud_8regions.csv --json
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import heapq
import json
import math
import statistics
import sys
import time
import typing
from pathlib import Path
from typing import Any

from ciuic_p2p.config import Config, Dissemination, LogSection
from ciuic_p2p.core.mesh.broadcast import Delivery
from ciuic_p2p.daemon.node import ChunkRecorder
from ciuic_p2p.emulator.model.scenario import Scenario, scenario_from_matrix
from ciuic_p2p.lab.daemons import DaemonMesh
from ciuic_p2p.logsetup import configure_logging
from ciuic_p2p.transport.loop import new_event_loop

SMALL = 4096
LARGE = 1_000_000


def optimum_s(scenario: Scenario, origin: str, size: int) -> float:
    """Largest over destinations of the least store-and-forward path time."""
    names = scenario.node_names()
    best: dict[str, float] = {}
    heap = [(0.0, origin)]
    while heap:
        t, u = heapq.heappop(heap)
        if u in best:
            continue
        best[u] = t
        for v in names:
            if v in best or v == u:
                continue
            p = scenario.params(u, v)
            ser = 0.0 if p.rate_bps is None else size * 8 / p.rate_bps
            heapq.heappush(heap, (t + p.delay_s + ser, v))
    return max(t for n, t in best.items() if n != origin)


async def run_mode(
    scenario: Scenario,
    mode: Dissemination,
    small: int,
    large: int,
    settle_s: float,
    rate_bps: float,
    uplink_bps: float = math.inf,
    pace_gain: float | None = None,
    large_warmup: int = 0,
) -> dict[str, list[float]]:
    """Ratios to the optimum by label: ``small``, ``large``, ``large_warmup`` (the
    ``large_warmup`` passes over the origins before the ``large`` ones: their traffic
    measures the links' rates, which then pace them), and ``missing``."""
    base = Config.wan()
    mesh_cfg = dataclasses.replace(
        base.mesh,
        dissemination=mode,
        tree_chunk_bytes=SMALL,
        default_rate_bps=rate_bps,
        node_uplink_bps=uplink_bps,
        pace_gain=base.mesh.pace_gain if pace_gain is None else pace_gain,
    )
    config = dataclasses.replace(base, mesh=mesh_cfg)
    names = scenario.node_names()
    arrivals: dict[tuple[str, int], dict[str, float]] = {}
    ratios: dict[str, list[float]] = {"small": [], "large": [], "large_warmup": [], "missing": []}

    def recorder(who: str) -> ChunkRecorder:
        def record(d: Delivery) -> None:
            arrivals.setdefault((d.origin, d.seq), {})[who] = time.monotonic()

        return ChunkRecorder(record)

    async with DaemonMesh(scenario, names, config, observer=recorder, trainers=False) as mesh:
        await mesh.form()
        await asyncio.sleep(settle_s)  # every link measured and published: trees agree
        passes = (
            ("small", SMALL, small),
            ("large_warmup", LARGE, large_warmup),
            ("large", LARGE, large),
        )
        for label, size, count in passes:
            for _ in range(count):
                for origin in names:
                    daemon = mesh.daemons[origin]
                    payload = bytes(size)
                    t0 = time.monotonic()
                    seq = daemon.broadcast(payload)
                    key = (daemon.peer_id, seq)
                    try:
                        await mesh.until(
                            lambda k=key: len(arrivals.get(k, {})) == len(names) - 1, 60
                        )
                    except TimeoutError:
                        ratios["missing"].append(1.0)
                        continue
                    took = max(arrivals[key].values()) - t0
                    ratios[label].append(took / optimum_s(scenario, origin, size))
                    await asyncio.sleep(0.05)
    return ratios


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rtt", required=True, help="RTT matrix CSV (region_a, region_b, rtt_ms)")
    ap.add_argument("--bandwidth", help="bandwidth matrix CSV (Gbit/s per pair)")
    ap.add_argument("--bandwidth-column", default="dtfm_gbps_2022")
    ap.add_argument("--default-gbps", type=float, default=1.0, help="rate where none is given (1)")
    ap.add_argument("--rate-scale", type=float, default=0.01, help="multiplies every rate (0.01)")
    ap.add_argument("--nodes", type=int, default=0, help="first N regions (0: all)")
    ap.add_argument("--small", type=int, default=3, help="4 KB broadcasts per origin (3)")
    ap.add_argument("--large", type=int, default=1, help="1 MB broadcasts per origin (1)")
    ap.add_argument(
        "--large-warmup",
        type=int,
        default=0,
        help="1 MB broadcasts per origin before those, reported apart (0): their traffic "
        "measures the links' rates, which then pace them",
    )
    ap.add_argument("--settle", type=float, default=12.0, help="seconds after forming (12)")
    ap.add_argument("--modes", default="tree,direct,gossip")
    ap.add_argument(
        "--node-uplink-bps",
        type=float,
        default=math.inf,
        help="what the nodes are told their links share (mesh.node_uplink_bps; inf, as "
        "the emulator's links are independent; 0: the old assumption, copies one by one)",
    )
    ap.add_argument(
        "--queue-ms",
        type=float,
        default=0.0,
        help="each link's queue in ms of its rate (0: the emulator's, 50 ms); a long one "
        "shows what QUIC's overshoot into a short one costs",
    )
    ap.add_argument(
        "--pace-gain", type=float, help="mesh.pace_gain (the WAN preset's; 0: no pacing)"
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object last")
    args = ap.parse_args()
    configure_logging(LogSection(level="error"))
    scenario = scenario_from_matrix(
        Path(args.rtt).read_text(),
        Path(args.bandwidth).read_text() if args.bandwidth else None,
        bandwidth_column=args.bandwidth_column,
        default_rate_gbps=args.default_gbps,
        seed=7,
        rate_scale=args.rate_scale,
    )
    if args.nodes:
        scenario = scenario.subset(scenario.node_names()[: args.nodes])
    if args.queue_ms > 0:
        scenario = dataclasses.replace(
            scenario,
            links={
                k: v.with_changes(queue_bytes=int((v.rate_bps or 0) * args.queue_ms / 8000))
                if v.rate_bps
                else v
                for k, v in scenario.links.items()
            },
        )
    rates = [p.rate_bps for p in scenario.links.values() if p.rate_bps]
    rate_bps = statistics.median(rates) if rates else args.default_gbps * 1e9 * args.rate_scale
    result: dict[str, Any] = {
        "rtt_csv": args.rtt,
        "bandwidth_csv": args.bandwidth,
        "nodes": len(scenario.nodes),
        "regions": scenario.node_names(),
        "rate_scale": args.rate_scale,
        "median_link_rate_mbps": rate_bps / 1e6,
        "node_uplink_bps": args.node_uplink_bps,
        "queue_ms": args.queue_ms or 50.0,
        "pace_gain": Config.wan().mesh.pace_gain if args.pace_gain is None else args.pace_gain,
    }
    loop = new_event_loop()
    try:
        for raw_mode in args.modes.split(","):
            if raw_mode not in typing.get_args(Dissemination):
                ap.error(f"--modes: {raw_mode!r} is not one of {typing.get_args(Dissemination)}")
            mode = typing.cast(Dissemination, raw_mode)
            t0 = time.monotonic()
            r = loop.run_until_complete(
                run_mode(
                    scenario,
                    mode,
                    args.small,
                    args.large,
                    args.settle,
                    rate_bps,
                    args.node_uplink_bps,
                    args.pace_gain,
                    args.large_warmup,
                )
            )
            prefix = "" if mode == "tree" else f"{mode}_"
            result[f"{prefix}small_p50_ratio_vs_optimal"] = pct(r["small"], 50)
            result[f"{prefix}small_p90_ratio_vs_optimal"] = pct(r["small"], 90)
            result[f"{prefix}large_p50_ratio_vs_optimal"] = pct(r["large"], 50)
            result[f"{prefix}large_p90_ratio_vs_optimal"] = pct(r["large"], 90)
            n = len(scenario.nodes)  # one broadcast per origin a round: p50 per round
            for label in ("large_warmup", "large"):
                result[f"{prefix}{label}_p50_by_round"] = [
                    pct(r[label][i : i + n], 50) for i in range(0, len(r[label]), n)
                ]
            result[f"{prefix}broadcasts"] = (
                len(r["small"]) + len(r["large"]) + len(r["large_warmup"])
            )
            result[f"{prefix}incomplete"] = len(r["missing"])
            result[f"{prefix}wall_s"] = round(time.monotonic() - t0, 1)
            if not args.json:
                print(
                    mode,
                    {k: v for k, v in result.items() if k.startswith(prefix) or not prefix},
                    flush=True,
                )
    finally:
        loop.close()
    if result.get("direct_small_p50_ratio_vs_optimal") and result.get("small_p50_ratio_vs_optimal"):
        result["tree_vs_direct_small_p50"] = (
            result["small_p50_ratio_vs_optimal"] / result["direct_small_p50_ratio_vs_optimal"]
        )
    if args.json:
        print(json.dumps(result))
    else:
        print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
