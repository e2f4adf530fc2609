#!/usr/bin/env python3
"""Sync-strategy benchmark: the round time of each fixed strategy (``tree``, ``ring``,
``hierarchical``) and of the automatic choice, with real daemons (QUIC, membership,
routing, forwarding) in one process on emulated WANs.

A round: every node broadcasts a payload of ``--payloads`` bytes at once (in pieces of
at most 1 MiB, as a trainer's chunks go, named as one round); it ends when every node
has every other node's whole payload. Round time: from the round's start until then.
Each (scenario, strategy, payload) runs in a fresh mesh with the same seed: formed,
``--settle`` seconds for every link to be measured and published (with
``--rate-probe-bytes``, filler down each, core.link.rateprobe; none by default),
``--warmup-rounds`` rounds (2) whose bulk frames measure the links' rates, which are
then published and pace the links (their times are reported as ``warmup_s``, not counted), then
``--rounds`` measured rounds. A training run repeats its round hundreds of times: the
measured rounds are what it spends on most of them; the warm-up rounds are what its
first ones cost. A link's rate is measured only from the traffic it carries, and a
paced link reads no faster than its pace (1.5x the last reading), so the pace climbs
over the first rounds: on the star, one 2.1 MB tree run took 51.7 s for the first
round after one warm-up, then 27.8, 25.4, 24.2 and 24.7 s. ``auto`` decides from the
published state alone, in its own run (it does not try the others). The model's
prediction for each strategy comes from the first node's published state at each
round's start (core.mesh.roundcost.predict_round_s).

Scenarios (``--rtt FILE`` adds any RTT matrix, the first ``--nodes`` regions):

- ``cities11``: the shipped 11-city matrix and its measured bandwidths;
- ``multicloud``: the shipped 8-region multi-cloud matrix, 1 Gbit/s per pair;
- ``two-regions``: four nodes in each of two regions, 1 ms and 10 Gbit/s inside,
  80 ms and 0.5 Gbit/s between;
- ``star``: a hub and five leaves, 10 ms and 2.5 Gbit/s between hub and leaf, 150 ms
  and 0.25 Gbit/s between leaves: every direct path between leaves is slow.

Every node's uplink is ``--uplink-gbps`` (1), shared by its links, and the nodes are
told so (``mesh.node_uplink_bps``, and ``default_rate_bps`` for links not measured
yet); every rate times ``--rate-scale`` (0.02; several pure-Python daemons on one
machine cannot fill real inter-region links), and for payloads of 64 KiB and more
times ``--large-rate-scale`` (0.01): the six daemons of one process spent about 11 s
of CPU on each 2.1 MB round, as long as the links took at 0.02.

    python bench/strategy.py --json
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from ciuic_p2p.config import Config, LogSection
from ciuic_p2p.core.mesh.broadcast import REPAIRED_HOPS, Delivery
from ciuic_p2p.core.mesh.linkcosts import STRATEGIES
from ciuic_p2p.daemon.node import ChunkRecorder
from ciuic_p2p.data import WAN_DIR
from ciuic_p2p.emulator.model.scenario import Scenario, scenario_from_mapping, scenario_from_matrix
from ciuic_p2p.lab.daemons import DaemonMesh
from ciuic_p2p.logsetup import configure_logging
from ciuic_p2p.transport.loop import new_event_loop

PIECE = 1 << 20
SHAKESPEARE_OUTER_BYTES = 2_400
"""The outer-step mode's default pseudo-gradient of the Shakespeare model, per node and
round: 425k parameters at 1.56% and 2 bits, Rice-coded positions (bench/training.py
measured 2,242 bytes per node and step of UDP payload at H=30 with control; one round's
chunks are about 2.4 kB)."""
UPDATE_BYTES = 2_100_000
"""One send of a 100M-parameter model's update at 1% density (bench/datapath.py)."""
SMALL_BYTES = 64 * 1024
"""Payloads under this get ``--small-rounds`` measured rounds."""


