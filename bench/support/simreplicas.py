"""N replicas of a task in one process, joined to each other, for the benchmarks that
run the update rule without a network (bench/staleness.py, bench/rounds.py)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ciuic_p2p.config import CodecSection, TrainSection
from ciuic_p2p.core.codec.bucket import ChunkSource
from ciuic_p2p.core.codec.layout import BucketLayout
from ciuic_p2p.core.replica.messages import PayloadKind, encode_presence, run_id_of
from ciuic_p2p.core.replica.rule import Replica
from ciuic_p2p.lab.tasks import Task
from ciuic_p2p.train.hook import flatten_parameters

RUN = run_id_of("sim")


class SimNode(NamedTuple):
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    replica: Replica
    stream: torch.Generator
    """Its batches: the seed stream bench/training.py's worker of the same rank uses."""


def stream_of(seed: int, rank: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1000 + rank + 1)


def joined_replicas(
    task: Task, seed: int, nodes: int, codec: CodecSection, train: TrainSection
) -> list[SimNode]:
    """``nodes`` replicas from the same initial model (``seed``), each told of all the
    others' joins, named ``p0`` .. ``p{nodes-1}``."""
    out = []
    for i in range(nodes):
        torch.manual_seed(seed)
        model = task.model()
        layout = BucketLayout.for_module(model, 0)
        buckets = flatten_parameters(model, layout)
        source = ChunkSource(RUN, bytes([i + 1]) * 32, 0, layout.layout_id)
        replica = Replica(layout, buckets, source, f"p{i}", codec, train, seed=i)
        replica.set_alive([f"p{j}" for j in range(nodes)])
        optimizer = task.optimizer(list(model.parameters()))
        out.append(SimNode(model, optimizer, replica, stream_of(seed, i)))
    joined = encode_presence(PayloadKind.JOIN, RUN)
    for i, node in enumerate(out):
        for j in range(nodes):
            if j != i:
                node.replica.receive(f"p{j}", joined)
    return out
