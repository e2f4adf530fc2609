"""One training peer of bench/compare.py's workload 2 (run as a script, one process per
peer, in the environment ``make bench-deps`` builds).

    compare_train.py ddp RANK WORLD PORT STEPS SEED
    compare_train.py hivemind RANK WORLD STEPS SEED [INITIAL_PEER ...]

Both train the digits task (ciuic_p2p.lab.tasks: the same model, optimizer, data
shards, batch size and seeds as ciuic's worker) on STEPS x 256 samples per peer: DDP
averages gradients over gloo every step; hivemind.Optimizer with
``target_batch_size`` WORLD x 256 averages gradients once per epoch of at least that
many samples across the peers, stepping the same SGD. The driver's protocol on
stdin/stdout is compare_peers.py's: ``@@`` JSON lines out (``addr``, ``ready``,
``done``), commands in (``go``, ``exit``).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from typing import Any

import torch

from ciuic_p2p.lab.tasks import DigitsTask


def say(kind: str, **fields: Any) -> None:
    sys.stdout.write("@@ " + json.dumps({"kind": kind, **fields}) + "\n")
    sys.stdout.flush()


def wait_for(command: str) -> None:
    for line in sys.stdin:
        if line.strip() == command:
            return
    raise SystemExit(0)  # the driver went away


def setup(seed: int, rank: int) -> tuple[DigitsTask, torch.nn.Module, torch.Generator]:
    torch.set_num_threads(1)
    task = DigitsTask()
    torch.manual_seed(seed)  # every peer starts from the same weights, as ciuic's do
    model = task.model()
    return task, model, torch.Generator().manual_seed(seed * 1000 + rank + 1)


def ddp(rank: int, world: int, port: int, steps: int, seed: int) -> None:
    import torch.distributed as dist  # noqa: PLC0415
    from torch.nn.parallel import DistributedDataParallel  # noqa: PLC0415

    task, model, gen = setup(seed, rank)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    wrapped = DistributedDataParallel(model)
    opt = task.optimizer(list(wrapped.parameters()))
    dist.barrier()
    say("ready")
    wait_for("go")
    for _ in range(steps):
        loss = task.loss(wrapped, task.batch(rank, world, gen))
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
    t = time.time()
    eval_loss, acc = task.evaluate(model)
    say("done", t=t, loss=eval_loss, accuracy=acc, samples=steps * task.batch_size)
    wait_for("exit")
    dist.destroy_process_group()


def hivemind_peer(rank: int, world: int, steps: int, seed: int, initial: list[str]) -> None:
    hivemind = importlib.import_module("hivemind")  # untyped; not in the dev environment

    task, model, gen = setup(seed, rank)
    dht = hivemind.DHT(
        initial_peers=initial or None, host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True
    )
    say("addr", maddrs=[str(a) for a in dht.get_visible_maddrs()])
    opt = hivemind.Optimizer(
        dht=dht,
        run_id="ciuic-compare",
        params=model.parameters(),
        optimizer=task.optimizer,
        batch_size_per_step=task.batch_size,
        target_batch_size=world * task.batch_size,
        # Loopback: the defaults (15 s matchmaking, progress refreshed every 3 s) are
        # for the internet; hivemind warns unless the request timeout is below the
        # matchmaking time. Even so its averaging rounds often fail on these 2 shared
        # cores ("could not find a group"): the driver counts them from the logs.
        matchmaking_time=1.0,
        averager_opts={"request_timeout": 0.5},
        averaging_timeout=10.0,
        tracker_opts={
            "min_refresh_period": 0.05,
            "max_refresh_period": 0.5,
            "default_refresh_period": 0.2,
        },
        verbose=False,
    )
    say("ready")
    wait_for("go")
    # The same samples as the others: this peer's share, STEPS x 256. hivemind keeps
    # accumulating while an epoch's averaging runs (those samples join the epoch), so
    # it takes fewer epochs than STEPS for them; stopping at STEPS epochs instead
    # processed 2-3 times the samples here.
    samples = 0
    while samples < steps * task.batch_size:
        loss = task.loss(model, task.batch(rank, world, gen))
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        opt.zero_grad()
        samples += task.batch_size
    t = time.time()
    eval_loss, acc = task.evaluate(model)
    say("done", t=t, loss=eval_loss, accuracy=acc, samples=samples, epoch=opt.local_epoch)
    wait_for("exit")
    opt.shutdown()
    dht.shutdown()


def main(argv: list[str]) -> None:
    mode, rank, world = argv[0], int(argv[1]), int(argv[2])
    if mode == "ddp":
        ddp(rank, world, int(argv[3]), int(argv[4]), int(argv[5]))
    elif mode == "hivemind":
        hivemind_peer(rank, world, int(argv[3]), int(argv[4]), argv[5:])
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    os._exit(0)  # hivemind's background processes must not hold the exit


if __name__ == "__main__":
    main(sys.argv[1:])
