"""Sharded replicas (train.sharded): what FSDP2 does to a model on this machine's CPU
(gloo), the pieces of the flat space a rank holds (core.codec.pieces), and nodes of
FSDP2 ranks training one run through their daemons."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from ciuic_p2p.core.codec.layout import BucketLayout
from ciuic_p2p.core.replica.rule import consensus_distance
from ciuic_p2p.lab.cluster import LocalCluster, spread_nodes
from tests.train.test_localranks import _torchrun_two_ranks, json_objects

pytestmark = pytest.mark.processes

SCRIPT = r"""
import json, sys, torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from ciuic_p2p.core.codec.layout import BucketLayout, canonical_name
from ciuic_p2p.core.codec.pieces import PieceMap

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 33), torch.nn.ReLU(), torch.nn.Linear(33, 3))
fully_shard(model)
layout = BucketLayout.for_module(model, dense_below_numel=100)
rows = {}
for name, p in model.named_parameters():
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    assert tuple(p.to_local().shape) == tuple(shape)
    rows[canonical_name(name)] = (offset[0], shape[0])
pieces = PieceMap.of_rows(layout, rows)
out = {"layout_id": layout.layout_id, "rows": rows,
       "pieces": [[p.bucket, p.start, p.numel] for p in pieces.pieces]}
with open(f"{sys.argv[1]}/pieces-{rank}.json", "w") as f:
    json.dump(out, f)
dist.barrier()
dist.destroy_process_group()
"""


def test_fsdp2_ranks_hold_disjoint_pieces_that_cover_the_model(tmp_path: Path) -> None:
    """Two FSDP2 ranks: the layout from the DTensors' global shapes is the unsharded
    model's (a sharded node and a plain one name the same layout), and the ranks'
    pieces, from each DTensor's rows, cover every element of it exactly once."""
    script = tmp_path / "pieces.py"
    script.write_text(SCRIPT)
    done = _torchrun_two_ranks(script, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"pieces-{r}.json").read_text()) for r in range(2)]
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(8, 33), torch.nn.ReLU(), torch.nn.Linear(33, 3))
    layout = BucketLayout.for_module(plain, dense_below_numel=100)
    assert ranks[0]["layout_id"] == ranks[1]["layout_id"] == layout.layout_id
    assert ranks[0]["rows"]["0.weight"] == [0, 17] and ranks[1]["rows"]["0.weight"] == [17, 16]
    covered = [torch.zeros(b.numel, dtype=torch.int64) for b in layout.buckets]
    for r in ranks:
        for bucket, start, numel in r["pieces"]:
            covered[bucket][start : start + numel] += 1
    assert all(bool((c == 1).all()) for c in covered)


TRAIN_SCRIPT = r"""
import gc, json, sys, torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP
from ciuic_p2p.config import load_config
from ciuic_p2p.errors import LayoutMismatchError
from ciuic_p2p.train.attach import attach

socket_path, config_path, out, node, kind, nodes = sys.argv[1:7]
width = int(sys.argv[7]) if len(sys.argv) > 7 else 2049
ranked = kind in ("fsdp2", "ddp")
if ranked:
    dist.init_process_group("gloo")
rank = dist.get_rank() if ranked else 0
torch.manual_seed(0)
# 16,384 weights in the first layer: sparse chunks (top-k), beside dense ones; 2049
# rows, so two FSDP2 ranks hold 1025 and 1024 of them.
net = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Linear(width, 1))
model = net
if kind == "fsdp2":
    fully_shard(net)
elif kind == "ddp":
    model = DDP(net)
opt = torch.optim.SGD(model.parameters(), lr=0.005, momentum=0.9)
try:
    sync = attach(model, opt, run="sharded", socket_path=socket_path,
                  config=load_config(config_path), min_replicas=int(nodes),
                  join_timeout_s=20, process_group=dist.group.WORLD if ranked else None)
except LayoutMismatchError as exc:
    print(json.dumps({"rank": rank, "node": int(node), "mismatch": str(exc)}), flush=True)
    sys.exit(0)
gen = torch.Generator().manual_seed(100 * int(node) + rank)
w = torch.linspace(-1, 1, 8).unsqueeze(1)
for step in range(80):
    x = torch.randn(16, 8, generator=gen)
    loss = (model(x) - x @ w).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    sync.step()
complete = sync.finish(60)
s = sync.stats
# The test gathers the model (the library never does): full_tensor() on every rank.
full = [(p.full_tensor() if kind == "fsdp2" else p).detach().clone() for p in net.parameters()]
if rank == 0:
    torch.save(full, f"{out}/params-{node}.pt")
print(json.dumps({"rank": rank, "node": int(node), "kind": kind, "peer": s.get("peer"),
                  "complete": complete, "chunks_sent": s.get("chunks_sent"),
                  "applied_from": s.get("applied_from"),
                  "sent_by_origin": s.get("sent_by_origin"), "refused": s.get("refused"),
                  "clipped": s.get("clipped"),
                  "reconnects": getattr(getattr(sync, "channel", None), "reconnects", None),
                  "final_round": s.get("final_round"),
                  "shard": sum(t.numel() for t in getattr(sync, "buckets", [])),
                  "model": sum(p.numel() for p in net.parameters()),
                  "held": s.get("hook_held_bytes"), "loss": float(loss.detach())}), flush=True)
sync.close()
del model, net, opt
gc.collect()
if ranked:
    dist.barrier()
    dist.destroy_process_group()
"""

