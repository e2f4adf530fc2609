#!/usr/bin/env python3
"""Crash recovery on the emulated WAN: N nodes (daemon and trainer as separate
processes) train a model of about 10 M parameters; the node in the region farthest
from the others is killed (SIGKILL, daemon and trainer) and restarted. Measured:

- ``restart_to_training_s``: from the daemon's restart until the new trainer takes its
  first step with the synced state (daemon start and rejoin, trainer start and
  imports, state fetch, load);
- ``max_survivor_stall_s``: the longest a survivor's step waited for other replicas
  (the hook's wait) from the kill on; ``max_survivor_gap_s``: the longest time
  between two of a survivor's steps, compute included (context: ``step_s``);
- ``state_mb``: the state fetched (parameters and momentum), and its fetch time;
- ``idle_fetch_s``: beside it, the same node fetching an object of the state's size
  held by every survivor, before training starts (the CPUs to the daemons alone).

Where the restart's time goes: ``daemon_rejoin_s`` (daemon start and join),
``trainer_ready_s`` (the trainer's imports and model, until it calls ``attach``),
``replicas_wait_s`` (attach waiting for the other replicas to answer; when each was
seen alive, registered and reported: ``replicas_heard_s``),
``state_fetch_s`` (query, donors' fresh snapshots, transfer, load; of which
``state_query_s`` until the first piece request, ``state_daemon_s`` the daemon's
part, query and transfer, and ``state_fetch_while_waiting_s`` the part that overlapped
the replicas wait: the fetch starts once one replica is known ahead;
``state_prefetch``: when the restarted daemon began fetching the state on its own,
after its start, and how long that took, while the trainer started), the chunks kept
while attach waited and fetched (``early_chunks``; ``early_held_by_state`` of them
dropped by their header) and
``trainer_attached_s`` (all of the trainer's start until ``attach`` returned).

Then the same with 0.05% random loss on every link (``*_lossy``, reported without a
bar). The last line is one JSON object with ``--json``.

    python bench/recovery.py --json
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from support.statefetch import CONFIG, farthest, timed_fetch

from ciuic_p2p.lab.cluster import JsonLines, LocalCluster, spread_nodes


def one_run(args: argparse.Namespace, loss: float, workdir: Path) -> dict[str, Any]:
    names = spread_nodes(args.scenario, args.nodes)
    victim = farthest(args.scenario, names)
    survivors = [n for n in names if n != victim]
    out, stop = workdir / "out", workdir / "stop"
    events: list[tuple[str, dict[str, Any], float]] = []
    lines = JsonLines()

    def pump(timeout_s: float = 0.2) -> None:
        for node, obj in lines.read(timeout_s):
            events.append((node, obj, time.time()))

    def newest(node: str, kind: str = "progress", since: float = 0.0) -> dict[str, Any] | None:
        found = [o for n, o, at in events if n == node and o.get("event") == kind and at >= since]
        return found[-1] if found else None

    def until(cond: Any, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not cond():
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out waiting for {what}")
            pump()

    def step(node: str) -> int:
        p = newest(node)
        return int(p["step"]) if p else 0

    worker = ["--task", "digits", "--hidden", str(args.hidden), "--steps", "100000",
              "--world", str(args.nodes), "--run", "recovery", "--evals", "1",
              "--stop-file", str(stop)]  # fmt: skip
    with LocalCluster(
        args.scenario, names, workdir / "c", CONFIG, args.rate_scale, loss, args.trainer_nice
    ) as c:
        c.start()
        # Beside the restart: the same node fetching an object of the state's size
        # before any training (the links, QUIC and the store with the CPUs to themselves).
        idle_s = timed_fetch(c, victim, survivors, args.idle_fetch_mb, workdir, "idle")["seconds"]
        for rank, name in enumerate(names):
            lines.add(name, c.spawn_trainer(name, rank, worker, out))
        until(lambda: min(step(n) for n in names) >= args.warm_steps, 1800, "warm-up")
        killed_at = time.time()
        c.kill(victim)
        before = {n: step(n) for n in survivors}
        until(lambda: all(step(n) >= before[n] + 3 for n in survivors), 600, "survivors")
        restarted_at = time.time()
        # Daemon and trainer start together, as systemd and a job scheduler would
        # start them (the trainer waits for the daemon's socket).
        rank = names.index(victim)
        proc = c.spawn_trainer(victim, rank, [*worker, "--min-replicas", str(args.nodes)], out)
        lines.add(victim, proc)
        daemon_s = c.restart(victim)
        until(
            lambda: newest(victim, "first_step", restarted_at) is not None,
            900,
            "the restarted trainer",
        )
        first = newest(victim, "first_step", restarted_at)
        attached = newest(victim, "attached", restarted_at)
        attaching = newest(victim, "attaching", restarted_at)
        assert first is not None and attached is not None and attaching is not None
        start = step(victim)
        until(lambda: step(victim) >= start + args.after_steps, 900, "steps after the restart")
        stop.touch()
        until(lambda: all(newest(n, "done") for n in names), 900, "the end")
        lines.close()
    after = [
        o for n, o, at in events if n in survivors and o.get("event") == "progress"
        and at >= killed_at
    ]  # fmt: skip
    steps_ms = [newest(n, "done")["step_ms"] for n in survivors]  # type: ignore[index]
    restored = attached["restored"]
    return {
        "regions": names,
        "victim": victim,
        "restart_to_training_s": first["at"] - restarted_at,
        "daemon_rejoin_s": daemon_s,
        "trainer_attached_s": attached["at"] - restarted_at,
        "trainer_ready_s": attaching["at"] - restarted_at,
        "replicas_wait_s": attached["replicas_wait_s"],
        "replicas_heard_s": attached.get("replicas_heard_s"),
        "max_survivor_stall_s": max(o.get("max_wait_s", 0.0) for o in after),
        "max_survivor_gap_s": max(o["max_gap_s"] for o in after),
        "step_s": statistics.mean(steps_ms) / 1000,
        "state_mb": restored.get("bytes", 0) / 1e6,
        "state_fetch_s": restored.get("seconds"),
        "idle_fetch_s": idle_s,
        "idle_fetch_mb": args.idle_fetch_mb,
        "state_query_s": restored.get("query_s"),
        "state_daemon_s": restored.get("daemon_s"),
        "state_fetch_while_waiting_s": restored.get("while_waiting_s"),
        "state_prefetch": restored.get("prefetch"),
        "early_chunks": restored.get("early_chunks"),
        "early_held_by_state": restored.get("early_held_by_state"),
        "state_donors": restored.get("donors"),
        "restored_from": restored.get("source"),
        "start_step": attached["start_step"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--json", action="store_true")
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--scenario", default="cities11")
    p.add_argument("--hidden", type=int, default=3150, help="digits MLP width (3150: 10.1 M)")
    p.add_argument("--rate-scale", type=float, default=0.1)
    p.add_argument("--warm-steps", type=int, default=15)
    p.add_argument("--after-steps", type=int, default=5)
    p.add_argument("--skip-lossy", action="store_true")
    p.add_argument("--keep", help="run in this directory and keep it (logs of every node)")
    p.add_argument("--trainer-nice", type=int, default=0, help="run the trainers at this niceness")
    p.add_argument("--idle-fetch-mb", type=float, default=81.3, help="the idle fetch's size")
    args = p.parse_args(argv)
    params = 64 * args.hidden + args.hidden + args.hidden * args.hidden + args.hidden
    params += args.hidden * 10 + 10
    result: dict[str, Any] = {
        "benchmark": "recovery",
        "parameters": params,
        "trainer_nice": args.trainer_nice,
    }
    with tempfile.TemporaryDirectory(prefix="ciuic-recovery-") as tmp_dir:
        tmp = args.keep or tmp_dir
        clean = one_run(args, 0.0, Path(tmp) / "clean")
        result.update(clean)
        print(f"no loss: {json.dumps(clean)}", file=sys.stderr, flush=True)
        if not args.skip_lossy:
            lossy = one_run(args, 0.0005, Path(tmp) / "lossy")
            print(f"0.05% loss: {json.dumps(lossy)}", file=sys.stderr, flush=True)
            for key in ("restart_to_training_s", "max_survivor_stall_s", "max_survivor_gap_s",
                        "state_mb", "state_fetch_s", "idle_fetch_s"):  # fmt: skip
                lossy_key = key[:-2] + "_lossy_s" if key.endswith("_s") else key + "_lossy"
                result[lossy_key] = lossy[key]
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:>32}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
