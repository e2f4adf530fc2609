"""One trainer of bench/datapath.py: a model of ``--params`` parameters (4 equal
``nn.Linear``), a small real forward/backward and the optimizer's step, padded with a
sleep to ``--step-s`` (an accelerator's step: the host CPU stays free), then the hook.
Prints one JSON object (its measurements) on stdout at the end.

The pad sleeps ``step_s`` minus the measured compute before the hook runs, so the
hook's time is on top of the step, as it would be after an accelerator's step.

The real compute is kept small, as the host's share of a GPU step is: each step runs
the forward and backward of the last layer (a fresh random regression) and SGD over
all parameters; the other layers keep the gradients of a first full backward (on a
GPU node the accelerator computes them; here it would take the host CPU the premise
says is free). Every parameter moves every step, so updates are dense, as a real
model's are."""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import sys
import time
from typing import Any

import torch

from ciuic_p2p import attach
from ciuic_p2p.config import load_config

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def model_of(params: float) -> torch.nn.Sequential:
    width = int(math.sqrt(params / 4))
    torch.manual_seed(0)
    layers = [torch.nn.Linear(width, width, bias=False) for _ in range(4)]
    return torch.nn.Sequential(*layers)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--config", required=True)
    ap.add_argument("--params", type=float, required=True)
    ap.add_argument("--step-s", type=float, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--warmup", type=int, required=True)
    ap.add_argument("--replicas", type=int, required=True)
    ap.add_argument("--rank", type=int, required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = model_of(args.params)
    params = sum(p.numel() for p in model.parameters())
    # A random linear regression: every step moves every weight by about 1e-3 of its
    # size (a dense update, as a real model's), and it stays finite.
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    first = model[0]
    assert isinstance(first, torch.nn.Linear)
    width = first.in_features
    gen = torch.Generator().manual_seed(args.rank)

    last = model[3]
    assert isinstance(last, torch.nn.Linear)

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
            last.weight.grad = None
            loss = (last(h) - target).pow(2).mean()
        loss.backward()
        opt.step()
        return time.perf_counter() - t0

    for _ in range(3):  # gradients and optimizer state exist before the baseline
        compute(full=True)
    rss_without = rss_bytes()
    config = load_config(args.config)
    sync = attach(
        model,
        opt,
        run="datapath",
        socket_path=args.socket,
        config=config,
        min_replicas=args.replicas,
        join_timeout_s=300,
    )
    rss_attached = rss_bytes()
    hook_s: list[float] = []
    wait_s: list[float] = []
    slow: list[dict[str, Any]] = []
    rss_jumps: list[dict[str, Any]] = []
    compute_s: list[float] = []
    rss_peak = 0
    traffic0 = sends0 = merged0 = 0
    consensus_steps: list[int] = []
    t_start = 0.0
    total = args.warmup + args.steps
    for step in range(total):
        if step == args.warmup:
            st = sync.stats
            traffic0, sends0, merged0 = st["hook_traffic_bytes"], st["sends"], st["merged_steps"]
            t_start = time.monotonic()
        c = compute()
        time.sleep(max(0.0, args.step_s - c))
        rss0 = rss_bytes()
        t0 = time.perf_counter()
        waited0 = sync.wait_s
        idle0 = sync.encoder.idle.is_set()
        snaps0 = sync.state.snapshots_sent
        mix0 = sync.replica.wants_params()
        sync.step()
        dt = time.perf_counter() - t0
        if step >= args.warmup:
            hook_s.append(dt)
            wait_s.append(sync.wait_s - waited0)
            grown = rss_bytes() - rss0
            if grown > 64 << 20:  # what the hook held on to in that step
                rss_jumps.append({"step": step, "mb": round(grown / 2**20), "mix": mix0})
            if dt > 0.25 * args.step_s:  # what a slow step was doing
                slow.append(
                    {
                        "step": step,
                        "s": round(dt, 3),
                        "encoder_idle": idle0,
                        "snapshot": sync.state.snapshots_sent != snaps0
                        or sync.channel.snapshot_wanted.is_set(),
                        "mix": mix0,
                    }
                )
            compute_s.append(c)
            rss_peak = max(rss_peak, rss_bytes())
            if sync.replica.wants_params():
                consensus_steps.append(sync.replica.step)
    elapsed = time.monotonic() - t_start
    st = sync.stats
    held = int(st["hook_held_bytes"])
    t_finish = time.monotonic()
    complete = sync.finish(timeout_s=120)
    finish_s = time.monotonic() - t_finish
    final = sync.stats
    sync.close()
    out: dict[str, Any] = {
        "rank": args.rank,
        "params": params,
        "hook_s": hook_s,
        "wait_s": wait_s,
        "slow_steps": slow,
        "rss_jumps": rss_jumps,
        "encode_busy_s": sync.encoder.busy_s,
        "compute_s": compute_s,
        "elapsed_s": elapsed,
        "sends": st["sends"] - sends0,
        "merged_steps": st["merged_steps"] - merged0,
        "traffic_bytes": st["hook_traffic_bytes"] - traffic0,
        "held_bytes": held,
        "rss_without": rss_without,
        "rss_attached": rss_attached,
        "rss_peak": rss_peak,
        "maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        "backoffs": final["backoffs"],
        "consensus_steps": consensus_steps,
        "params_mixed": final["params_mixed"],
        "refused": final["refused"],
        "staleness_hist": [
            [i, int(c)] for i, c in enumerate(sync.replica.stats.staleness.tolist()) if c
        ],
        "applied_by_origin": final["applied_by_origin"],
        "sent_by_origin": final["sent_by_origin"],
        "chunks_sent": final["chunks_sent"],
        "sends_total": final["sends"],
        "snapshots_sent": final["snapshots_sent"],
        "bytes_published": final["bytes_published"],
        "complete": complete,
        "finish_s": finish_s,
        "finish_published_bytes": final["bytes_published"] - st["bytes_published"],
        "final_round": final["final_round"],
        "density": final["density"],
        "send_interval": final["send_interval"],
    }
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
