#!/usr/bin/env python3
"""A state-sized store fetch with the CPUs to the daemons, then the same fetch while
every node trains: where a restarted node's state transfer loses its time
(bench/recovery.py measures the restart as a whole).

The recovery benchmark's setting: N nodes on the 11-city scenario (rates x0.1), the
node farthest from the others fetches an object of ``--mb`` MB that every other
node holds, first before any training (``idle_fetch_s``), then after ``--warm-steps``
steps of training on every node (``busy_fetch_s``; the same 10 M parameter MLP,
trainers at niceness ``--trainer-nice``). For each fetch: every daemon's CPU seconds
(user + system, from /proc), the donors, and the datagrams dropped on full UDP
receive buffers (host-wide ``RcvbufErrors``, and per daemon from /proc/net/udp); for
the busy one also the trainers' CPU seconds over the same time. The last line is one
JSON object with ``--json``.

    python bench/fetchload.py --json [--trainer-nice 19]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from support.statefetch import CONFIG, cpu_s, farthest, timed_fetch

from ciuic_p2p.lab.cluster import JsonLines, LocalCluster, spread_nodes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--scenario", default="cities11")
    p.add_argument("--rate-scale", type=float, default=0.1)
    p.add_argument("--mb", type=float, default=81.3, help="the object's size (the state's)")
    p.add_argument("--hidden", type=int, default=3150, help="digits MLP width (3150: 10.1 M)")
    p.add_argument("--warm-steps", type=int, default=10)
    p.add_argument("--trainer-nice", type=int, default=0)
    args = p.parse_args(argv)
    names = spread_nodes(args.scenario, args.nodes)
    fetcher = farthest(args.scenario, names)
    holders = [n for n in names if n != fetcher]
    result: dict[str, Any] = {
        "benchmark": "fetchload", "regions": names, "fetcher": fetcher, "mb": args.mb,
        "trainer_nice": args.trainer_nice,
    }  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="ciuic-fetchload-") as tmp:
        work = Path(tmp)
        stop = work / "stop"
        worker = ["--task", "digits", "--hidden", str(args.hidden), "--steps", "100000",
                  "--world", str(args.nodes), "--run", "fetchload", "--evals", "1",
                  "--stop-file", str(stop)]  # fmt: skip
        lines = JsonLines()
        with LocalCluster(
            args.scenario, names, work / "c", CONFIG, args.rate_scale, 0.0, args.trainer_nice
        ) as c:
            c.start()
            idle = timed_fetch(c, fetcher, holders, args.mb, work, "idle")
            print(f"idle: {json.dumps(idle)}", file=sys.stderr, flush=True)
            trainers = {n: c.spawn_trainer(n, r, worker, work / "out") for r, n in enumerate(names)}
            for name, proc in trainers.items():
                lines.add(name, proc)
            steps: dict[str, int] = {}
            deadline = time.monotonic() + 900
            while min(steps.get(n, 0) for n in names) < args.warm_steps:
                if time.monotonic() > deadline:
                    raise TimeoutError("the trainers did not warm up")
                for name, obj in lines.read(0.5):
                    if obj.get("event") == "progress":
                        steps[name] = int(obj["step"])
            cpu0 = {n: cpu_s(proc.pid) for n, proc in trainers.items()}
            busy = timed_fetch(c, fetcher, holders, args.mb, work, "busy")
            busy["trainer_cpu_s"] = {
                n: round(cpu_s(proc.pid) - cpu0[n], 2) for n, proc in trainers.items()
            }
            print(f"busy: {json.dumps(busy)}", file=sys.stderr, flush=True)
            stop.touch()
            lines.close()
    result.update(
        idle_fetch_s=idle["seconds"],
        busy_fetch_s=busy["seconds"],
        busy_over_idle=busy["seconds"] / idle["seconds"],
        idle=idle,
        busy=busy,
    )
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:>16}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
