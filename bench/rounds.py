#!/usr/bin/env python3
"""The outer-step mode's rounds in one process, against dense DDP: what H, density,
value width, outer learning rate, delivery delay and the task's own learning rate do
to the final evaluation loss, in seconds per configuration where ``bench/training.py``
takes minutes.

N replicas of the task (the real ``core.replica`` in ``train.mode = "outer"``, the
task's optimizer and cosine schedule, each replica's batches from the seed streams
``bench/training.py``'s workers use) hand each other their round's payloads ``delay``
steps after the round ends; dense DDP is the exact mean of the N replicas' gradients
every step, as in ``bench/training.py``. With no network the losses of both are the
daemon benchmark's to rounding (DDP's to the last digit; the outer mode's differ by
the delays the emulated WAN adds). Bytes per step here are the origin's payload only
(no relays, framing or control): a ratio between configurations, not a wire figure.

Each configuration is ``H:density:values:outer_lr:delay[:nesterov][@inner]`` (``values``
one of int2, int4, int8, fp16; density 1 is dense; ``nesterov``: DiLoCo's outer step,
momentum 0.9, else averaging; ``@inner`` multiplies the inner steps' learning rate
only, DDP's staying put); ``--lr-scales`` multiplies the task's learning
rate (inner steps and DDP alike), so a configuration is compared with DDP at the same
rate and DDP's own best rate shows beside it. ``--batch-size`` changes the task's batch
per replica (DDP's is N times it). ``--split quarters`` gives each
Shakespeare replica its own contiguous quarter of the text instead of windows from the
whole of it (the task's default, ``DistributedSampler``'s rank::world over positions).

    python bench/rounds.py --task digits --seeds 4 --seed0 10 --lr-scales 1 2 3 \\
        --configs 5:0.05:int4:1:1 5:0.05:int4:1.4:1 5:1:fp16:1:1 --json
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from ciuic_p2p.config import CodecSection, TrainSection
from ciuic_p2p.config.sections import OuterOptimizer, ValueMode
from ciuic_p2p.core.codec.layout import BucketLayout
from ciuic_p2p.core.replica.rule import consensus_distance
from ciuic_p2p.lab.tasks import ShakespeareTask, Task, make_task
from ciuic_p2p.train.hook import flatten_parameters

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from support.simreplicas import SimNode, joined_replicas, stream_of

VALUES: dict[str, ValueMode] = {"int2": "int2", "int4": "int4", "int8": "int8", "fp16": "fp16"}


@dataclass(frozen=True)
class Round:
    """One outer-mode configuration."""

    inner_steps: int
    density: float
    values: ValueMode
    outer_lr: float
    delay_steps: int
    optimizer: OuterOptimizer = "average"
    inner_lr_scale: float = 1.0
    """The inner steps' learning rate over the row's (DDP keeps the row's)."""

    @classmethod
    def parse(cls, text: str) -> Round:
        fields, _, inner = text.partition("@")
        h, density, values, lr, delay, *rest = fields.split(":")
        optimizer: OuterOptimizer = "nesterov" if rest == ["nesterov"] else "average"
        if rest not in ([], ["average"], ["nesterov"]):
            raise ValueError(f"{text}: the sixth field is average or nesterov")
        scale = float(inner) if inner else 1.0
        if not scale > 0:
            raise ValueError(f"{text}: the inner learning rate's scale must be positive")
        return cls(int(h), float(density), VALUES[values], float(lr), int(delay), optimizer, scale)

    def __str__(self) -> str:
        h, d, v = self.inner_steps, self.density, self.values
        tail = ":nesterov" if self.optimizer == "nesterov" else ""
        inner = f"@{self.inner_lr_scale:g}" if self.inner_lr_scale != 1.0 else ""
        return f"{h}:{d:g}:{v}:{self.outer_lr:g}:{self.delay_steps}{tail}{inner}"


def _scale(step: int, steps: int) -> float:
    """bench/training.py's worker: a cosine from the task's rate to zero."""
    return 0.5 * (1 + math.cos(math.pi * (step - 1) / steps))


def ddp(task: Task, lr: float, seed: int, nodes: int, steps: int) -> float:
    """Dense DDP's final evaluation loss: the exact mean of the replicas' gradients."""
    torch.manual_seed(seed)
    model = task.model()
    opt = task.optimizer(list(model.parameters()))
    streams = [stream_of(seed, r) for r in range(nodes)]
    for step in range(1, steps + 1):
        for g in opt.param_groups:
            g["lr"] = lr * _scale(step, steps)
        opt.zero_grad()
        for r in range(nodes):
            (task.loss(model, task.batch(r, nodes, streams[r])) / nodes).backward()  # type: ignore[no-untyped-call]
        opt.step()
    return task.evaluate(model)[0]


def _nodes(task: Task, cfg: Round, seed: int, nodes: int) -> list[SimNode]:
    train = TrainSection(
        mode="outer",
        inner_steps=cfg.inner_steps,
        outer_lr=cfg.outer_lr,
        outer_optimizer=cfg.optimizer,
        outer_momentum=0.9,
        consensus_interval_steps=0,
        staleness_bound_steps=max(64, 2 * cfg.inner_steps + cfg.delay_steps),
    )
    codec = CodecSection(density=cfg.density, value_mode=cfg.values)
    return joined_replicas(task, seed, nodes, codec, train)


def outer(task: Task, cfg: Round, lr: float, seed: int, nodes: int, steps: int) -> dict[str, float]:
    """One run: :func:`_evaluate`'s losses and the origin's payload bytes per step."""
    reps = _nodes(task, cfg, seed, nodes)
    line: collections.deque[tuple[int, int, bytes]] = collections.deque()

    def deliver(until: int) -> None:
        while line and line[0][0] <= until:
            _, i, payload = line.popleft()
            for j, node in enumerate(reps):
                if j != i:
                    node.replica.receive(f"p{i}", payload)

    sent = 0
    for step in range(1, steps + 1):
        for i, node in enumerate(reps):
            for g in node.optimizer.param_groups:
                g["lr"] = lr * cfg.inner_lr_scale * _scale(step, steps)
            loss = task.loss(node.model, task.batch(i, nodes, node.stream))
            node.optimizer.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            node.optimizer.step()
            r = node.replica
            if r.local_step():
                payloads = r.encode_update(r.take_update(), r.step)
                sent += sum(len(p) for p in payloads)
                line.extend((step + cfg.delay_steps, i, p) for p in payloads)
        deliver(step)
        for node in reps:
            node.replica.settle()
    for i, node in enumerate(reps):  # finish(): the last round, then every chunk
        r = node.replica
        if r.last_send_step < r.step:
            line.extend((0, i, p) for p in r.encode_update(r.take_update(), r.step))
    deliver(steps + cfg.delay_steps)
    for node in reps:
        node.replica.settle(everything=True)
    return {**_evaluate(task, reps), "payload_bytes_per_step": sent / nodes / steps}


def _model_of(node: SimNode, buckets: list[torch.Tensor]) -> torch.nn.Module:
    """A copy of a replica's model holding ``buckets`` instead of its parameters."""
    model = copy.deepcopy(node.model)
    with torch.no_grad():
        flat = flatten_parameters(model, BucketLayout.for_module(model, 0))
        for target, source in zip(flat, buckets, strict=True):
            target.copy_(source)
    return model


def _evaluate(task: Task, reps: list[SimNode]) -> dict[str, float]:
    """The mean over replicas of the final loss; the loss of their parameters' mean;
    the mean loss of the consensus each holds without its unsent residual (the anchor,
    as SparseLoCo's workers restart from); the consensus distance."""
    losses = [task.evaluate(node.model)[0] for node in reps]
    with torch.no_grad():
        mean = [
            torch.stack([node.replica.buckets[k] for node in reps]).mean(0)
            for k in range(len(reps[0].replica.buckets))
        ]
    anchors = [task.evaluate(_model_of(n, n.replica.shared_params()))[0] for n in reps]
    return {
        "eval_loss": statistics.fmean(losses),
        "mean_params_eval_loss": task.evaluate(_model_of(reps[0], mean))[0],
        "anchor_eval_loss": statistics.fmean(anchors),
        "consensus_distance": consensus_distance([node.replica.buckets for node in reps]),
    }


def _arguments() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", choices=["digits", "shakespeare"], default="digits")
    ap.add_argument("--steps", type=int, help="steps per node (digits 150, shakespeare 300)")
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--batch-size", type=int, help="per replica (the task's default if unset)")
    ap.add_argument("--seed0", type=int, default=0, help="first seed (held-out: 10)")
    ap.add_argument("--lr-scales", type=float, nargs="+", default=[1.0])
    ap.add_argument("--split", choices=["quarters", "interleaved"], default="interleaved")
    ap.add_argument(
        "--configs", nargs="*", default=["5:0.05:int4:1:1"], help="none: DDP's rates only"
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object last")
    return ap.parse_args()


def main() -> int:
    args = _arguments()
    torch.set_num_threads(1)
    task = make_task(args.task)
    if args.split == "quarters":
        if not isinstance(task, ShakespeareTask):
            raise SystemExit("--split quarters: shakespeare only (digits is interleaved)")
        task.split = "quarters"
    if args.batch_size is not None:
        if args.batch_size < 1:
            raise SystemExit("--batch-size: at least 1")
        task.batch_size = args.batch_size
    steps = args.steps or (150 if args.task == "digits" else 300)
    seeds = list(range(args.seed0, args.seed0 + args.seeds))
    configs = [Round.parse(c) for c in args.configs]
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    ddp_by_scale: dict[str, float] = {}
    for scale in args.lr_scales:
        lr = task.lr * scale
        dense = [ddp(task, lr, s, args.nodes, steps) for s in seeds]
        ddp_by_scale[f"{scale:g}"] = statistics.fmean(dense)
        if not args.json:
            print(f"lr x{scale:g}: ddp {statistics.fmean(dense):.4f}", file=sys.stderr)
        for cfg in configs:
            runs = [outer(task, cfg, lr, s, args.nodes, steps) for s in seeds]
            gap = statistics.fmean(r["eval_loss"] / d - 1 for r, d in zip(runs, dense, strict=True))
            row = {
                "lr_scale": scale,
                "config": str(cfg),
                "eval_loss": statistics.fmean(r["eval_loss"] for r in runs),
                "ddp_eval_loss": statistics.fmean(dense),
                "loss_vs_ddp_pct": 100 * gap,
                "mean_params_eval_loss": statistics.fmean(r["mean_params_eval_loss"] for r in runs),
                "anchor_eval_loss": statistics.fmean(r["anchor_eval_loss"] for r in runs),
                "consensus_distance": max(r["consensus_distance"] for r in runs),
                "payload_bytes_per_step": statistics.fmean(
                    r["payload_bytes_per_step"] for r in runs
                ),
            }
            rows.append(row)
            if not args.json:
                print(
                    f"  {cfg}: {row['eval_loss']:.4f} ({row['loss_vs_ddp_pct']:+.2f}% vs ddp), "
                    f"mean params {row['mean_params_eval_loss']:.4f}, "
                    f"anchor {row['anchor_eval_loss']:.4f}, "
                    f"{row['payload_bytes_per_step']:.0f} B/step payload",
                    file=sys.stderr,
                )
    best = min(ddp_by_scale.items(), key=lambda kv: kv[1])
    result = {
        "task": args.task,
        "split": args.split,
        "nodes": args.nodes,
        "steps": steps,
        "seeds": seeds,
        "task_lr": task.lr,
        "batch_size": task.batch_size,
        "ddp_eval_loss_by_lr_scale": ddp_by_scale,
        "ddp_best_lr_scale": float(best[0]),
        "rows": rows,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
