"""Nodes with several GPUs: the local ranks (under torchrun) train as one replica.

The ranks of a node combine their gradients with torch.distributed as usual (wrap the
model in DistributedDataParallel: NCCL on GPUs, gloo on CPU), so after each
``optimizer.step()`` every local rank holds the same parameters. Only the node's
first rank talks to the mesh: it attaches to the daemon, takes the peers' updates
into its parameters, and broadcasts the result to the other local ranks (one
``broadcast`` per bucket per step, on the node's fast interconnect). At attach it
broadcasts the restored state (parameters, optimizer state, start step) the same way,
so every rank starts from the mesh's state.

    dist.init_process_group("gloo")          # torchrun sets the environment
    model = DDP(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sync = ciuic_p2p.attach(model, opt, run="r", process_group=dist.group.WORLD)
    ...                                       # the same loop on every rank
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ciuic_p2p.core.codec.layout import BucketLayout
from ciuic_p2p.train.hook import MeshSync, flatten_parameters


class LocalRanks:
    """What :func:`ciuic_p2p.attach` returns on a node with several local ranks: the
    same ``step``/``finish``/``close``/``stats``/``start_step`` on every rank."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        group: Any,
        leader_sync: MeshSync | None,
        dense_below_numel: int,
    ) -> None:
        self.group = group
        self.leader = dist.get_global_rank(group, 0) if group is not None else 0
        self.sync = leader_sync
        if leader_sync is not None:
            self.buckets = leader_sync.buckets
        else:
            layout = BucketLayout.for_module(model, dense_below_numel=dense_below_numel)
            self.buckets = flatten_parameters(model, layout)
        # The restored state (or the model as it is) and where to begin, everywhere.
        start = [leader_sync.start_step if leader_sync is not None else 0]
        opt_state = [optimizer.state_dict() if optimizer is not None and leader_sync else None]
        dist.broadcast_object_list(start, src=self.leader, group=group)
        dist.broadcast_object_list(opt_state, src=self.leader, group=group)
        restored = opt_state[0]
        if leader_sync is None and optimizer is not None and restored and restored["state"]:
            optimizer.load_state_dict(restored)
        self.start_step = int(start[0])
        self._broadcast()

    def _broadcast(self) -> None:
        with torch.no_grad():
            for bucket in self.buckets:
                dist.broadcast(bucket, src=self.leader, group=self.group)

    def step(self) -> None:
        """Call once after each ``optimizer.step()`` on every local rank."""
        if self.sync is not None:
            self.sync.step()
        self._broadcast()

    def finish(self, timeout_s: float | None = None) -> bool:
        done = [self.sync.finish(timeout_s) if self.sync is not None else True]
        self._broadcast()
        dist.broadcast_object_list(done, src=self.leader, group=self.group)
        return bool(done[0])

    @property
    def stats(self) -> dict[str, Any]:
        if self.sync is not None:
            return {**self.sync.stats, "local_ranks": dist.get_world_size(self.group)}
        return {"step": None, "local_ranks": dist.get_world_size(self.group), "leader": False}

    def close(self) -> None:
        if self.sync is not None:
            self.sync.close()

    def __enter__(self) -> LocalRanks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
