"""One trainer process: a task trained for a number of steps in one of three modes,
reporting progress as JSON lines on stdout and its result in ``OUT/result-RANK.json``
(with its final parameters in ``OUT/params-RANK.pt``).

- ``async``: the hook (``ciuic_p2p.attach``) on the node's daemon (its config file,
  with ``CIUIC_*`` variables over it: ``CIUIC_TRAIN_MODE=outer`` runs the outer step);
- ``dense``: synchronous ring all-reduce of fp32 gradients through the same daemon;
- ``ddp``: what dense data parallelism computes, in one process, no network: each step
  the exact mean of the gradients of the ``--world`` replicas' batches (the same
  batches, per rank, as the other modes draw);
- ``single``: one trainer alone, no network (give it N times the steps);
- ``torchft``: torchft's DiLoCo (``ciuic_p2p.lab.torchft_peer``, which starts these).

Step time is split into compute (forward, backward, optimizer; with ``--step-s``, the
step padded to that accelerator time by a sleep before the hook), evaluation (with the
byte count for the plot), and the rest: the wait (hook, network, staleness bound). The
learning rate follows a cosine from ``task.lr`` to zero over the run, the same for
every mode.

    python -m ciuic_p2p.lab.worker --mode async --task digits --steps 300 \\
        --socket /run/ciuic/trainer.sock --rank 0 --world 4 --out runs/a
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ciuic_p2p.config import Config, load_layered
from ciuic_p2p.core.codec.layout import BucketLayout
from ciuic_p2p.lab.ring import RingAllReduce
from ciuic_p2p.lab.tasks import make_task
from ciuic_p2p.lab.torchft_peer import Replica, loopback_tx_bytes
from ciuic_p2p.train.attach import attach
from ciuic_p2p.train.channel import DaemonChannel
from ciuic_p2p.train.hook import MeshSync, flatten_parameters

PROGRESS_EVERY_S = 0.5


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


@dataclass
class _Setup:
    optimizer: torch.optim.Optimizer
    buckets: list[torch.Tensor]
    sync: MeshSync | None = None
    ring: RingAllReduce | None = None
    channel: DaemonChannel | None = None
    torchft: Replica | None = None


def _attach(args: argparse.Namespace, config: Config, task: Any, model: torch.nn.Module) -> _Setup:
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
    return _Setup(optimizer, sync.buckets, sync=sync, channel=sync.channel)


def _set_up_without_hook(args: argparse.Namespace, task: Any, model: torch.nn.Module) -> _Setup:
    ring = channel = None
    if args.mode == "dense":
        channel = DaemonChannel.connect(args.socket)
        welcome = channel.hello(args.run)
        channel.wait(lambda: len(channel.alive) >= args.world, 120)
        order = args.ring.split(",") if args.ring else sorted(channel.alive)
        ring = RingAllReduce(channel, order, str(welcome["peer"]))
    # Flat buckets here too, only so that every mode saves its parameters alike.
    buckets = flatten_parameters(model, BucketLayout.for_module(model, dense_below_numel=0))
    optimizer = task.optimizer(list(model.parameters()))
    replica = None
    if args.mode == "torchft":
        replica = Replica(
            model,
            optimizer,
            replica=args.rank,
            world=args.world,
            lighthouse=args.lighthouse,
            inner_steps=args.inner_steps,
        )
    return _Setup(optimizer, buckets, ring=ring, channel=channel, torchft=replica)


class _DenseGradients:
    """The dense baseline's all-reduce of every gradient, in one flat buffer. One extra
    element rides along: the first trainer's "stop now" vote, so that a time-limited
    dense run stops on the same step everywhere."""

    def __init__(self, model: torch.nn.Module, ring: RingAllReduce) -> None:
        self.model = model
        self.ring = ring
        self.numel = sum(p.numel() for p in model.parameters())
        self.flat = torch.zeros(self.numel + 1)

    def mean_(self, step: int, stop_vote: float) -> float:
        """Average the gradients in place; the sum of stop votes."""
        grads = [p.grad.flatten() for p in self.model.parameters() if p.grad is not None]
        torch.cat(grads, out=self.flat[: self.numel])
        self.flat[self.numel] = stop_vote
        self.ring.mean_(self.flat, step)
        offset = 0
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.copy_(self.flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
        return float(self.flat[self.numel])


class _Run:
    """One run of the loop: the timings, the evaluation curve and the result."""

    def __init__(self, args: argparse.Namespace, task: Any, model: torch.nn.Module) -> None:
        self.args = args
        self.task = task
        self.model = model
        self.parts = (
            _attach(args, _config(args), task, model)
            if args.mode == "async"
            else _set_up_without_hook(args, task, model)
        )
        self.gens: list[torch.Generator] = []
        """``ddp``: each simulated replica's own batch stream."""
        ring = self.parts.ring
        self.dense = _DenseGradients(model, ring) if ring is not None else None
        self.bytes0 = self._bytes_sent()
        self.compute_s = self.eval_s = 0.0
        self.curve: list[tuple[float, int, float, float, int]] = []
        self.train_loss = float("nan")
        self.t_start = time.perf_counter()
        self.max_gap_s = 0.0
        self.last_step_at: float | None = None

    def _bytes_sent(self) -> int:
        channel = self.parts.channel
        if self.parts.torchft is not None:  # the namespace's loopback, shared out
            return loopback_tx_bytes() // max(1, int(self.args.world))
        return int(channel.fetch_stats().get("udp_bytes_sent", 0)) if channel else 0

    def evaluate(self, step: int) -> None:
        e0 = time.perf_counter()
        self.model.eval()
        loss, acc = self.task.evaluate(self.model)
        self.model.train()
        sent = 0
        if self.parts.channel is not None or self.parts.torchft is not None:
            # A fresh count: the plot's x axis must not lag.
            sent = self._bytes_sent() - self.bytes0
        # Measuring, like evaluating, is not training: this round trip to a busy
        # daemon, counted as wait, was a quarter of the wait fraction.
        self.eval_s += time.perf_counter() - e0
        self.curve.append((time.perf_counter() - self.t_start - self.eval_s, step, loss, acc, sent))

    def train_step(self, step: int, gen: torch.Generator, base_lr: list[float]) -> float:
        """One step (compute, the dense all-reduce or the hook); the stop votes."""
        args, optimizer = self.args, self.parts.optimizer
        scale = 0.5 * (1 + math.cos(math.pi * (step - 1) / args.steps))
        c0 = time.perf_counter()
        for g, lr in zip(optimizer.param_groups, base_lr, strict=True):
            g["lr"] = lr * scale
        optimizer.zero_grad(set_to_none=False)
        if args.mode == "ddp":
            loss = self._ddp_backward(gen)
        else:
            loss = self.task.loss(self.model, self.task.batch(args.rank, args.world, gen))
            loss.backward()
        stop_votes = 0.0
        if self.dense is not None:
            c1 = time.perf_counter()
            trained_s = time.perf_counter() - self.t_start - self.eval_s
            over = args.time_limit_s and trained_s > args.time_limit_s
            vote = float(args.world) if (args.rank == 0 and over) else 0.0
            stop_votes = self.dense.mean_(step, vote)
            c0 += time.perf_counter() - c1  # the all-reduce is not compute
        optimizer.step()
        if self.parts.torchft is not None:  # its round's all-reduce is not compute
            c0 += time.perf_counter() - self.parts.torchft.inner_done_at
        computed_s = time.perf_counter() - c0
        if args.step_s > computed_s:  # the accelerator's step time, before the hook
            time.sleep(args.step_s - computed_s)
        self.compute_s += max(computed_s, args.step_s)
        if self.parts.sync is not None:
            self.parts.sync.step()
        stepped_at = time.perf_counter()
        if self.last_step_at is None:
            _emit({"event": "first_step", "rank": args.rank, "step": step, "at": time.time()})
        else:  # the longest time between two steps (a stall shows here)
            self.max_gap_s = max(self.max_gap_s, stepped_at - self.last_step_at)
        self.last_step_at = stepped_at
        lf = float(loss.detach())
        self.train_loss = lf if math.isnan(self.train_loss) else 0.9 * self.train_loss + 0.1 * lf
        return stop_votes

    def _ddp_backward(self, gen: torch.Generator) -> torch.Tensor:
        """Gradients of every replica's batch, averaged: DDP's exact mean."""
        args = self.args
        if not self.gens:
            self.gens = [gen] + [
                torch.Generator().manual_seed(args.seed * 1000 + r + 1)
                for r in range(1, args.world)
            ]
        total = torch.zeros(())
        for r, g in enumerate(self.gens):
            loss = self.task.loss(self.model, self.task.batch(r, args.world, g)) / args.world
            loss.backward()
            total += loss.detach()
        return total

    def progress(self, now: float, step: int) -> dict[str, Any]:
        info: dict[str, Any] = {
            "event": "progress",
            "rank": self.args.rank,
            "t": round(now, 3),
            "step": step,
            "loss": round(self.train_loss, 4),
            "eval_loss": self.curve[-1][2] if self.curve else None,
            "bytes": self.curve[-1][4] if self.curve else 0,
            "max_gap_s": round(self.max_gap_s, 3),
            "at": time.time(),
        }
        self.max_gap_s = 0.0
        if self.parts.sync is not None:
            st = self.parts.sync.stats
            info.update(
                staleness=st["staleness_p99"],
                wait_s=round(st["wait_s"], 3),
                max_wait_s=round(st["max_wait_s"], 3),
            )
        return info

    def loop(self, start: int) -> int:
        """Train from ``start``; the last step done."""
        args = self.args
        gen = torch.Generator().manual_seed(args.seed * 1000 + args.rank + 1)
        base_lr = [g["lr"] for g in self.parts.optimizer.param_groups]
        eval_every = max(1, args.steps // args.evals)
        last_report = 0.0
        done_steps = start
        for step in range(start + 1, args.steps + 1):
            stop = self.train_step(step, gen, base_lr) > 0.5
            done_steps = step
            if step % eval_every == 0 or step == args.steps or stop:
                self.evaluate(step)  # and at the time limit: everyone stops after this step
            now = time.perf_counter() - self.t_start
            if now - last_report >= PROGRESS_EVERY_S or step == args.steps or stop:
                last_report = now
                _emit(self.progress(now, step))
            if stop:
                break
            if args.stop_file and os.path.exists(args.stop_file):
                break  # told to stop (tests, benchmarks): finish() settles as at the end
            if args.stop_at and step >= args.stop_at:
                break  # a run cut short at a known step, its schedule still --steps long
        return done_steps

    def result(self, start: int, done_steps: int) -> dict[str, Any]:
        args, sync = self.args, self.parts.sync
        wall_s = time.perf_counter() - self.t_start - self.eval_s
        t_finish = time.perf_counter()
        complete = sync.finish() if sync is not None else True
        finish_s = time.perf_counter() - t_finish
        final_loss, final_acc = self.task.evaluate(self.model)
        sent = self._bytes_sent() - self.bytes0
        steps = max(1, done_steps - start)
        result: dict[str, Any] = {
            "event": "done",
            "mode": args.mode,
            "task": args.task,
            "rank": args.rank,
            "seed": args.seed,
            "steps": done_steps,
            "start_step": start,
            "params": sum(p.numel() for p in self.model.parameters()),
            "eval_loss": final_loss,
            "accuracy": final_acc,
            "wall_s": wall_s,
            "finish_s": finish_s,
            "compute_s": self.compute_s,
            "wait_fraction": max(0.0, (wall_s - self.compute_s) / wall_s) if wall_s > 0 else 0.0,
            "step_ms": 1000 * self.compute_s / steps,
            "udp_bytes_sent": sent,
            "bytes_per_step": sent / steps,
            "curve": self.curve,
            "finished_in_sync": complete,
        }
        if sync is not None:
            result["sync"] = sync.stats
        if self.parts.torchft is not None:
            result["rounds"] = self.parts.torchft.rounds
        return result

    def close(self) -> None:
        if self.parts.torchft is not None:
            self.parts.torchft.close()
        if self.parts.sync is not None:
            self.parts.sync.close()
        elif self.parts.channel is not None:
            self.parts.channel.close()


def _config(args: argparse.Namespace) -> Config:
    return load_layered(args.config, os.environ) if args.config else Config.wan()


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    # The hook's reader and encoder threads run Python between torch kernels; a short
    # switch interval keeps the training thread from waiting 5 ms for the GIL.
    sys.setswitchinterval(args.switch_interval_s)
    task = make_task(args.task)
    task.lr *= args.lr_scale
    if args.hidden:
        task.hidden = args.hidden  # type: ignore[attr-defined]
    torch.manual_seed(args.seed)
    model = task.model()
    job = _Run(args, task, model)
    start = job.parts.sync.start_step if job.parts.sync is not None else 0
    done_steps = job.loop(start)
    result = job.result(start, done_steps)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.save([b.detach().cpu() for b in job.parts.buckets], out / f"params-{args.rank}.pt")
    (out / f"result-{args.rank}.json").write_text(json.dumps(result))
    job.close()
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ciuic_p2p.lab.worker")
    p.add_argument(
        "--mode", choices=["async", "dense", "ddp", "single", "torchft"], default="async"
    )
    p.add_argument("--task", default="digits")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr-scale", type=float, default=1.0, help="times the task's learning rate")
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
    p.add_argument(
        "--stop-at", type=int, default=0, help="stop after this step (the schedule keeps --steps)"
    )
    p.add_argument("--ring", help="dense: the ring's peer IDs in order (default: sorted)")
    p.add_argument("--switch-interval-s", type=float, default=0.0005)
    p.add_argument(
        "--step-s", type=float, default=0.0, help="pad each step to this accelerator time"
    )
    p.add_argument("--lighthouse", help="torchft: the lighthouse's address")
    p.add_argument("--inner-steps", type=int, default=1, help="torchft: DiLoCo's H")
    args = p.parse_args(argv)
    result = run(args)
    _emit({k: v for k, v in result.items() if k not in ("curve", "sync")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
