"""The state of a sharded replica (train.shardckpt): DCP checkpoints that every rank
writes its shard of and that load into another number of ranks, and a node whose rank
was killed resuming from them. Real daemons, torchrun, gloo."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from ciuic_p2p.core.replica.rule import consensus_distance
from ciuic_p2p.lab.cluster import LocalCluster, spread_nodes
from tests.train.test_localranks import json_objects
from tests.train.test_sharded import _process, _tcp_port, _wait_all

pytestmark = pytest.mark.processes

SCRIPT = r"""
import json, os, sys, time, torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from ciuic_p2p.config import load_config
from ciuic_p2p.train.attach import attach

socket_path, config_path, out, kind, steps, nodes, step_s, seed, tag, ckpt = sys.argv[1:11]
ranked = kind == "fsdp2"
if ranked:
    dist.init_process_group("gloo")
rank = dist.get_rank() if ranked else 0
torch.manual_seed(int(seed))
net = torch.nn.Sequential(torch.nn.Linear(8, 2049), torch.nn.ReLU(), torch.nn.Linear(2049, 1))
fresh = [p.detach().clone() for p in net.parameters()]
if ranked:
    fully_shard(net)
opt = torch.optim.SGD(net.parameters(), lr=0.005, momentum=0.9)
sync = attach(net, opt, run="dcp", socket_path=socket_path, config=load_config(config_path),
              min_replicas=int(nodes), join_timeout_s=60,
              checkpoint_dir=f"{out}/ckpt-{ckpt}",
              process_group=dist.group.WORLD if ranked else None)
print(json.dumps({"rank": rank, "pid": os.getpid(), "restored": sync.restored,
                  "start_step": sync.start_step}), flush=True)

def full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()

torch.save({"params": [full(p) for p in net.parameters()], "fresh": fresh,
            "momentum": [full(opt.state[p]["momentum_buffer"]) for p in net.parameters()
                         if "momentum_buffer" in opt.state[p]]},
           f"{out}/attached-{tag}-{rank}.pt")
gen = torch.Generator().manual_seed(10 + rank)
w = torch.linspace(-1, 1, 8).unsqueeze(1)
for step in range(sync.start_step, int(steps)):
    x = torch.randn(16, 8, generator=gen)
    loss = (net(x) - x @ w).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    sync.step()
    if rank == 0 and step % 10 == 0:
        with open(f"{out}/progress-{tag}", "w") as f:
            f.write(str(step))
    time.sleep(float(step_s))
complete = sync.finish(60)
s = sync.stats
final = [full(p) for p in net.parameters()]
if rank == 0:
    torch.save(final, f"{out}/final-{tag}.pt")
print(json.dumps({"rank": rank, "complete": complete, "step": s["step"],
                  "checkpoint_path": s["checkpoint_path"],
                  "checkpoints_written": s["checkpoints_written"],
                  "applied_from": s["applied_from"], "refused": s["refused"],
                  "sent_by_origin": s["sent_by_origin"],
                  "applied_by_origin": s["applied_by_origin"],
                  "held_by_state_by_origin": s["held_by_state_by_origin"],
                  "final_round": s["final_round"], "last_refusal": s["last_refusal"]}), flush=True)
sync.close()
if ranked:
    dist.barrier()
    dist.destroy_process_group()
"""

CONFIG = """
[train]
# These tests check where a sharded replica's state comes from and goes, not how the
# bounds weigh what it sends: no influence bounds, and a last round that takes every
# copy (sharded replicas drift apart more than unsharded ones before it, 5 to 21% of
# a range's RMS here, and a copy past 20% was refused now and then).
influence_clip_ratio = 100.0
influence_disagreement = 0.0
finish_average_distance_max_ratio = 10.0
stall_grace_s = 600.0

[store]
checkpoint_interval_s = {interval}
"""


def _torchrun(args: list[str], ranks: int) -> subprocess.Popen[str]:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node",
        str(ranks), "--master-addr", "127.0.0.1", "--master-port", str(_tcp_port()), *args,
    ]  # fmt: skip
    return _process(cmd)


def _run(cluster: LocalCluster, name: str, script: Path, out: Path, kind: str, ranks: int,
         steps: int, nodes: int = 1, step_s: float = 0.0, seed: int = 0,
         tag: str | None = None, ckpt: str | None = None) -> subprocess.Popen[str]:  # fmt: skip
    """A node's trainer: ``kind`` fsdp2 (``ranks`` under torchrun) or plain; its
    files in ``out`` are named by ``tag`` (default: the kind), its checkpoints are in
    ``out/ckpt-CKPT`` (default: the tag)."""
    tag = tag or kind
    args = [str(script), str(cluster.trainer_socket(name)), str(cluster.config_path), str(out),
            kind, str(steps), str(nodes), str(step_s), str(seed), tag, ckpt or tag]  # fmt: skip
    return _torchrun(args, ranks) if kind == "fsdp2" else _process([sys.executable, *args])


def _lines(
    run: subprocess.Popen[str], timeout_s: float, log: Path | None = None
) -> list[dict[str, Any]]:
    """The trainer's JSON lines, once it ended well; its log kept in ``log``."""
    (stdout, stderr), = _wait_all([run], timeout_s)  # fmt: skip
    if log is not None:
        log.write_text(stderr)
    assert run.returncode == 0, stderr[-3000:]
    return json_objects(stdout)


