"""Sharded replicas: a node whose local ranks shard the model (FSDP2's
``fully_shard``) trains one replica of the run, each rank its own shard.

Each rank holds, of every tensor, a contiguous range of rows (FSDP2's ``Shard(0)``):
in the model's flat coordinates (core.codec.layout, computed alike on every node from
the global shapes) one contiguous range of a bucket, a *piece* (core.codec.pieces).
The rank's replica (core.replica.rule) encodes its pieces' updates with chunks that
name the model's own coordinates, applies the part of each peer's chunk that falls on
its pieces, and ends in the last round with its pieces' copies. No rank gathers or
holds the whole model for the library's sake: the pieces are views into the
parameters' local shards (FSDP2 owns them), and the replica's base is the shard's size.

Every rank talks to the node's daemon itself (daemon.rankwriters): the first rank
attaches and says how many ranks there are, each other rank attaches under its
incarnation; every rank publishes its own chunks and gets every delivery of the run.
Only the first rank speaks for the replica (JOIN, DONE with the chunks of all ranks).

    dist.init_process_group("gloo")             # torchrun sets the environment
    model = Net()
    fully_shard(model)                          # FSDP2: each rank holds a shard
    opt = torch.optim.AdamW(model.parameters())
    sync = ciuic_p2p.attach(model, opt, run="r", process_group=dist.group.WORLD)
    ...                                         # the same loop on every rank
    sync.finish()                               # on every rank

Its checkpoints are DCP's (train.shardckpt); joining or coming back mid-run, each rank
fetches its rows of another replica's state (train.shardfetch). Not yet for a sharded
replica: ``outer`` mode and handing its own state to a joiner (its JOIN says so, and
joiners ask the other replicas).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ciuic_p2p.core.codec.layout import BucketLayout, canonical_name
from ciuic_p2p.core.codec.pieces import PieceMap

__all__ = ["Shard", "is_sharded", "shard_of"]


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether a trainable parameter is a DTensor (FSDP2, tensor parallelism)."""
    return any(p.requires_grad and _is_dtensor(p) for p in model.parameters())


def _is_dtensor(p: torch.Tensor) -> bool:
    return hasattr(p, "placements") and hasattr(p, "to_local")


@dataclass(frozen=True)
class Shard:
    """What a rank of a sharded node holds, and its node's ranks."""

    rank: int
    ranks: int
    pieces: PieceMap
    tensors: list[torch.Tensor]
    """One flat view per piece, into the local shard of its parameter."""
    group: Any

    def broadcast(self, value: Any) -> Any:
        """The first rank's ``value``, on every rank."""
        box = [value]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
        return box[0]

    def total(self, count: int) -> int:
        """The sum of every rank's ``count``."""
        counts: list[Any] = [None] * self.ranks
        dist.all_gather_object(counts, count, group=self.group)
        return sum(int(c) for c in counts)


def shard_of(model: torch.nn.Module, layout: BucketLayout, group: Any) -> Shard:
    """This rank's pieces of an FSDP2 model (every trainable parameter a DTensor
    sharded by rows over ``group``) and a flat view of each; ValueError, naming the
    parameter, for anything else."""
    from torch.distributed.tensor import Shard as RowShard  # noqa: PLC0415
    from torch.distributed.tensor._utils import (  # noqa: PLC0415
        compute_local_shape_and_global_offset,
    )

    ranks = dist.get_world_size(group)
    params = {canonical_name(n): p for n, p in model.named_parameters() if p.requires_grad}
    rows: dict[str, tuple[int, int]] = {}
    local: dict[str, torch.Tensor] = {}
    for name, p in params.items():
        if not _is_dtensor(p):
            raise ValueError(
                f"{name} is not sharded while others are: a sharded model's trainable "
                "parameters are all DTensors (apply fully_shard to the root module too)"
            )
        placements = tuple(p.placements)  # type: ignore[attr-defined]
        mesh = p.device_mesh  # type: ignore[attr-defined]
        if placements != (RowShard(0),) or mesh.size() != ranks:
            raise ValueError(
                f"{name} is placed {placements} over {mesh.size()} ranks: attach takes "
                f"FSDP2's row shards (Shard(0)) over the process group's {ranks} ranks"
            )
        if p.dtype != torch.float32:
            raise ValueError(f"{name} is {p.dtype}: the hook trains fp32 parameters")
        shape, offset = compute_local_shape_and_global_offset(p.shape, mesh, placements)
        # The local shard itself (to_local() may hand a view through autograd): the
        # optimizer's steps and the replica's adds write the same storage FSDP2
        # gathers from.
        mine = getattr(p, "_local_tensor", None)
        if mine is None:
            mine = p.to_local()  # type: ignore[attr-defined]
        if tuple(mine.shape) != tuple(shape) or not mine.is_contiguous():
            raise ValueError(f"{name}: its local shard is not its rows as one block")
        rows[name] = (int(offset[0]) if shape[0] else 0, int(shape[0]))
        local[name] = mine
    pieces = PieceMap.of_rows(layout, rows)
    # of_rows makes a piece of each slot with rows here, in the layout's order.
    tensors = [local[s.name].view(-1) for s in layout.slots if rows[s.name][1]]
    return Shard(dist.get_rank(group), ranks, pieces, tensors, group)
