#!/usr/bin/env python3
"""How the update rule (core.replica.rule) holds up under staleness, without a network:
N replicas of the digits task in one process hand each other their payloads after a
fixed delay of D steps (every replica steps once per round). With density 1 and no
delay the rule is the dense computation; the sweep shows what compression and delay
cost in final evaluation loss (mean over replicas and seeds).

    python bench/staleness.py --json --delays 0 5 20 40 64
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import statistics
import sys

import torch

from ciuic_p2p.config import CodecSection, TrainSection
from ciuic_p2p.core.replica.rule import consensus_distance
from ciuic_p2p.lab.tasks import DigitsTask

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from support.simreplicas import SimNode, joined_replicas

_Rep = SimNode


def _replicas(task: DigitsTask, density: float, interval: int, seed: int, nodes: int) -> list[_Rep]:
    return joined_replicas(
        task,
        seed,
        nodes,
        CodecSection(density=density, dense_below_numel=0),
        TrainSection(consensus_interval_steps=0, send_interval_steps=interval),
    )


class _DelayLine:
    """Payloads handed to every other replica once their round comes."""

    def __init__(self, reps: list[_Rep]) -> None:
        self.reps = reps
        self.queue: collections.deque[tuple[int, int, bytes]] = collections.deque()

    def put(self, at_step: int, sender: int, payloads: list[bytes]) -> None:
        self.queue.extend((at_step, sender, p) for p in payloads)

    def deliver(self, until: int) -> None:
        while self.queue and self.queue[0][0] <= until:
            _, i, payload = self.queue.popleft()
            for j, (_, _, r, _) in enumerate(self.reps):
                if j != i:
                    r.receive(f"p{i}", payload)


def run(
    density: float, delay: int, interval: int, seed: int, nodes: int, steps: int
) -> tuple[float, float]:
    task = DigitsTask()
    reps = _replicas(task, density, interval, seed, nodes)
    line = _DelayLine(reps)
    for step in range(1, steps + 1):
        for i, (model, opt, r, gen) in enumerate(reps):
            for group in opt.param_groups:
                group["lr"] = task.lr * 0.5 * (1 + math.cos(math.pi * (step - 1) / steps))
            loss = task.loss(model, task.batch(i, nodes, gen))
            opt.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
            if r.local_step():
                line.put(step + delay, i, r.encode_update(r.take_update(), r.step))
        line.deliver(step)
        for _, _, r, _ in reps:
            r.settle()
    for i, (_, _, r, _) in enumerate(reps):
        if r.last_send_step < r.step:
            line.put(0, i, r.encode_update(r.take_update(), r.step))
    line.deliver(steps + delay)
    for _, _, r, _ in reps:
        r.settle(everything=True)
    losses = [task.evaluate(m)[0] for m, _, _, _ in reps]
    return statistics.fmean(losses), consensus_distance([r.buckets for _, _, r, _ in reps])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--delays", type=int, nargs="+", default=[0, 5, 20, 40, 64])
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--send-interval", type=int, default=1)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    result: dict[str, object] = {"density": args.density, "nodes": args.nodes, "steps": args.steps}
    dense = [run(1.0, 0, 1, s, args.nodes, args.steps)[0] for s in range(args.seeds)]
    result["dense_eval_loss"] = statistics.fmean(dense)
    for delay in args.delays:
        runs = [
            run(args.density, delay, args.send_interval, s, args.nodes, args.steps)
            for s in range(args.seeds)
        ]
        result[f"delay_{delay}_eval_loss"] = statistics.fmean(r[0] for r in runs)
        result[f"delay_{delay}_consensus"] = max(r[1] for r in runs)
        if not args.json:
            print(delay, result[f"delay_{delay}_eval_loss"], file=sys.stderr)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