def _wait_for_step(progress: Path, step: int, timeout_s: float) -> None:
    """Until the trainer writing ``progress`` is at ``step`` or past it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = progress.read_text() if progress.exists() else ""
        if text.isdigit() and int(text) >= step:
            return
        time.sleep(0.1)
    raise AssertionError(f"{progress.name}: not at step {step} within {timeout_s:g} s")


def _dcp_full(directory: Path) -> dict[str, Any]:
    """A DCP checkpoint read whole, as a user inspects one (no process group)."""
    target = directory.parent / (directory.name + ".pt")
    dcp_to_torch_save(directory, target)
    return dict(torch.load(target, weights_only=False))


def test_a_dcp_checkpoint_of_two_ranks_loads_into_one(tmp_path: Path) -> None:
    """Two FSDP2 ranks train and finish: each writes its shard of a DCP checkpoint
    (parameters and optimizer state). A node of one FSDP2 rank then attaches with the
    same checkpoint directory: it starts at the checkpoint's step with exactly its
    parameters and momentum, resharded from two ranks into one."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    names = ["n0"]
    config = CONFIG.format(interval=0)
    with LocalCluster(None, names, tmp_path / "c", config) as cluster:
        cluster.start()
        two = _lines(_run(cluster, names[0], script, out, "fsdp2", 2, 30), 240)
        ends = [x for x in two if "complete" in x]
        assert len(ends) == 2 and all(x["step"] == 30 for x in ends), two
        root = Path(ends[0]["checkpoint_path"])
        assert all(x["checkpoint_path"] == str(root) for x in ends)
        assert all(x["checkpoints_written"] == 1 for x in ends), ends
        written = sorted(p.name for p in root.iterdir())
        assert written == ["step-000000000030"], written
        one_rank = _run(cluster, names[0], script, out, "fsdp2", 1, 30, tag="one", ckpt="fsdp2")
        one = _lines(one_rank, 240)
    start = next(x for x in one if "restored" in x)
    assert start["restored"]["source"] == "checkpoint" and start["start_step"] == 30, start
    saved = _dcp_full(root / "step-000000000030")
    attached = torch.load(out / "attached-one-0.pt")
    names_in_order = ["0.weight", "0.bias", "2.weight", "2.bias"]
    for name, got in zip(names_in_order, attached["params"], strict=True):
        assert torch.equal(saved["model"][name], got), name
    momentum = saved["optim"]["state"]
    for name, got in zip(names_in_order, attached["momentum"], strict=True):
        assert torch.equal(momentum[name]["momentum_buffer"], got), name
    assert len(attached["momentum"]) == 4


