#!/usr/bin/env python3
"""A daemon restarted under its trainer, against the same run without the restart:
how far apart the replicas end, pair by pair.

Three nodes (separate daemon and trainer processes, real QUIC on loopback) train the
digits task with steps padded to 20 ms. Once every trainer is past step 100, node
n2's daemon gets SIGTERM (``systemctl restart``), its trainer steps on alone for 50
steps, the daemon starts again, and the run goes on 100 steps past the trainer's
return; then every trainer finishes. The twin runs the same schedule
(``--steps 6000``) without the restart and stops at the same step (a twin whose
schedule ended there would anneal its learning rate to zero and drain its residual:
an unfair mark). Reported per pair and as the mean over the pairs:

- ``distance``, ``twin_distance``: ``consensus_distance`` of the three final models
  (the RMS distance from their mean over the mean's RMS);
- ``refused``: update chunks the others refused of the restarted replica, by reason;
- ``unapplied``: its chunks neither applied nor refused (lost: should be 0);
- ``finished_in_sync``: ``finish()``'s result on the three replicas.

Two configurations: ``on`` (the defaults' member bounds and consensus mix, as a
user runs) and ``off`` (bounds and mix off: what the restart itself leaves).

    python bench/daemon_restart.py --pairs 3 --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ciuic_p2p.core.replica.rule import consensus_distance
from ciuic_p2p.lab.cluster import JsonLines, LocalCluster

CONFIGS = {
    "on": """
[codec]
density = 0.05
[train]
consensus_interval_steps = 16
""",
    "off": """
[codec]
density = 0.05
[train]
consensus_interval_steps = 0
influence_clip_ratio = 100.0
influence_disagreement = 0.0
update_norm_max_ratio = 1000000.0
""",
}
NAMES = ["n0", "n1", "n2"]
STEPS = 6000
STEP_S = 0.02


class Progress:
    """The trainers' JSON lines, with a bounded wait for a condition."""

    def __init__(self) -> None:
        self.lines = JsonLines()
        self.events: list[tuple[str, dict[str, Any]]] = []

    def until(self, cond: Any, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not cond():
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out waiting for {what}")
            self.events += self.lines.read(0.2)

    def step(self, node: str) -> int:
        found = [o for n, o in self.events if n == node and o.get("event") == "progress"]
        return int(found[-1]["step"]) if found else 0

    def done(self, node: str) -> bool:
        return any(n == node and o.get("event") == "done" for n, o in self.events)


def _trainer_args(out: Path, extra: list[str]) -> list[str]:
    return ["--task", "digits", "--steps", str(STEPS), "--world", "3", "--step-s", str(STEP_S),
            "--run", "restart", "--evals", "1", *extra]  # fmt: skip


def _ending(out: Path) -> tuple[list[dict[str, Any]], float]:
    results = [json.loads((out / f"result-{r}.json").read_text()) for r in range(3)]
    params = [torch.load(out / f"params-{r}.pt") for r in range(3)]
    return results, consensus_distance(params)


def restart_run(root: Path, config: str) -> tuple[list[dict[str, Any]], float]:
    out, stop = root / "out", root / "stop"
    with LocalCluster(None, NAMES, root / "c", config) as cluster:
        cluster.start()
        watch = Progress()
        args = _trainer_args(out, ["--stop-file", str(stop)])
        for rank, name in enumerate(NAMES):
            watch.lines.add(name, cluster.spawn_trainer(name, rank, args, out))
        victim = NAMES[2]
        watch.until(lambda: min(watch.step(n) for n in NAMES) >= 100, 240, "step 100")
        cluster.stop_daemon(victim)
        stopped_at = watch.step(victim)
        watch.until(lambda: watch.step(victim) >= stopped_at + 50, 60, "steps while away")
        cluster.restart(victim)
        log = out / "trainer-2.log"
        watch.until(lambda: "daemon_back" in log.read_text(), 60, "its trainer back")
        back_at = watch.step(victim)
        watch.until(lambda: min(watch.step(n) for n in NAMES) >= back_at + 100, 120, "after")
        stop.touch()
        watch.until(lambda: all(watch.done(n) for n in NAMES), 300, "the end")
        watch.lines.close()
    return _ending(out)


def twin_run(root: Path, config: str, steps: int) -> tuple[list[dict[str, Any]], float]:
    out = root / "out"
    with LocalCluster(None, NAMES, root / "c", config) as cluster:
        cluster.start()
        watch = Progress()
        args = _trainer_args(out, ["--stop-at", str(steps)])
        for rank, name in enumerate(NAMES):
            watch.lines.add(name, cluster.spawn_trainer(name, rank, args, out))
        watch.until(lambda: all(watch.done(n) for n in NAMES), 300, "the end")
        watch.lines.close()
    return _ending(out)


def one_pair(root: Path, config: str) -> dict[str, Any]:
    t0 = time.perf_counter()
    results, distance = restart_run(root / "restart", config)
    steps = max(r["sync"]["step"] for r in results)
    twin_results, twin_distance = twin_run(root / "twin", config, steps)
    mine = results[2]["sync"]
    refused: dict[str, int] = {}
    unapplied = 0
    for theirs in (r["sync"] for r in results[:2]):
        for reason, n in theirs["refused"].items():
            refused[reason] = refused.get(reason, 0) + n
        got = theirs["applied_from"].get(mine["peer"], 0)
        unapplied += mine["chunks_sent"] - got - theirs["refused_by_origin"].get(mine["peer"], 0)
    return {
        "steps": steps,
        "distance": float(f"{distance:.3g}"),
        "twin_distance": float(f"{twin_distance:.3g}"),
        "refused": refused,
        "unapplied": unapplied,
        "finished_in_sync": [r["finished_in_sync"] for r in results],
        "twin_finished_in_sync": [r["finished_in_sync"] for r in twin_results],
        "eval_loss": [round(r["eval_loss"], 4) for r in results],
        "twin_eval_loss": [round(r["eval_loss"], 4) for r in twin_results],
        "wall_s": round(time.perf_counter() - t0, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--bounds", choices=["on", "off", "both"], default="both")
    p.add_argument("--json", action="store_true", help="print one JSON object last")
    args = p.parse_args()
    report: dict[str, Any] = {"step_s": STEP_S, "pairs": args.pairs}
    for bounds in ["on", "off"] if args.bounds == "both" else [args.bounds]:
        rows = []
        for i in range(args.pairs):
            with tempfile.TemporaryDirectory(prefix="ciuic-restart-") as tmp:
                row = one_pair(Path(tmp), CONFIGS[bounds])
            print(f"bounds {bounds} pair {i}: {json.dumps(row)}", flush=True)
            rows.append(row)
        gaps = [r["distance"] - r["twin_distance"] for r in rows]
        report[bounds] = {
            "rows": rows,
            "mean_distance": float(f"{statistics.mean(r['distance'] for r in rows):.3g}"),
            "mean_twin_distance": float(f"{statistics.mean(r['twin_distance'] for r in rows):.3g}"),
            "mean_gap": float(f"{statistics.mean(gaps):.3g}"),
            "max_gap": float(f"{max(gaps):.3g}"),
            "unapplied": sum(r["unapplied"] for r in rows),
        }
        summary = {k: v for k, v in report[bounds].items() if k != "rows"}
        print(f"bounds {bounds}: {json.dumps(summary)}", flush=True)
    if args.json:
        print(json.dumps(report))


if __name__ == "__main__":
    main()
