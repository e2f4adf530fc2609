"""Nodes with several GPUs: the local ranks (under torchrun) train as one replica.

The ranks of a node combine their gradients with torch.distributed as usual (wrap the
model in DistributedDataParallel: NCCL on GPUs, gloo on CPU), so after each
``optimizer.step()`` every local rank holds the same parameters. Only the node's
first rank talks to the mesh: it attaches to the daemon and takes the peers' updates
into its parameters. The other ranks replay what it added (core.replica.mirror): the
peers' chunks and its own at their settlement, as their compressed bytes with the
weight each was added at, so a rank receives about the chunks its node received, not
the model (before, every bucket was broadcast after every step: 4 GB per step at 1B).
In ``outer`` mode with Nesterov momentum, a round's momentum kick goes dense, once a
round. At attach the restored state (parameters, optimizer state, start step) reaches
every rank as tensors (the optimizer state's layout alone is pickled), and
``finish()`` ends with one whole broadcast (its last round is dense anyway).

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
from ciuic_p2p.core.replica.mirror import MirrorLog, MirrorReplay
from ciuic_p2p.train.hook import MeshSync, flatten_parameters

_TENSOR = "__ciuic_tensor__"


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
        mirror: MirrorLog | None = None,
    ) -> None:
        """``mirror``: on the first rank, the log its replica records its adds in
        (None on the others)."""
        self.group = group
        self.leader = dist.get_global_rank(group, 0) if group is not None else 0
        self.sync = leader_sync
        self.mirror = mirror
        if leader_sync is not None:
            self.buckets = leader_sync.buckets
        else:
            layout = BucketLayout.for_module(model, dense_below_numel=dense_below_numel)
            self.buckets = flatten_parameters(model, layout)
        self.comm_device = (
            self.buckets[0].device if dist.get_backend(group) == "nccl" else torch.device("cpu")
        )
        # Where to begin, everywhere.
        told = [leader_sync.start_step if leader_sync else None]
        dist.broadcast_object_list(told, src=self.leader, group=group)
        self.start_step = int(told[0])  # type: ignore[arg-type]
        self.replay = MirrorReplay(self.buckets) if leader_sync is None else None
        self.received_bytes = 0
        """Bytes this rank received from the first rank after attach, per step."""
        self.steps = 0
        if optimizer is not None:
            broadcast_optimizer_state(
                optimizer,
                self.sync is not None,
                self.leader,
                group,
                self.comm_device,
                self.buckets[0].device,
            )
        self._broadcast()
        if mirror is not None:
            mirror.take()  # what attach added is in the broadcast

    def _broadcast(self) -> None:
        with torch.no_grad():
            for bucket in self.buckets:
                dist.broadcast(bucket, src=self.leader, group=self.group)

    def _send_log(self) -> None:
        size = torch.zeros(1, dtype=torch.int64, device=self.comm_device)
        log = b""
        if self.mirror is not None:
            log = self.mirror.take()
            size[0] = len(log)
        dist.broadcast(size, src=self.leader, group=self.group)
        n = int(size[0])
        if self.mirror is not None:
            blob = torch.frombuffer(bytearray(log), dtype=torch.uint8).to(self.comm_device)
        else:
            blob = torch.empty(n, dtype=torch.uint8, device=self.comm_device)
        dist.broadcast(blob, src=self.leader, group=self.group)
        if self.replay is not None:
            self.received_bytes += 8 + n
            self.replay.apply(blob.cpu().numpy().data)

    def step(self) -> None:
        """Call once after each ``optimizer.step()`` on every local rank."""
        if self.sync is not None:
            self.sync.step()
        self.steps += 1
        self._send_log()

    def finish(self, timeout_s: float | None = None) -> bool:
        if self.mirror is not None:
            self.mirror.pause()  # the last round is dense: one broadcast below
        done = [self.sync.finish(timeout_s) if self.sync is not None else True]
        self._broadcast()
        dist.broadcast_object_list(done, src=self.leader, group=self.group)
        return bool(done[0])

    @property
    def stats(self) -> dict[str, Any]:
        ranks = dist.get_world_size(self.group)
        if self.sync is not None:
            return {
                **self.sync.stats,
                "local_ranks": ranks,
                "mirror_bytes_sent": 0 if self.mirror is None else self.mirror.bytes_taken,
                "mirror_entries": {} if self.mirror is None else dict(self.mirror.kinds),
                "chunk_bytes_received": self.sync.replica.stats.chunk_bytes_received,
            }
        return {
            "step": None,
            "local_ranks": ranks,
            "leader": False,
            "received_bytes": self.received_bytes,
            "steps": self.steps,
        }

    def close(self) -> None:
        if self.sync is not None:
            self.sync.close()

    def __enter__(self) -> LocalRanks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def broadcast_optimizer_state(
    optimizer: torch.optim.Optimizer,
    is_source: bool,
    source: int,
    group: Any,
    comm_device: torch.device,
    local_device: torch.device,
) -> None:
    """The source rank's optimizer state (restored at attach) into every rank's
    optimizer: its layout pickled, its tensors broadcast as tensors (pickling the
    whole state copied it twice on the source and once more in every other rank).
    A tensor the source holds on a GPU lands on ``local_device`` (this rank's), one on
    the CPU (Adam's step count) stays there."""
    tensors: list[torch.Tensor] = []
    layout = [_strip(optimizer.state_dict(), tensors) if is_source else None]
    dist.broadcast_object_list(layout, src=source, group=group)
    received: list[torch.Tensor] = []
    for i, (shape, dtype, device) in enumerate(_placeholders(layout[0])):
        if is_source:
            t = tensors[i].to(comm_device)
        else:
            t = torch.empty(shape, dtype=getattr(torch, dtype), device=comm_device)
        dist.broadcast(t, src=source, group=group)
        received.append(t.to("cpu" if device == "cpu" else local_device))
    state = _fill(layout[0], received)
    if not is_source and isinstance(state, dict) and state.get("state"):
        optimizer.load_state_dict(state)


def _strip(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """``obj`` with each tensor replaced by a placeholder (its index, shape, dtype and
    device), the tensors appended to ``tensors``."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        dtype = str(obj.dtype).removeprefix("torch.")
        return (_TENSOR, len(tensors) - 1, tuple(obj.shape), dtype, str(obj.device))
    if isinstance(obj, dict):
        return {k: _strip(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_strip(v, tensors) for v in obj]
    return obj


def _placeholders(obj: Any) -> list[tuple[tuple[int, ...], str, str]]:
    """The placeholders' shapes, dtypes and devices, in index order."""
    found: list[tuple[int, tuple[int, ...], str, str]] = []

    def walk(o: Any) -> None:
        if isinstance(o, tuple) and len(o) == 5 and o[0] == _TENSOR:
            found.append((o[1], o[2], o[3], o[4]))
        elif isinstance(o, dict):
            for v in o.values():
                walk(v)
        elif isinstance(o, list):
            for v in o:
                walk(v)

    walk(obj)
    found.sort()
    return [(shape, dtype, device) for _, shape, dtype, device in found]


def _fill(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, tuple) and len(obj) == 5 and obj[0] == _TENSOR:
        return tensors[obj[1]]
    if isinstance(obj, dict):
        return {k: _fill(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_fill(v, tensors) for v in obj]
    return obj