def uniform_pairs(
    groups: dict[str, list[str]], inside: tuple[float, float], between: tuple[float, float]
) -> list[dict[str, Any]]:
    """Links for nodes in groups: (RTT ms, Gbit/s) inside a group and between groups."""
    nodes = [(g, n) for g, names in groups.items() for n in names]
    links = []
    for i, (ga, a) in enumerate(nodes):
        for gb, b in nodes[i + 1 :]:
            rtt, gbps = inside if ga == gb else between
            links.append(
                {
                    "src": a,
                    "dst": b,
                    "symmetric": True,
                    "delay_ms": rtt / 2,
                    "rate_mbps": gbps * 1e3,
                }
            )
    return links


def built_scenario(name: str, rate_scale: float, uplink_gbps: float) -> Scenario:
    if name == "two-regions":
        groups = {"west": [f"w{i}" for i in range(4)], "east": [f"e{i}" for i in range(4)]}
        links = uniform_pairs(groups, (1.0, 10.0), (80.0, 0.5))
    else:  # star: the hub is one group, each leaf its own
        groups = {"hub": ["hub"], **{f"l{i}": [f"leaf{i}"] for i in range(5)}}
        links = uniform_pairs(groups, (10.0, 2.5), (150.0, 0.25))
        for link in links:
            if "hub" in (link["src"], link["dst"]):
                link.update(delay_ms=5.0, rate_mbps=2.5e3)
    scaled = [{**link, "rate_mbps": link["rate_mbps"] * rate_scale} for link in links]
    nodes = [{"name": n, "region": g} for g, names in groups.items() for n in names]
    return scenario_from_mapping(
        {
            "seed": 7,
            "rate_scale": rate_scale,
            "uplink_gbps": uplink_gbps,
            "nodes": nodes,
            "links": scaled,
        }
    )


def matrix_scenario(
    rtt_csv: Path, bandwidth_csv: Path | None, nodes: int, rate_scale: float, uplink_gbps: float
) -> Scenario:
    base = scenario_from_matrix(
        rtt_csv.read_text(),
        bandwidth_csv.read_text() if bandwidth_csv else None,
        seed=7,
        rate_scale=rate_scale,
    )
    if nodes:
        base = base.subset(base.node_names()[:nodes])
    return dataclasses.replace(
        base,
        nodes=tuple(
            dataclasses.replace(n, uplink_bps=uplink_gbps * 1e9 * rate_scale) for n in base.nodes
        ),
    )


