"""The Shakespeare task divides its training text between replicas as
``DistributedSampler`` divides a dataset (rank r: windows starting at r, r + world,
...), over the whole text; ``split="quarters"`` gives each its own contiguous part."""

from __future__ import annotations

import pytest
import torch

from ciuic_p2p.lab.tasks import ShakespeareTask

WORLD = 4


@pytest.fixture(scope="module")
def task() -> ShakespeareTask:
    return ShakespeareTask()


def _starts(task: ShakespeareTask, x: torch.Tensor) -> list[list[int]]:
    """Every position of the training text where each window of ``x`` occurs."""
    text = task.train_ids
    heads = text.unfold(0, 8, 1)
    out = []
    for row in x:
        candidates = (heads == row[:8]).all(1).nonzero().flatten().tolist()
        out.append([s for s in candidates if torch.equal(text[s : s + task.context], row)])
    return out


def _batches(task: ShakespeareTask, rank: int, n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(100 + rank)
    starts = []
    for _ in range(n):
        x, y = task.batch(rank, WORLD, gen)
        assert torch.equal(x[:, 1:], y[:, :-1])  # the target is the next character
        starts += _starts(task, x)
    return starts


def test_each_replica_draws_from_the_whole_text_at_its_own_offsets(task: ShakespeareTask) -> None:
    quarter = len(task.train_ids) // WORLD
    for rank in range(WORLD):
        starts = _batches(task, rank, 4)
        assert all(any(s % WORLD == rank for s in found) for found in starts)
        first = [min(found) for found in starts]
        assert min(first) < quarter and max(first) > 3 * quarter  # not one quarter


def test_quarters_keep_each_replica_in_its_own_part(task: ShakespeareTask) -> None:
    quarters = ShakespeareTask(split="quarters")
    quarter = len(task.train_ids) // WORLD
    for rank in range(WORLD):
        starts = _batches(quarters, rank, 2)
        assert all(
            any(rank * quarter <= s < (rank + 1) * quarter for s in found) for found in starts
        )


def test_an_unknown_split_is_refused() -> None:
    with pytest.raises(ValueError, match="interleaved or quarters"):
        ShakespeareTask(split="halves")  # type: ignore[arg-type]
