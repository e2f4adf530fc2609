"""Nodes with several ranks: torchrun starts two CPU ranks (gloo, DDP) on each of two
nodes; the ranks of a node train as one replica of the mesh (train.localranks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from ciuic_p2p.core.replica.rule import consensus_distance
from ciuic_p2p.lab.cluster import LocalCluster, free_port_block, spread_nodes

pytestmark = pytest.mark.processes

SCRIPT = r"""
import gc, json, sys, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from ciuic_p2p.config import load_config
from ciuic_p2p.train.attach import attach

socket_path, config_path, out, node = sys.argv[1:5]
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
# 16,384 weights in the first layer: a sparse bucket (top-k), beside a dense one.
net = torch.nn.Sequential(torch.nn.Linear(8, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 1))
model = DDP(net)
opt = torch.optim.SGD(model.parameters(), lr=0.005, momentum=0.9)
sync = attach(model, opt, run="ranks", socket_path=socket_path, config=load_config(config_path),
              min_replicas=2, process_group=dist.group.WORLD)
gen = torch.Generator().manual_seed(100 * int(node) + rank)
w = torch.linspace(-1, 1, 8).unsqueeze(1)
apart = False
for step in range(80):
    x = torch.randn(16, 8, generator=gen)
    loss = (model(x) - x @ w).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    sync.step()
    # The ranks hold the very same parameters after every step, not only at the end.
    total = torch.cat([b.flatten() for b in sync.buckets]).double().sum().reshape(1)
    seen = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(seen, total)
    apart = apart or len({float(t) for t in seen}) > 1
complete = sync.finish(60)
stats = sync.stats
torch.save([b.detach().clone() for b in sync.buckets], f"{out}/params-{node}-{rank}.pt")
print(json.dumps({"rank": rank, "complete": complete, "local_ranks": stats["local_ranks"],
                  "applied": stats.get("applied"), "loss": float(loss.detach()),
                  "apart": apart,
                  "received": stats.get("received_bytes"),
                  "chunk_bytes": stats.get("chunk_bytes_received"),
                  "entries": stats.get("mirror_entries")}), flush=True)
sync.close()
# DDP's reducer goes while the process group it uses still lives: left to the
# interpreter's exit, a rank aborted there about one run in four.
del model
gc.collect()
dist.barrier()
dist.destroy_process_group()
"""

CONFIG = """
[train]
# No influence bounds: each receiver would scale a peer's chunk by its own judgement.
# The consensus mix is on (its pulls are replayed against the ranks' own snapshots).
influence_clip_ratio = 100.0
influence_disagreement = 0.0
"""


OUTER = """mode = "outer"
inner_steps = 10
"""
"""Rounds of 10 steps, averaged (with Nesterov momentum a round's kick would go to the
other ranks dense: 4 bytes per parameter a round)."""


def json_objects(text: str) -> list[dict[str, Any]]:
    """Every JSON object printed: the two ranks share torchrun's stdout, and when they
    finish at the same moment one's line can land inside the other's."""
    decoder = json.JSONDecoder()
    found = []
    i = text.find('{"rank"')
    while i >= 0:
        obj, end = decoder.raw_decode(text, i)
        found.append(obj)
        i = text.find('{"rank"', end)
    return found


@pytest.mark.parametrize("mode", ["step", "outer"])
def test_torchrun_two_ranks_per_node_two_nodes(tmp_path: Path, mode: str) -> None:
    names = spread_nodes("cities11", 2)
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}
    procs: list[subprocess.Popen[str]] = []
    config = CONFIG if mode == "step" else CONFIG + OUTER
    with LocalCluster("cities11", names, tmp_path / "c", config, rate_scale=0.1) as cluster:
        cluster.start()
        port = free_port_block(2)
        try:
            for node, name in enumerate(names):
                cmd = [
                    sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
                    "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                    "--master-port", str(port + node), str(script),
                    str(cluster.trainer_socket(name)), str(cluster.config_path), str(out),
                    str(node),
                ]  # fmt: skip
                procs.append(
                    subprocess.Popen(
                        cmd,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE,
                        text=True,
                        env=env,
                        start_new_session=True,
                    )
                )
            outputs = [p.communicate(timeout=240) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.communicate()
    for p, (stdout, stderr) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, stderr[-3000:]
        lines = json_objects(stdout)
        assert sorted(x["rank"] for x in lines) == [0, 1]
        assert all(x["complete"] and x["local_ranks"] == 2 for x in lines), lines
        # Only the first rank of a node speaks to the mesh.
        first, other = sorted(lines, key=lambda x: x["rank"])
        assert first["applied"] is not None and other["applied"] is None
        # The other rank replays the first's adds from the chunks themselves: about
        # the compressed chunks its node received, and its own once more (N = 2: as
        # much again), not the model every step.
        assert not first["apart"] and not other["apart"]  # equal after every step
        assert first["entries"].get("chunk", 0) > 0  # chunks replayed, not buckets sent
        print(f"a second rank received {other['received']} bytes; its node's chunks "
              f"{first['chunk_bytes']}")  # fmt: skip
        assert 0 < other["received"] <= 2 * first["chunk_bytes"], (other, first)
    params = {(n, r): torch.load(out / f"params-{n}-{r}.pt") for n in range(2) for r in range(2)}
    for n in range(2):  # the ranks of a node hold the very same parameters
        assert all(torch.equal(a, b) for a, b in zip(params[n, 0], params[n, 1], strict=True))
    # and the two nodes are replicas of one model (finish()'s last round).
    assert consensus_distance([params[0, 0], params[1, 0]]) < 1e-4


OPTIMIZER_SCRIPT = r"""
import sys, torch, torch.distributed as dist
from ciuic_p2p.train.localranks import broadcast_optimizer_state

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Linear(4, 3)
opt = torch.optim.AdamW(model.parameters(), lr=0.1)
if rank == 0:  # the first rank restored a state: two steps in
    for _ in range(2):
        model(torch.randn(5, 4)).sum().backward()
        opt.step()