CONFIG = """
[train]
# No influence bounds: this checks where the chunks land, not how they are weighed.
influence_clip_ratio = 100.0
influence_disagreement = 0.0
# Wait for a node whose ranks are slow (torchrun and FSDP2 on two cores busy with the
# rest of the suite) rather than excuse it: excused after 30 s, it fell 67 steps
# behind, and the others' updates were then past its window (refused as pace, as
# designed for a laggard). The test's own timeout bounds the wait.
stall_grace_s = 600.0
"""


def test_two_nodes_of_two_fsdp2_ranks_train_one_run(tmp_path: Path) -> None:
    """Two nodes, each two FSDP2 ranks under torchrun, each rank attached to its node's
    daemon: every rank applies every chunk of the other node (what falls on its shard),
    the node's DONE counts the chunks of both its ranks, and after finish() the two
    nodes' models (gathered by the test) are one model. A rank holds its shard's base,
    never the whole model."""
    lines = _train(tmp_path, ["fsdp2", "fsdp2"])
    for x in lines:
        # The rank's shard, not the model: about half of it, and the hook's tensors
        # (the base, the encoders' buffers) a few bytes per shard element.
        assert x["shard"] <= x["model"] // 2 + 2049, x
        assert x["held"] <= 8 * x["shard"], x


def test_an_fsdp2_node_a_ddp_node_and_a_plain_one_train_one_run(tmp_path: Path) -> None:
    """A node of two FSDP2 ranks, a node of two DDP ranks and a plain replica: each
    applies every chunk of the others (the sharded ranks what falls on their rows,
    whoever sent it), and all three end as one model."""
    lines = _train(tmp_path, ["fsdp2", "ddp", "plain"])
    assert {x["kind"] for x in lines} == {"fsdp2", "ddp", "plain"}