def test_a_node_whose_rank_was_killed_resumes_from_its_dcp_checkpoint(tmp_path: Path) -> None:
    """A plain node and a node of two FSDP2 ranks train; one rank is killed with
    SIGKILL. The sharded node's torchrun ends, naming the lost rank; its daemon says
    which rank went away. Started again, the node resumes from its last DCP
    checkpoint (not from its initial weights), both nodes finish the run, and they end
    as one model."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    names = spread_nodes("cities11", 2)
    config = CONFIG.format(interval=0.5)
    with LocalCluster("cities11", names, tmp_path / "c", config, rate_scale=0.1) as cluster:
        cluster.start()
        plain = _run(cluster, names[1], script, out, "plain", 1, 300, nodes=2, step_s=0.05)
        sharded = _run(cluster, names[0], script, out, "fsdp2", 2, 300, nodes=2, step_s=0.05)
        assert sharded.stdout is not None
        pids: dict[int, int] = {}
        while len(pids) < 2:  # each rank's first line: attached, with its PID
            line = sharded.stdout.readline()
            assert line, "the sharded node ended before it attached"
            if line.startswith("{"):
                x = json.loads(line)
                pids[x["rank"]] = x["pid"]
        ckpt = out / "ckpt-fsdp2"
        deadline = time.monotonic() + 120
        while not list(ckpt.glob("*.dcp/step-*")) and time.monotonic() < deadline:
            time.sleep(0.2)  # the node writes its first checkpoint: kill after it
        assert list(ckpt.glob("*.dcp/step-*")), "no checkpoint within 120 s"
        os.kill(pids[1], signal.SIGKILL)
        killed_at = time.monotonic()
        (_, stderr), = _wait_all([sharded], 120)  # fmt: skip
        ended_s = time.monotonic() - killed_at
        assert sharded.returncode != 0
        assert f"Signal 9 (SIGKILL) received by PID {pids[1]}" in stderr, stderr[-3000:]
        (out / "killed.err").write_text(stderr)
        again = _run(cluster, names[0], script, out, "fsdp2", 2, 300, nodes=2, step_s=0.05)
        lines = _lines(again, 300)
        plain_lines = _lines(plain, 300)
        daemon_log = (cluster.state_dir(names[0]) / "daemon.log").read_text(errors="replace")
    print(f"torchrun ended {ended_s:.1f} s after the kill")
    assert ended_s < 60
    start = [x for x in lines if "restored" in x]
    assert len(start) == 2
    for x in start:
        assert x["restored"]["source"] in ("checkpoint", "mesh"), x
        assert x["start_step"] > 0, x
    print("restarted from", [x["restored"] for x in start])
    ends = [x for x in [*lines, *plain_lines] if "complete" in x]
    (out / "ends.json").write_text(json.dumps(ends, indent=1))
    brief = [(x["rank"], x["complete"], x["step"], x["applied_from"], x["refused"]) for x in ends]
    assert len(ends) == 3 and all(x["complete"] for x in ends), brief
    lost = [line for line in daemon_log.splitlines() if "trainer_rank_lost" in line]
    assert len(lost) == 1 and json.loads(lost[0])["rank"] == 1, lost
    models = [torch.load(out / f"final-{kind}.pt") for kind in ("plain", "fsdp2")]
    distance = consensus_distance(models)
    print(f"after the restart, the nodes end {distance:.2e} apart")
    assert distance <= 1e-3


def test_a_late_sharded_node_starts_from_the_run_state_fetching_its_rows(
    tmp_path: Path,
) -> None:
    """A plain node and a node of two FSDP2 ranks train; a node of two FSDP2 ranks with
    other initial weights joins under way. Each of its ranks fetches only its rows of
    a replica's state (about half of it) and starts from there, not from its own
    weights; the three finish the run as one model."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    names = spread_nodes("cities11", 3)
    config = CONFIG.format(interval=0)
    with LocalCluster("cities11", names, tmp_path / "c", config, rate_scale=0.1) as cluster:
        cluster.start()
        plain = _run(cluster, names[0], script, out, "plain", 1, 500, nodes=2, step_s=0.05)
        sharded = _run(cluster, names[1], script, out, "fsdp2", 2, 500, nodes=2, step_s=0.05)
        _wait_for_step(out / "progress-plain", 40, 120)  # the run is under way
        late = _run(cluster, names[2], script, out, "fsdp2", 2, 500, nodes=3, step_s=0.05,
                    seed=99, tag="late")  # fmt: skip
        late_lines = _lines(late, 300, out / "late.err")
        lines = [*_lines(plain, 300, out / "plain.err"), *_lines(sharded, 300, out / "fsdp2.err")]
    start = [x for x in late_lines if "restored" in x]
    assert len(start) == 2
    for x in start:
        info = x["restored"]
        assert info["source"] == "mesh" and info["ranges"] and x["start_step"] > 0, info
    state_bytes = 2 * 20_491 * 4 + 16_384  # parameters and momentum, and the meta area
    assert all(x["restored"]["bytes"] < 0.7 * state_bytes for x in start), start
    attached = [torch.load(out / f"attached-late-{rank}.pt") for rank in range(2)]
    fresh = torch.cat([t.flatten() for t in attached[0]["fresh"]])
    began = torch.cat([t.flatten() for t in attached[0]["params"]])
    assert float((began - fresh).norm()) > 0.5 * float(fresh.norm())  # not its own weights
    assert all(x["start_step"] < 400 for x in start), start  # it trained with them
    ends = [x for x in [*late_lines, *lines] if "complete" in x]
    (out / "ends.json").write_text(json.dumps(ends, indent=1))
    assert len(ends) == 5 and all(x["complete"] for x in ends), ends
    models = [torch.load(out / f"final-{tag}.pt") for tag in ("plain", "fsdp2", "late")]
    distance = consensus_distance(models)
    print(f"with a late sharded joiner, the nodes end {distance:.2e} apart")
    assert distance <= 1e-3
