"""One trainer process: a task trained for a number of steps in one of three modes,
reporting progress as JSON lines on stdout and its result in ``OUT/result-RANK.json``
(with its final parameters in ``OUT/params-RANK.pt``).

- ``async``: the hook (``ciuic_p2p.attach``) on the node's daemon;
- ``dense``: synchronous ring all-reduce of fp32 gradients through the same daemon;
- ``single``: one trainer alone, no network (give it N times the steps).

Step time is split into compute (forward, backward, optimizer), evaluation (with the
byte count for the plot), and the rest: the wait (hook, network, staleness bound). The
learning rate follows a cosine from ``task.lr`` to zero over the run, the same for
every mode.

    python -m ciuic_p2p.train.worker --mode async --task digits --steps 300 \\
        --socket /run/ciuic/trainer.sock --rank 0 --world 4 --out runs/a
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ciuic_p2p.config import Config, load_config
from ciuic_p2p.core.layout import BucketLayout
from ciuic_p2p.train.attach import attach
from ciuic_p2p.train.channel import DaemonChannel
from ciuic_p2p.train.hook import MeshSync, flatten_parameters
from ciuic_p2p.train.ring import RingAllReduce
from ciuic_p2p.train.tasks import make_task

PROGRESS_EVERY_S = 0.5


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    # The hook's reader and encoder threads run Python between torch kernels; a short
    # switch interval keeps the training thread from waiting 5 ms for the GIL.
    sys.setswitchinterval(args.switch_interval_s)
    config = load_config(args.config) if args.config else Config.wan()
    task = make_task(args.task)
    if args.hidden:
        task.hidden = args.hidden  # type: ignore[attr-defined]
    torch.manual_seed(args.seed)
    model = task.model()
    gen = torch.Generator().manual_seed(args.seed * 1000 + args.rank + 1)
    optimizer: torch.optim.Optimizer
    sync: MeshSync | None = None
    ring: RingAllReduce | None = None
    channel: DaemonChannel | None = None
    if args.mode == "async":
        optimizer = task.optimizer(list(model.parameters()))
        _emit({"event": "attaching", "rank": args.rank, "at": time.time()})
        attached = attach(
            model,
            optimizer,
            run=args.run,
            socket_path=args.socket,
            config=config,
            min_replicas=args.min_replicas or args.world,
            seed=args.seed,
        )
        assert isinstance(attached, MeshSync)  # one process per node here
        sync = attached
        channel = sync.channel
        buckets = sync.buckets
        _emit(
            {
                "event": "attached",
                "rank": args.rank,
                "start_step": sync.start_step,
                "restored": sync.restored,
                "replicas_wait_s": sync.replicas_wait_s,
                "replicas_heard_s": sync.replicas_heard_s,
                "at": time.time(),
            }
        )
    else:
        if args.mode == "dense":
            channel = DaemonChannel.connect(args.socket)
            welcome = channel.hello(args.run)
            channel.wait(lambda: len(channel.alive) >= args.world, 120)
            order = args.ring.split(",") if args.ring else sorted(channel.alive)
            ring = RingAllReduce(channel, order, str(welcome["peer"]))
        # Flat buckets here too, only so that every mode saves its parameters alike.
        buckets = flatten_parameters(model, BucketLayout.for_module(model, dense_below_numel=0))
        optimizer = task.optimizer(list(model.parameters()))
    numel = sum(p.numel() for p in model.parameters())
    # One extra element rides along: the first trainer's "stop now" vote, so that a
    # time-limited dense run stops on the same step everywhere.
    grad_flat = torch.zeros(numel + 1) if ring is not None else None
    bytes0 = int(channel.fetch_stats().get("udp_bytes_sent", 0)) if channel else 0
    base_lr = [g["lr"] for g in optimizer.param_groups]
    compute_s = eval_s = 0.0
    curve: list[tuple[float, int, float, float, int]] = []
    train_loss = float("nan")
    t_start = time.perf_counter()
    last_report = 0.0
    eval_every = max(1, args.steps // args.evals)

    def evaluate(step: int) -> None:
        nonlocal eval_s
        e0 = time.perf_counter()
        model.eval()
        loss, acc = task.evaluate(model)
        model.train()
        sent = 0
        if channel is not None:  # a fresh count: the plot's x axis must not lag
            sent = int(channel.fetch_stats().get("udp_bytes_sent", 0)) - bytes0
        # Measuring, like evaluating, is not training: this round trip to a busy
        # daemon, counted as wait, was a quarter of the wait fraction.
        eval_s += time.perf_counter() - e0
        curve.append((time.perf_counter() - t_start - eval_s, step, loss, acc, sent))

    stop_votes = 0.0
    start = sync.start_step if sync is not None else 0
    done_steps = start
    max_gap_s = 0.0
    last_step_at: float | None = None
    for step in range(start + 1, args.steps + 1):
        scale = 0.5 * (1 + math.cos(math.pi * (step - 1) / args.steps))
        c0 = time.perf_counter()
        for g, lr in zip(optimizer.param_groups, base_lr, strict=True):
            g["lr"] = lr * scale
        loss = task.loss(model, task.batch(args.rank, args.world, gen))
        optimizer.zero_grad(set_to_none=False)
        loss.backward()  # type: ignore[no-untyped-call]
        if ring is not None and grad_flat is not None:
            c1 = time.perf_counter()
            grads = [p.grad.flatten() for p in model.parameters() if p.grad is not None]
            torch.cat(grads, out=grad_flat[:numel])
            over = args.time_limit_s and time.perf_counter() - t_start - eval_s > args.time_limit_s
            grad_flat[numel] = float(args.world) if (args.rank == 0 and over) else 0.0
            ring.mean_(grad_flat, step)
            stop_votes = float(grad_flat[numel])
            offset = 0
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.copy_(grad_flat[offset : offset + p.numel()].view_as(p))
                    offset += p.numel()
            c0 += time.perf_counter() - c1  # the all-reduce is not compute
        optimizer.step()
        compute_s += time.perf_counter() - c0
        if sync is not None:
            sync.step()
        stepped_at = time.perf_counter()
        if last_step_at is None:
            _emit({"event": "first_step", "rank": args.rank, "step": step, "at": time.time()})
        else:  # the longest time between two steps (a stall shows here)
            max_gap_s = max(max_gap_s, stepped_at - last_step_at)
        last_step_at = stepped_at
        done_steps = step
        lf = float(loss.detach())
        train_loss = lf if math.isnan(train_loss) else 0.9 * train_loss + 0.1 * lf
        if step % eval_every == 0 or step == args.steps:
            evaluate(step)
        if stop_votes > 0.5:  # the time limit: everyone stops after this step
            evaluate(step)
        now = time.perf_counter() - t_start
        if now - last_report >= PROGRESS_EVERY_S or step == args.steps or stop_votes > 0.5:
            last_report = now
            info: dict[str, Any] = {
                "event": "progress",
                "rank": args.rank,
                "t": round(now, 3),
                "step": step,
                "loss": round(train_loss, 4),
                "eval_loss": curve[-1][2] if curve else None,
                "bytes": curve[-1][4] if curve else 0,
                "max_gap_s": round(max_gap_s, 3),
                "at": time.time(),
            }
            max_gap_s = 0.0
            if sync is not None:
                st = sync.stats
                info.update(
                    staleness=st["staleness_p99"],
                    wait_s=round(st["wait_s"], 3),
                    max_wait_s=round(st["max_wait_s"], 3),
                )
            _emit(info)
        if stop_votes > 0.5:
            break
        if args.stop_file and os.path.exists(args.stop_file):
            break  # told to stop (tests, benchmarks): finish() settles as at the end
    wall_s = time.perf_counter() - t_start - eval_s
    complete = True
    t_finish = time.perf_counter()
    if sync is not None:
        complete = sync.finish()
    finish_s = time.perf_counter() - t_finish
    final_loss, final_acc = task.evaluate(model)
    stats = channel.fetch_stats() if channel is not None else {}
    sent = int(stats.get("udp_bytes_sent", 0)) - bytes0 if channel else 0
    result: dict[str, Any] = {
        "event": "done",
        "mode": args.mode,
        "task": args.task,
        "rank": args.rank,
        "seed": args.seed,
        "steps": done_steps,
        "start_step": start,
        "eval_loss": final_loss,
        "accuracy": final_acc,
        "wall_s": wall_s,
        "finish_s": finish_s,
        "compute_s": compute_s,
        "wait_fraction": max(0.0, (wall_s - compute_s) / wall_s) if wall_s > 0 else 0.0,
        "step_ms": 1000 * compute_s / max(1, done_steps - start),
        "udp_bytes_sent": sent,
        "bytes_per_step": sent / max(1, done_steps - start),
        "curve": curve,
        "finished_in_sync": complete,
    }
    if sync is not None:
        result["sync"] = sync.stats
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.save([b.detach().cpu() for b in buckets], out / f"params-{args.rank}.pt")
    (out / f"result-{args.rank}.json").write_text(json.dumps(result))
    if sync is not None:
        sync.close()
    elif channel is not None:
        channel.close()
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ciuic_p2p.train.worker")
    p.add_argument("--mode", choices=["async", "dense", "single"], default="async")
    p.add_argument("--task", default="digits")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world", type=int, default=1)
    p.add_argument(
        "--min-replicas", type=int, default=0, help="async: wait for this many (default --world)"
    )
    p.add_argument("--socket", default=None)
    p.add_argument("--run", default="demo")
    p.add_argument("--config", default=None)
    p.add_argument("--evals", type=int, default=20, help="evaluations over the run")
    p.add_argument("--out", default=".")
    p.add_argument(
        "--time-limit-s", type=float, default=0.0, help="dense: stop after this much training"
    )
    p.add_argument("--hidden", type=int, default=0, help="digits: hidden width")
    p.add_argument("--stop-file", help="stop after the step during which this file appears")
    p.add_argument("--ring", help="dense: the ring's peer IDs in order (default: sorted)")
    p.add_argument("--switch-interval-s", type=float, default=0.0005)
    args = p.parse_args(argv)
    result = run(args)
    _emit({k: v for k, v in result.items() if k not in ("curve", "sync")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
