"""One node's trainer of bench/sharded.py: under torchrun, its ranks shard a model of
``--params`` parameters (4 equal ``nn.Linear``, each its own FSDP2 unit) with
``fully_shard``; with one rank and ``--plain``, the model unsharded. Each step runs a
small real compute and the optimizer's step, padded with a sleep to ``--step-s`` (an
accelerator's step), then the hook. Each rank prints one JSON object at the end.

The timed compute (not the hook's time) holds FSDP2's own collectives of the step: the
all-gathers of the four layers' forward (the first three under ``no_grad``) and the
last layer's backward reduce-scatter; the other layers keep the gradients of a first
full backward (as in bench/support/datapath_trainer.py), so every parameter moves
every step and the updates are dense, as a real model's."""

from __future__ import annotations

import argparse
import json
import math
import resource
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from ciuic_p2p import attach
from ciuic_p2p.config import load_config


def model_of(params: float) -> torch.nn.Sequential:
    width = int(math.sqrt(params / 4))
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(4)])


def maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--config", required=True)
    ap.add_argument("--params", type=float, required=True)
    ap.add_argument("--step-s", type=float, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--warmup", type=int, required=True)
    ap.add_argument("--replicas", type=int, required=True)
    ap.add_argument("--node-index", type=int, required=True, dest="node")
    ap.add_argument("--out", required=True, help="where the node's first rank writes its model")
    ap.add_argument("--plain", action="store_true", help="one process, the model unsharded")
    args = ap.parse_args()
    torch.set_num_threads(1)
    group = None
    rank = 0
    model = model_of(args.params)
    params = sum(p.numel() for p in model.parameters())
    if not args.plain:
        from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

        dist.init_process_group("gloo")
        group, rank = dist.group.WORLD, dist.get_rank()
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    width = int(math.sqrt(args.params / 4))
    gen = torch.Generator().manual_seed(100 * args.node + rank)
    last = model[3]

    def compute(full: bool = False) -> float:
        x = torch.randn(1, width, generator=gen)
        target = torch.randn(1, width, generator=gen)
        t0 = time.perf_counter()
        if full:
            opt.zero_grad(set_to_none=False)
            loss = (model(x) - target).pow(2).mean()
        else:
            with torch.no_grad():
                h = model[:3](x)
            loss = (last(h) - target).pow(2).mean()
        loss.backward()
        opt.step()
        return time.perf_counter() - t0

    for _ in range(3):  # gradients and optimizer state exist before the baseline
        compute(full=True)
    rss_without = maxrss_bytes()
    sync = attach(
        model, opt, run="sharded-bench", socket_path=args.socket,
        config=load_config(args.config), min_replicas=args.replicas, join_timeout_s=300,
        process_group=group,
    )  # fmt: skip
    shard = sum(t.numel() for t in sync.buckets)
    hook_s: list[float] = []
    compute_s: list[float] = []
    published0 = merged0 = 0
    t_start = 0.0
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            st = sync.stats
            published0, merged0 = st["bytes_published"], st["merged_steps"]
            t_start = time.monotonic()
        c = compute()
        time.sleep(max(0.0, args.step_s - c))
        t0 = time.perf_counter()
        sync.step()
        if step >= args.warmup:
            hook_s.append(time.perf_counter() - t0)
            compute_s.append(c)
    elapsed = time.monotonic() - t_start
    st = sync.stats
    r = sync.replica
    # Every tensor the update rule holds beside the model: none may be the model's
    # size on a sharded rank (its shard's at most).
    held = [*r.base, *(f for f in r.own_params.values() for f in f.values)]
    largest = max((t.numel() for t in held), default=0)
    complete = sync.finish(timeout_s=300)
    final = sync.stats
    out: dict[str, Any] = {
        "node": args.node,
        "rank": rank,
        "plain": args.plain,
        "params": params,
        "shard": shard,
        "hook_s": hook_s,
        "compute_s": compute_s,
        "elapsed_s": elapsed,
        "bytes_published": st["bytes_published"] - published0,
        "merged_steps": st["merged_steps"] - merged0,
        "held_bytes": int(st["hook_held_bytes"]),
        "rss_extra_bytes": maxrss_bytes() - rss_without,
        "largest_tensor": largest,
        "full_model_tensors": sum(1 for t in held if t.numel() > shard),
        "staleness_p99": final["staleness_p99"],
        "complete": complete,
        "refused": final["refused"],
        "final_round": final["final_round"],
        "peer": final["peer"],
    }
    sync.close()
    # One model? The node's parameters, gathered by the benchmark after the run (the
    # library never does), written by its first rank for the distance.
    gathered = [
        (p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for p in model.parameters()
    ]
    if rank == 0:
        torch.save(gathered, f"{args.out}/params-{args.node}.pt")
    del gathered
    print(json.dumps(out), flush=True)
    if group is not None:
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