def test_a_sharded_node_and_a_node_of_another_model_both_stop_at_attach(
    tmp_path: Path,
) -> None:
    """An FSDP2 node and a plain node of another model's width, each waiting for two
    replicas: the layout a JOIN states is the global shapes', so both stop at attach
    within seconds (every rank of the sharded node), naming both layouts."""
    names = spread_nodes("cities11", 2)
    script = tmp_path / "train.py"
    script.write_text(TRAIN_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    with LocalCluster("cities11", names, tmp_path / "c", CONFIG, rate_scale=0.1) as cluster:
        cluster.start()
        runs = [
            _start(script, "fsdp2", _tcp_port(), cluster.trainer_socket(names[0]), cluster, out,
                   0, 2),
            _start(script, "plain", 0, cluster.trainer_socket(names[1]), cluster, out, 1, 2,
                   width=2050),
        ]  # fmt: skip
        outputs = _wait_all(runs, 120)
    lines = []
    for node, (p, (stdout, stderr)) in enumerate(zip(runs, outputs, strict=True)):
        assert p.returncode == 0, f"node {node}: " + stderr[-3000:]
        lines += json_objects(stdout)
    assert sorted((x["node"], x["rank"]) for x in lines) == [(0, 0), (0, 1), (1, 0)]
    for x in lines:
        # Both layouts named, the sharded node's by its global shapes (20,491
        # parameters in all, not its ranks' halves), beside the other model's.
        assert x["mismatch"].count("parameter layout") >= 2, x
        assert "20,491 parameters" in x["mismatch"] and "20,501 parameters" in x["mismatch"], x


def _train(tmp_path: Path, kinds: list[str]) -> list[dict[str, Any]]:
    """One node of each kind trains the run to its end; every rank's line, checked: every
    node applied every chunk of every other, and after finish() the nodes' models
    (gathered by the test) are one model."""
    names = spread_nodes("cities11", len(kinds))
    script = tmp_path / "train.py"
    script.write_text(TRAIN_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    with LocalCluster("cities11", names, tmp_path / "c", CONFIG, rate_scale=0.1) as cluster:
        cluster.start()
        runs = []
        for node, kind in enumerate(kinds):
            path = cluster.trainer_socket(names[node])
            runs.append(_start(script, kind, _tcp_port(), path, cluster, out, node, len(kinds)))
        outputs = _wait_all(runs, 300)
    lines = []
    for node, (p, (stdout, stderr)) in enumerate(zip(runs, outputs, strict=True)):
        (out / f"node-{node}.err").write_text(stderr)
        assert p.returncode == 0, f"node {node}: " + stderr[-3000:]
        lines += json_objects(stdout)
    ranks = {"fsdp2": 2, "ddp": 2, "plain": 1}
    expected = sorted((n, r) for n, kind in enumerate(kinds) for r in range(ranks[kind]))
    assert sorted((x["node"], x["rank"]) for x in lines) == expected
    # The lines that speak for a replica: every sharded rank, a DDP node's first rank.
    speaking = [x for x in lines if x["peer"] is not None]
    peer = {x["node"]: x["peer"] for x in speaking}
    sent = {n: sum(x["chunks_sent"] for x in speaking if x["node"] == n) for n in peer}
    for x in speaking:
        assert x["complete"] and not x["refused"], x
        # Every rank's session lasted the run (a rank's publish the daemon refused
        # ended its session: the channel reconnected, again and again).
        assert not x["reconnects"], x
        assert x["final_round"]["complete"], x["final_round"]
        for other in peer:
            if other != x["node"]:
                assert x["sent_by_origin"][peer[other]] == sent[other], (x, sent)
                assert x["applied_from"][peer[other]] == sent[other], (x, sent)
    models = [torch.load(out / f"params-{n}.pt") for n in range(len(kinds))]
    distance = consensus_distance(models)
    print(f"{kinds}: the nodes' models after finish() are {distance:.2e} apart")
    assert distance <= 1e-3
    return lines


def _start(
    script: Path,
    kind: str,
    port: int,
    trainer_socket: Path,
    cluster: LocalCluster,
    out: Path,
    node: int,
    nodes: int,
    width: int = 2049,
) -> subprocess.Popen[str]:
    """Node ``node``'s trainer: two ranks under torchrun (fsdp2, ddp), or one process."""
    args = [str(script), str(trainer_socket), str(cluster.config_path), str(out), str(node), kind,
            str(nodes), str(width)]  # fmt: skip
    return _torchrun(args, port) if kind != "plain" else _process([sys.executable, *args])


def _tcp_port() -> int:
    """A TCP port free now on loopback, for torchrun's rendezvous (the UDP blocks the
    cluster picks say nothing of TCP: one collided, EADDRINUSE)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _torchrun(args: list[str], port: int) -> subprocess.Popen[str]:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node",
        "2", "--master-addr", "127.0.0.1", "--master-port", str(port), *args,
    ]  # fmt: skip
    return _process(cmd)


def _process(cmd: list[str]) -> subprocess.Popen[str]:
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        start_new_session=True,
    )  # fmt: skip


def _wait_all(runs: list[subprocess.Popen[str]], timeout_s: float) -> list[tuple[str, str]]:
    try:
        return [p.communicate(timeout=timeout_s) for p in runs]
    finally:
        for p in runs:
            if p.poll() is None:
                p.kill()
                p.communicate()