async def run_rounds(
    scenario: Scenario,
    strategy: str,
    payload: int,
    rounds: int,
    settle_s: float,
    timeout_s: float,
    warmup: int = 2,
    carry_plans: bool = True,
    rate_probe_bytes: int | None = None,
) -> dict[str, Any]:
    names = scenario.node_names()
    uplink = min(n.uplink_bps or 0.0 for n in scenario.nodes)
    base = Config.wan()
    # The nodes know their uplink (their NIC's rate, scaled as every rate is) and take
    # it for a link no transfer has measured yet.
    mesh_cfg = dataclasses.replace(
        base.mesh,
        strategy=strategy,  # type: ignore[arg-type]
        carry_plans=carry_plans,
        rate_probe_bytes=(
            base.mesh.rate_probe_bytes if rate_probe_bytes is None else rate_probe_bytes
        ),
        node_uplink_bps=uplink,
        default_rate_bps=uplink or base.mesh.default_rate_bps,
    )
    config = dataclasses.replace(base, mesh=mesh_cfg)
    pieces = [PIECE] * (payload // PIECE) + ([payload % PIECE] if payload % PIECE else [])
    got: dict[int, dict[str, int]] = {}
    done_at: dict[int, float] = {}
    arrivals: dict[int, list[tuple[float, int]]] = {}
    need = (len(names) - 1) * len(pieces)

    def recorder(who: str) -> ChunkRecorder:
        def record(d: Delivery) -> None:
            r = int.from_bytes(d.payload[:4], "little")
            per = got.setdefault(r, {})
            per[who] = per.get(who, 0) + 1
            arrivals.setdefault(r, []).append((time.monotonic(), d.hops))
            if all(per.get(n, 0) >= need for n in names):
                done_at.setdefault(r, time.monotonic())

        return ChunkRecorder(record)

    out: dict[str, Any] = {
        "round_s": [],
        "warmup_s": [],
        "cpu_share": [],
        "tail": [],
        "predicted_s": [],
        "chosen": [],
        "chosen_by_origin": [],
        "chooser": [],
        "same_plan": [],
    }
    async with DaemonMesh(scenario, names, config, observer=recorder, trainers=False) as mesh:
        await mesh.form()
        await asyncio.sleep(settle_s)
        first = mesh.daemons[names[0]].mesh
        for r in range(warmup + rounds):  # the first rounds measure the links
            chosen = strategy
            if strategy != "auto":
                predicted = first.predict_round_s(strategy, payload)  # type: ignore[arg-type]
            if r >= warmup:
                out["same_plan"].append([list(g) for g in first.same_plan(payload) if len(g) > 1])
            t0, cpu0 = time.monotonic(), time.process_time()
            for n in names:
                daemon = mesh.daemons[n]
                for piece in pieces:
                    body = r.to_bytes(4, "little") + bytes(max(0, piece - 4))
                    daemon.broadcast(body, round_id=r, round_bytes=payload)
            if strategy == "auto":
                status = first.strategy()
                chosen = str(status["strategy"])
                predicted = first.predict_round_s(chosen, payload)  # type: ignore[arg-type]
                # Each origin chooses for its own payloads: the round ends with the
                # slowest of them, so every origin's choice is reported.
                if r >= warmup:
                    out["chosen_by_origin"].append(
                        {n: str(mesh.daemons[n].mesh.strategy()["strategy"]) for n in names}
                    )
                    # What the first node's chooser saw: every strategy's prediction,
                    # and those it would not switch to (links with no measured rate).
                    out["chooser"].append(
                        {k: status[k] for k in ("predicted_s", "unmeasured", "switches")}
                    )
            try:
                await mesh.until(lambda r=r: r in done_at, timeout_s)
                took = done_at[r] - t0
            except TimeoutError:
                took = float("inf")
            # The whole mesh (daemons, QUIC, emulator) is this one process: near 1.0
            # of a core, the round waited for the CPU, not for the links.
            cpu_s = time.process_time() - cpu0
            wall_s = time.monotonic() - t0
            if r < warmup:
                out["warmup_s"].append(took)
            else:
                out["round_s"].append(took)
                out["cpu_share"].append(round(cpu_s / wall_s, 3))
                # A round's tail: from when 95% of its deliveries were in to its last,
                # and whether that last came by repair (a copy waited for, then asked).
                got_r = sorted(arrivals.get(r, []))
                if got_r:
                    p95 = got_r[int(0.95 * (len(got_r) - 1))][0]
                    out["tail"].append(
                        {
                            "tail_s": round(got_r[-1][0] - p95, 2),
                            "repaired": got_r[-1][1] >= REPAIRED_HOPS,
                            "repaired_n": sum(1 for _, h in got_r if h >= REPAIRED_HOPS),
                        }
                    )
                out["predicted_s"].append(predicted)
                out["chosen"].append(chosen)
            await asyncio.sleep(0.2)
        net = mesh.emulated.network
        models = [*net.links.values(), *net.uplinks.values()]
        # Whole run (warm-up and mesh upkeep included): the emulator's tail drops, in
        # the links' queues (50 ms of their rate) and the uplinks' (1.5 MB), that QUIC
        # had to recover from.
        out["datagrams"] = sum(m.counters.sent for m in net.links.values())
        out["queue_drops"] = sum(m.counters.queue_drops for m in models)
        spread = [mesh.daemons[n].mesh.dissemination for n in names]
        # Chunks fetched by HEADS/WANT repair, and copies that arrived twice: with no
        # node dying, each is a piece that was still on its way when asked for again.
        out["repaired"] = sum(x.repaired for x in spread)
        out["duplicates"] = sum(x.duplicates for x in spread)
        out["lost"] = sum(x.lost for x in spread)
        out["plans_refused"] = sum(x.plans_refused for x in spread)
        # Copies not sent again because one handed to the same link was on its way.
        # Probes answered late whose target's chunks came meanwhile, and suspicions
        # not turned into deaths for the same reason (core.mesh.membership).
        members = [mesh.daemons[n].mesh.membership for n in names]
        out["probes_answered_by_traffic"] = sum(m.probes_answered_by_traffic for m in members)
        out["deaths_withheld"] = sum(m.deaths_withheld for m in members)
        out["in_flight_refused"] = sum(mesh.daemons[n].counters["chunks_in_flight"] for n in names)
        # Filler sent to measure links (core.link.rateprobe), by why.
        out["rate_probes"] = {
            why: sum(mesh.daemons[n].link_rates.probes.sent[why] for n in names)
            for why in ("unmeasured", "low")
        }
    return out


def scenarios_of(args: argparse.Namespace, rate_scale: float) -> dict[str, Scenario]:
    out: dict[str, Scenario] = {}
    for name in args.scenarios.split(","):
        if name == "cities11":
            out[name] = matrix_scenario(
                WAN_DIR / "rtt_cloudping_11cities.csv", WAN_DIR / "bandwidth_11cities.csv",
                args.nodes, rate_scale, args.uplink_gbps,
            )  # fmt: skip
        elif name == "multicloud":
            out[name] = matrix_scenario(
                WAN_DIR / "rtt_multicloud_8regions.csv", None,
                args.nodes, rate_scale, args.uplink_gbps,
            )  # fmt: skip
        elif name in ("two-regions", "star"):
            out[name] = built_scenario(name, rate_scale, args.uplink_gbps)
        else:
            raise SystemExit(f"--scenarios: unknown {name!r}")
    for path in args.rtt:
        out[Path(path).stem] = matrix_scenario(
            Path(path), None, args.nodes, rate_scale, args.uplink_gbps
        )
    return out


def pooled(row: dict[str, Any], strategies: list[str]) -> dict[str, float]:
    """Each fixed strategy's round time, the rounds of strategies that sent by the same
    trees pooled (their median): two names for one plan (the star's ``hierarchical``
    is its ``tree``: all six nodes one cluster) are one strategy measured twice, and the
    faster of two runs of one plan is the luckier run, not the better strategy. Pooled
    only when both runs' first node saw the same plan at every measured round."""
    fixed = [s for s in strategies if s != "auto" and s in row]

    def same(a: str, b: str) -> bool:
        return all(
            any(a in g and b in g for g in seen)
            for s in (a, b)
            for seen in row[s].get("same_plan") or [[]]
        )

    out: dict[str, float] = {}
    for s in fixed:
        rounds = [x for t in fixed if t == s or same(s, t) for x in row[t]["rounds_s"]]
        out[s] = statistics.median(rounds)
    return out


def summarize(row: dict[str, Any], strategies: list[str]) -> None:
    """The row's best fixed strategy, its lead over the worst, and how auto did
    (``*_unpooled``: each strategy's own run, plans shared or not)."""
    own = {s: row[s]["round_s"] for s in strategies if s != "auto" and s in row}
    if not own:
        return
    fixed = pooled(row, strategies)
    row["pooled_round_s"] = fixed
    best = min(fixed, key=lambda s: (fixed[s], strategies.index(s)))
    row["best"] = best
    row["best_over_worst"] = max(fixed.values()) / fixed[best]
    if "auto" in row:
        measured = row["auto"]["round_s"]
        row["auto_over_best"] = measured / fixed[best]
        row["auto_over_best_unpooled"] = measured / min(own.values())
        row["model_error"] = abs(row["auto"]["predicted_s"] - measured) / measured
        row["auto_chose"] = row["auto"]["chosen"][-1]
        # Whether auto sent every measured round by the best strategy's plan (its own
        # name, or one its first node saw sending by the same trees): then its lead or
        # lag over the best is two runs of one plan, the spread of the harness.
        seen_by_best = row[best].get("same_plan") or [[]]
        row["auto_chose_best"] = all(
            c == best or all(any(c in g and best in g for g in seen) for seen in seen_by_best)
            for c in row["auto"]["chosen"]
        )


def tree_large_ratio() -> dict[str, float | None]:
    """bench/dissemination.py's 1 MB tree row on the multi-cloud matrix at rate scale
    0.01: the p50 of one broadcast per origin over its store-and-forward optimum, over
    two passes after two warm-up passes (their traffic measures the links' rates, which
    then pace them: the issue asks for the ratio "with measured rates"), and the p50 of
    the first (cold) pass."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import dissemination  # noqa: PLC0415

    mc = scenario_from_matrix(
        (WAN_DIR / "rtt_multicloud_8regions.csv").read_text(), None, seed=7, rate_scale=0.01
    )
    rates = [p.rate_bps for p in mc.links.values() if p.rate_bps]
    loop = new_event_loop()
    try:
        ratios = loop.run_until_complete(
            dissemination.run_mode(mc, "tree", 0, 2, 12.0, statistics.median(rates), large_warmup=2)
        )
    finally:
        loop.close()
    cold = ratios["large_warmup"][: len(mc.nodes)]
    return {
        "warm": dissemination.pct(ratios["large"], 50),
        "cold": dissemination.pct(cold, 50),
    }


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rtt", action="append", default=[], help="another RTT matrix (CSV)")
    ap.add_argument("--nodes", type=int, default=6, help="regions of a matrix scenario (6)")
    ap.add_argument("--rate-scale", type=float, default=0.02)
    ap.add_argument(
        "--large-rate-scale",
        type=float,
        default=0.01,
        help="rate scale for payloads of 64 KiB and more (0.01): at 0.02 the six daemons "
        "in this one process needed as much CPU per 2.1 MB round (11 s) as the links took",
    )
    ap.add_argument("--uplink-gbps", type=float, default=1.0)
    ap.add_argument("--payloads", default=f"{SHAKESPEARE_OUTER_BYTES},{UPDATE_BYTES}")
    ap.add_argument(
        "--rounds",
        type=int,
        default=9,
        help="measured rounds per run (9: the multi-cloud tree's 2.1 MB rounds land near "
        "11 s or near 15 s, and two 5-round runs of the same trees had medians 1.21x apart)",
    )
    ap.add_argument(
        "--warmup-rounds",
        type=int,
        default=2,
        help="rounds before those, not counted (2): their traffic measures the links",
    )
    ap.add_argument(
        "--small-rounds",
        type=int,
        default=9,
        help="measured rounds per run for payloads under 64 KiB (9: they take 0.1 s, and "
        "on 1 ms links one scheduling hiccup is most of one)",
    )
    ap.add_argument("--settle", type=float, default=8.0)
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds a round may take")
    ap.add_argument("--scenarios", default="cities11,multicloud,two-regions,star")
    ap.add_argument("--strategies", default="tree,ring,hierarchical,auto")
    ap.add_argument(
        "--no-carry-plans",
        action="store_true",
        help="large pieces carry no plan: every relay forwards by its own trees "
        "(mesh.carry_plans false; the behaviour before it)",
    )
    ap.add_argument(
        "--rate-probe-bytes",
        type=int,
        default=Config.wan().mesh.rate_probe_bytes,
        help="mesh.rate_probe_bytes: filler that measures links the traffic leaves "
        "unmeasured or reading low (core.link.rateprobe; the config's default: none)",
    )
    ap.add_argument("--skip-dissemination", action="store_true", help="no 1 MB tree row")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    configure_logging(LogSection(level="error"))
    scenarios = scenarios_of(args, args.rate_scale)
    large_scenarios = scenarios_of(args, args.large_rate_scale)
    strategies = args.strategies.split(",")
    for s in strategies:
        if s != "auto" and s not in STRATEGIES:
            ap.error(f"--strategies: unknown {s!r}")
    payloads = [int(p) for p in args.payloads.split(",")]
    table: list[dict[str, Any]] = []
    loop = new_event_loop()
    try:
        for sname in scenarios:
            for payload in payloads:
                small = payload < SMALL_BYTES
                scenario = scenarios[sname] if small else large_scenarios[sname]
                row: dict[str, Any] = {
                    "scenario": sname,
                    "nodes": scenario.node_names(),
                    "payload_bytes": payload,
                    "rate_scale": args.rate_scale if small else args.large_rate_scale,
                }
                for strategy in strategies:
                    t0 = time.monotonic()
                    rounds = args.small_rounds if small else args.rounds
                    r = loop.run_until_complete(
                        run_rounds(
                            scenario,
                            strategy,
                            payload,
                            rounds,
                            args.settle,
                            args.timeout,
                            args.warmup_rounds,
                            not args.no_carry_plans,
                            args.rate_probe_bytes,
                        )
                    )
                    row[strategy] = {
                        "round_s": statistics.median(r["round_s"]),
                        "rounds_s": [round(x, 3) for x in r["round_s"]],
                        "cpu_share": r["cpu_share"],
                        "tail": r["tail"],
                        "warmup_s": [round(x, 3) for x in r["warmup_s"]],
                        "predicted_s": statistics.median(r["predicted_s"]),
                        "chosen": r["chosen"],
                        "chosen_by_origin": r["chosen_by_origin"][-1:],
                        "chooser": r["chooser"],
                        "same_plan": r["same_plan"],
                        "datagrams": r["datagrams"],
                        "queue_drops": r["queue_drops"],
                        "repaired": r["repaired"],
                        "duplicates": r["duplicates"],
                        "lost": r["lost"],
                        "plans_refused": r["plans_refused"],
                        "in_flight_refused": r["in_flight_refused"],
                        "probes_answered_by_traffic": r["probes_answered_by_traffic"],
                        "deaths_withheld": r["deaths_withheld"],
                        "rate_probes": r["rate_probes"],
                        "wall_s": round(time.monotonic() - t0, 1),
                    }
                    print(f"{sname} {payload} {strategy}: {row[strategy]}", file=sys.stderr)
                summarize(row, strategies)
                table.append(row)
    finally:
        loop.close()
    tree_large = {"warm": None, "cold": None} if args.skip_dissemination else tree_large_ratio()
    result = {
        "benchmark": "strategy",
        "rate_scale": args.rate_scale,
        "large_rate_scale": args.large_rate_scale,
        "uplink_gbps": args.uplink_gbps,
        "rounds": args.rounds,
        "warmup_rounds": args.warmup_rounds,
        "small_rounds": args.small_rounds,
        "carry_plans": not args.no_carry_plans,
        "rate_probe_bytes": args.rate_probe_bytes,
        "scenarios": table,
        "auto_over_best_max": max((r.get("auto_over_best", 0.0) for r in table), default=None),
        "auto_over_best_max_unpooled": max(
            (r.get("auto_over_best_unpooled", 0.0) for r in table), default=None
        ),
        "best_over_worst_max": max((r.get("best_over_worst", 0.0) for r in table), default=None),
        "model_error_max": max((r.get("model_error", 0.0) for r in table), default=None),
        "auto_chose_best_rows": sum(1 for r in table if r.get("auto_chose_best")),
        "auto_rows": sum(1 for r in table if "auto_chose_best" in r),
        "tree_large_p50_ratio_multicloud": tree_large["warm"],
        "tree_large_p50_ratio_multicloud_cold": tree_large["cold"],
    }
    for row in table:
        cells = " ".join(
            f"{s} {row[s]['round_s']:.2f}s/{row[s]['predicted_s']:.2f}p"
            for s in strategies
            if s in row
        )
        print(
            f"{row['scenario']:12s} {row['payload_bytes']:>9d} B  {cells}  best {row.get('best')}"
        )
    print(
        f"multicloud 1 MB tree p50 over the optimum: {tree_large['warm']} "
        f"(first pass, cold: {tree_large['cold']})"
    )
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
