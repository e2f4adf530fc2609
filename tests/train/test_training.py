"""Training end to end, as in production: four `ciuic-node run` daemon processes on
the emulated 11-city WAN, a trainer process beside each (lab.worker, the hook), on
loopback. Bounded: each run has a timeout; every process is ended by its PID."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ciuic_p2p.lab import worker
from ciuic_p2p.lab.cluster import LocalCluster, spread_nodes
from ciuic_p2p.lab.demo import DEMO_CONFIG
from ciuic_p2p.lab.report import final_consensus, summarize
from ciuic_p2p.lab.tasks import make_task

pytestmark = pytest.mark.processes

# A trainer starved of CPU for a while (eight processes on two cores) is excused after
# `train.stall_grace_s` and its later chunks arrive past the bound, as designed; a
# longer grace than the default keeps that rare here, so the bound is what is checked.
CONFIG = DEMO_CONFIG.format(density=0.01, send_interval=2, max_interval=16, bound=64).replace(
    "\n\n[log]", "\nstall_grace_s = 2.0\n\n[log]"
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    names = spread_nodes("cities11", 4)
    c = LocalCluster("cities11", names, tmp_path_factory.mktemp("cluster"), CONFIG, 0.1)
    try:
        c.start(timeout_s=90)
        yield c
    finally:
        c.stop()


def test_four_nodes_train_digits_to_95_percent_every_chunk_applied_once(
    cluster: LocalCluster,
) -> None:
    out = cluster.workdir / "async"
    results = cluster.train("async", "digits", 150, 0, out, timeout_s=240)
    summary = summarize(results)
    # On two busy cores a trainer sometimes attaches after the others started: it then
    # joins from their state and is excused while it is behind (tests/train/
    # test_elastic.py), so its chunks arrive later than the bound. A replica that
    # excused a stalled peer sees its chunks late too. Otherwise none may.
    late = any((r["sync"]["restored"] or {}).get("source") == "mesh" for r in results)
    for r in results:
        assert r["accuracy"] >= 0.95, (r["node"], r["accuracy"])
        assert r["finished_in_sync"], r["node"]
        sync = r["sync"]
        # Exactly once: what each origin says it sent is what was applied here.
        # A replica that attached late holds the first chunks in the state it fetched.
        assert sync["sent_by_origin"] and all(
            sync["applied_by_origin"][o] + sync["held_by_state_by_origin"][o] == n
            for o, n in sync["sent_by_origin"].items()
        )
        assert sync["refused"] == {}, sync["last_refusal"]
        assert late or sync["excused"] > 0 or sync["staleness_p99"] <= sync["staleness_bound"], (
            r["node"],
            sync["staleness_p99"],
        )
        # The error-feedback residual stays bounded (the unit test checks it does not
        # grow over a run; here, that it stays below the parameters' own norm).
        params = torch.load(out / f"params-{r['rank']}.pt")
        assert sync["residual_norm_max"] < float(torch.linalg.vector_norm(params[0]))
    assert summary["exactly_once"]
    assert final_consensus(out, len(results)) <= 0.05
    assert summary["bytes_per_step"] > 0


def test_dense_ring_all_reduce_keeps_replicas_identical(cluster: LocalCluster) -> None:
    out = cluster.workdir / "dense"
    results = cluster.train("dense", "digits", 6, 0, out, timeout_s=180)
    assert all(r["steps"] == 6 for r in results)
    # Same gradients everywhere, same optimizer: the replicas stay bit-identical up to
    # summation order.
    assert final_consensus(out, len(results)) < 1e-6
    assert all(r["bytes_per_step"] > 100_000 for r in results)  # fp32, 85k parameters


def _children(pid: int) -> set[int]:
    kids = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.add(int(entry))
    return kids


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_demo_ctrl_c_leaves_no_process_behind(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ciuic_p2p.cli",
            "demo",
            "--nodes",
            "2",
            "--steps",
            "100000",
            "--out",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        seen = ""
        deadline = time.monotonic() + 120
        while "asynchronous" not in seen and time.monotonic() < deadline:
            seen += proc.stdout.readline()
        assert "asynchronous" in seen, seen
        started: set[int] = set()
        while len(started) < 4 and time.monotonic() < deadline:  # 2 daemons, 2 trainers
            started |= _children(proc.pid)
            time.sleep(0.2)
        assert len(started) >= 4, started
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, seen + rest
    assert "no process left behind" in rest
    assert not [pid for pid in started if _alive(pid)]


def test_outer_step_mode_completes_every_round_on_every_replica(cluster: LocalCluster) -> None:
    """``train.mode = "outer"`` through the daemons: 12 rounds of 5 steps, Nesterov,
    sparse 4-bit pseudo-gradients; every replica completes every round, applies every
    chunk once and ends beside the others."""
    out = cluster.workdir / "outer"
    env = {
        "CIUIC_TRAIN_MODE": '"outer"',
        "CIUIC_TRAIN_INNER_STEPS": "5",
        "CIUIC_TRAIN_OUTER_OPTIMIZER": '"nesterov"',
        "CIUIC_TRAIN_OUTER_LR": "0.7",
        "CIUIC_TRAIN_OUTER_MOMENTUM": "0.5",
        "CIUIC_CODEC_DENSITY": "0.05",
        "CIUIC_CODEC_VALUE_MODE": '"int4"',
    }
    results = cluster.train("async", "digits", 60, 0, out, timeout_s=240, env=env)
    late = any((r["sync"]["restored"] or {}).get("source") == "mesh" for r in results)
    for r in results:
        sync = r["sync"]
        assert sync["mode"] == "outer"
        # A replica that attached after the others began restores their state and
        # sends only the rounds after its start (the mesh's state, not step 0).
        assert sync["sends"] == 12 - r["start_step"] // 5, (r["node"], r["start_step"])
        assert sync["send_interval"] == 5
        assert r["start_step"] == 0 or sync["restored"]["source"] == "mesh"
        assert late or sync["rounds_completed"] == 12, (r["node"], sync["rounds_completed"])
        assert sync["refused"] == {}, sync["last_refusal"]
        assert r["accuracy"] >= 0.75, (r["node"], r["accuracy"])  # chance: 0.1
    assert summarize(results)["exactly_once"]
    # Each replica keeps its own unsent residual (95% of the entries of its last rounds)
    # in its parameters: 0.011-0.068 measured in bench/training.py, 0.053 here once.
    assert final_consensus(out, len(results)) <= 0.1


def test_ddp_baseline_is_the_exact_mean_of_the_replicas_gradients(tmp_path: Path) -> None:
    """The benchmark's DDP row: one process, the mean of N replicas' gradients each step,
    equal to one model trained on the N batches together (equal batch sizes); and the
    pad makes each step take the accelerator's step time."""
    steps, world, seed = 3, 4, 7
    args = [
        "--mode", "ddp", "--task", "digits", "--steps", str(steps), "--seed", str(seed),
        "--world", str(world), "--out", str(tmp_path), "--evals", "1", "--step-s", "0.05",
    ]  # fmt: skip
    assert worker.main(args) == 0
    got = torch.load(tmp_path / "params-0.pt")
    task = make_task("digits")
    torch.manual_seed(seed)
    model = task.model()
    opt = task.optimizer(list(model.parameters()))
    gens = [torch.Generator().manual_seed(seed * 1000 + r + 1) for r in range(world)]
    base_lr = [g["lr"] for g in opt.param_groups]
    for step in range(1, steps + 1):
        for g, lr in zip(opt.param_groups, base_lr, strict=True):
            g["lr"] = lr * 0.5 * (1 + math.cos(math.pi * (step - 1) / steps))
        batches = [task.batch(r, world, g) for r, g in enumerate(gens)]
        x = torch.cat([b[0] for b in batches])
        y = torch.cat([b[1] for b in batches])
        opt.zero_grad()
        torch.autograd.backward(task.loss(model, (x, y)))
        opt.step()
    want = torch.cat([p.detach().flatten() for p in model.parameters()])
    torch.testing.assert_close(torch.cat([b.flatten() for b in got]), want, rtol=1e-5, atol=1e-6)
    result = json.loads((tmp_path / "result-0.json").read_text())
    assert result["compute_s"] >= steps * 0.05
