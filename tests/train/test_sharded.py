"""Sharded replicas, first brick: what FSDP2 does to a model on this machine's CPU
(gloo), and the pieces of the flat space a rank holds (core.codec.pieces)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ciuic_p2p.core.codec.layout import BucketLayout
from tests.train.test_localranks import _torchrun_two_ranks

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