cpu = torch.device("cpu")
broadcast_optimizer_state(opt, rank == 0, 0, dist.group.WORLD, cpu, cpu)
state = opt.state_dict()["state"]
sums = {k: {n: float(v.double().sum()) for n, v in s.items()} for k, s in state.items()}
with open(f"{sys.argv[1]}/state-{rank}.txt", "w") as f:
    f.write(repr(sums))
dist.barrier()  # both ranks done with gloo before it goes (one teardown in six aborted)
dist.destroy_process_group()
"""


def _torchrun_two_ranks(script: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """``script TMP_PATH`` on two local gloo ranks under torchrun, to its end."""
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node",
        "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port_block(1)), str(script),
        str(tmp_path),
    ]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120, check=False)


def test_the_restored_optimizer_state_reaches_every_rank_as_tensors(tmp_path: Path) -> None:
    script = tmp_path / "opt.py"
    script.write_text(OPTIMIZER_SCRIPT)
    done = _torchrun_two_ranks(script, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    states = [(tmp_path / f"state-{rank}.txt").read_text() for rank in range(2)]
    assert states[0] == states[1], states  # the same state on both ranks
    assert "exp_avg" in states[0] and "step" in states[0]


FSDP2_SCRIPT = r"""
import sys, torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from ciuic_p2p.train.attach import attach

dist.init_process_group("gloo")
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
fully_shard(model)
try:
    where = sys.argv[1] + "/nowhere.sock"
    attach(model, run="r", socket_path=where)  # no process_group: its shard alone
except ValueError as exc:
    print(f"rank {dist.get_rank()}: {exc}", flush=True)
dist.barrier()
dist.destroy_process_group()
"""


def test_a_model_sharded_with_fsdp2_needs_its_process_group(tmp_path: Path) -> None:
    """A DTensor parameter without the node's process group (a rank's shard is not a
    replica) is refused at once, on every rank, naming the parameter and what to pass
    (before sharded replicas: a deep DTensor error from the first copy)."""
    script = tmp_path / "fsdp2.py"
    script.write_text(FSDP2_SCRIPT)
    done = _torchrun_two_ranks(script, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank}: 0.weight is a DTensor" in done.stdout, done.stdout
    assert "pass the node's ranks as process_group=" in done.stdout
