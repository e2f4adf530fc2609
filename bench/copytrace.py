#!/usr/bin/env python3
"""Where a strategy run's second copies come from: every chunk send and arrival of one
``bench/strategy.py`` run, traced at the dissemination state machine.

Runs one (scenario, strategy, payload) as bench/strategy.py does (fresh mesh, warm-up
rounds, measured rounds) with every ``Disseminator`` send and arrival of a chunk
recorded, then counts the duplicate arrivals and how many of them came from the member
that had already sent that chunk over the same link, asked for while its first copy
was still on the way (the adapter's outbox refuses those since the in-flight check,
``chunks_in_flight``; the core still records the send it asked for). For each
measured round it prints the last delivery: who got what, how, and when, against the
round's 95th percentile.

    python bench/copytrace.py --scenario multicloud --strategy tree --json
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import strategy as bench

from ciuic_p2p.config import LogSection
from ciuic_p2p.core.mesh import broadcast
from ciuic_p2p.core.mesh.messages import Chunk, Heads, Want
from ciuic_p2p.logsetup import configure_logging
from ciuic_p2p.transport.loop import new_event_loop

Event = tuple[str, float, str, str, str, int, int, int]
"""(kind S or R, time, this node, the other node, origin, seq, hops, round)."""


def _round_of(chunk: Chunk) -> int:
    return int.from_bytes(chunk.payload[:4], "little")


def trace(events: list[Event]) -> None:
    """Record every chunk the state machines send and receive (this process only)."""
    on_chunk = broadcast.Disseminator._on_chunk
    send = broadcast.Disseminator._send

    def traced_on_chunk(
        self: broadcast.Disseminator, sender: str, chunk: Chunk, now: float
    ) -> None:
        at = time.monotonic()  # the clock the sends are stamped with
        events.append(
            ("R", at, self.node, sender, chunk.origin, chunk.seq, chunk.hops, _round_of(chunk))
        )
        on_chunk(self, sender, chunk, now)

    def traced_send(self: broadcast.Disseminator, node: str, body: Chunk | Heads | Want) -> None:
        if isinstance(body, Chunk):
            events.append(
                ("S", time.monotonic(), self.node, node, body.origin, body.seq, body.hops,
                 _round_of(body))
            )  # fmt: skip
        send(self, node, body)

    broadcast.Disseminator._on_chunk = traced_on_chunk  # type: ignore[method-assign]
    broadcast.Disseminator._send = traced_send  # type: ignore[method-assign]


def analyse(events: list[Event]) -> dict[str, Any]:
    sends: dict[tuple[str, str, str, int], list[float]] = collections.defaultdict(list)
    arrivals: dict[tuple[str, str, str, int], list[float]] = collections.defaultdict(list)
    first: dict[tuple[str, str, int], Event] = {}
    for e in events:
        kind, at, node, other, origin, seq = e[:6]
        if kind == "S":
            sends[(node, other, origin, seq)].append(at)
        else:
            arrivals[(node, other, origin, seq)].append(at)
            first.setdefault((node, origin, seq), e)
    copies: collections.Counter[tuple[str, str, int]] = collections.Counter()
    for (node, _, origin, seq), times in arrivals.items():
        copies[(node, origin, seq)] += len(times)
    same_link = same_link_in_flight = 0
    for (node, sender, origin, seq), got in arrivals.items():
        times = sorted(got)
        out = sorted(sends.get((sender, node, origin, seq), []))
        same_link += len(times) - 1
        same_link_in_flight += sum(
            1 for i in range(1, len(times)) if i < len(out) and out[i] < times[0]
        )
    rounds: dict[int, list[Event]] = collections.defaultdict(list)
    for e in first.values():
        rounds[e[7]].append(e)
    tails = []
    for r, firsts in sorted(rounds.items()):
        firsts.sort(key=lambda e: e[1])
        start = min(e[1] for e in events if e[7] == r)
        last = firsts[-1]
        tails.append(
            {
                "round": r,
                "end_s": round(last[1] - start, 2),
                "p95_s": round(firsts[int(0.95 * (len(firsts) - 1))][1] - start, 2),
                "last_by": "repair" if last[6] >= broadcast.REPAIRED_HOPS else "tree",
            }
        )
    return {
        "deliveries": len(copies),
        "duplicate_arrivals": sum(c - 1 for c in copies.values()),
        "same_link_duplicates": same_link,
        "same_link_duplicates_sent_in_flight": same_link_in_flight,
        "rounds": tails,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", default="multicloud")
    ap.add_argument("--strategy", default="tree")
    ap.add_argument("--payload", type=int, default=bench.UPDATE_BYTES)
    ap.add_argument("--rate-scale", type=float, default=0.01)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    configure_logging(LogSection(level="error"))
    ns = argparse.Namespace(scenarios=args.scenario, nodes=6, uplink_gbps=1.0, rtt=[])
    scenario = bench.scenarios_of(ns, args.rate_scale)[args.scenario]
    events: list[Event] = []
    trace(events)
    loop = new_event_loop()
    try:
        run = loop.run_until_complete(
            bench.run_rounds(scenario, args.strategy, args.payload, args.rounds, 8.0, 180.0)
        )
    finally:
        loop.close()
    out = {
        "benchmark": "copytrace",
        "scenario": args.scenario,
        "strategy": args.strategy,
        "payload_bytes": args.payload,
        "rate_scale": args.rate_scale,
        "round_s": [round(x, 3) for x in run["round_s"]],
        "warmup_s": [round(x, 3) for x in run["warmup_s"]],
        "in_flight_refused": run["in_flight_refused"],
        **analyse(events),
    }
    for k, v in out.items():
        if not args.json:
            print(f"{k}: {v}")
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
