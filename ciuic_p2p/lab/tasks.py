"""The training tasks of the demo and the benchmark, on data shipped with the package.

- ``digits``: an MLP (64-256-256-10) on the 1,797 8x8 handwritten digits (UCI, as
  bundled with scikit-learn; data/digits/README.md). 360 images are held out for
  evaluation; each replica samples its own shard of the rest.
- ``shakespeare``: a character-level transformer (2 layers, 128 wide, context 64) on
  twelve public-domain plays (data/text/README.md); the last 5% of the text is held out.

Everything is seeded: the same seed gives the same model, data order and evaluation.
"""

from __future__ import annotations

import gzip
import math
from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np
import torch
from torch import nn

from ciuic_p2p.data import DATA_DIR, shakespeare_text

DIGITS = DATA_DIR / "digits" / "digits.csv.gz"


class Task(Protocol):
    name: str
    batch_size: int
    lr: float
    """The optimizer's learning rate, before the run's schedule."""

    def model(self) -> nn.Module: ...
    def optimizer(self, params: list[nn.Parameter]) -> torch.optim.Optimizer: ...
    def batch(self, rank: int, world: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]: ...
    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor: ...
    def evaluate(self, model: nn.Module) -> tuple[float, float]: ...


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    with gzip.open(DIGITS, "rt") as f:
        raw = np.loadtxt(f, delimiter=",", dtype=np.float32)
    return raw[:, :64] / 16.0, raw[:, 64].astype(np.int64)


@dataclass
class DigitsTask:
    name: str = "digits"
    batch_size: int = 256
    lr: float = 0.1
    hidden: int = 256
    held_out: int = 360

    def __post_init__(self) -> None:
        x, y = load_digits()
        order = np.random.default_rng(0).permutation(len(y))
        x, y = x[order], y[order]
        self.train_x = torch.from_numpy(x[self.held_out :])
        self.train_y = torch.from_numpy(y[self.held_out :])
        self.test_x = torch.from_numpy(x[: self.held_out])
        self.test_y = torch.from_numpy(y[: self.held_out])

    def model(self) -> nn.Module:
        h = self.hidden
        return nn.Sequential(
            nn.Linear(64, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, 10)
        )

    def optimizer(self, params: list[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=self.lr, momentum=0.9)

    def batch(self, rank: int, world: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
        shard = torch.arange(rank, len(self.train_y), world)
        idx = shard[torch.randint(len(shard), (self.batch_size,), generator=gen)]
        return self.train_x[idx], self.train_y[idx]

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(model(x), y)

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> tuple[float, float]:
        logits = model(self.test_x)
        loss = float(nn.functional.cross_entropy(logits, self.test_y))
        acc = float((logits.argmax(1) == self.test_y).float().mean())
        return loss, acc


class CharTransformer(nn.Module):
    def __init__(self, vocab: int, width: int, layers: int, heads: int, context: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(context, width))
        layer = nn.TransformerEncoderLayer(
            width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)
        mask = torch.triu(torch.full((context, context), float("-inf")), diagonal=1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        h = self.embed(idx) + self.position[:t]
        mask = self.get_buffer("mask")[:t, :t]
        h = self.blocks(h, mask=mask, is_causal=True)
        out: torch.Tensor = self.head(h)
        return out


Split = Literal["interleaved", "quarters"]


@dataclass
class ShakespeareTask:
    name: str = "shakespeare"
    batch_size: int = 16
    lr: float = 3e-3
    context: int = 64
    width: int = 128
    layers: int = 2
    heads: int = 4
    eval_batches: int = 8
    split: Split = "interleaved"
    """How the training text is divided between replicas. ``interleaved``: replica
    ``rank`` draws windows starting at ``rank + k * world`` over the whole text, as
    ``DistributedSampler`` divides a dataset under torchrun, Hugging Face Trainer and
    Lightning. ``quarters``: each replica its own contiguous 1/world of the text
    (different plays: a non-IID split, kept to compare; it costs the outer mode 1.5
    points against DDP, docs/concepts/outer-steps.md)."""

    def __post_init__(self) -> None:
        if self.split not in ("interleaved", "quarters"):
            raise ValueError(f"split {self.split!r}: interleaved or quarters")
        text = shakespeare_text()
        chars = sorted(set(text))
        self.vocab = len(chars)
        table = np.zeros(256, dtype=np.int64)
        table[[ord(c) for c in chars]] = np.arange(len(chars))
        ids = torch.from_numpy(table[np.frombuffer(text.encode("ascii"), dtype=np.uint8)])
        cut = int(len(ids) * 0.95)
        self.train_ids, self.test_ids = ids[:cut], ids[cut:]
        gen = torch.Generator().manual_seed(0)
        starts = torch.randint(
            len(self.test_ids) - self.context - 1, (self.eval_batches * 32,), generator=gen
        )
        self.eval_x = torch.stack([self.test_ids[s : s + self.context] for s in starts])
        self.eval_y = torch.stack([self.test_ids[s + 1 : s + 1 + self.context] for s in starts])

    def model(self) -> nn.Module:
        return CharTransformer(self.vocab, self.width, self.layers, self.heads, self.context)

    def optimizer(self, params: list[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=self.lr, weight_decay=0.01)

    def batch(self, rank: int, world: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
        if self.split == "quarters":
            span = len(self.train_ids) // world
            starts = rank * span + torch.randint(
                span - self.context - 1, (self.batch_size,), generator=gen
            )
        else:
            n = (len(self.train_ids) - self.context - 1 - rank) // world
            starts = rank + world * torch.randint(n, (self.batch_size,), generator=gen)
        x = torch.stack([self.train_ids[s : s + self.context] for s in starts])
        y = torch.stack([self.train_ids[s + 1 : s + 1 + self.context] for s in starts])
        return x, y

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        x, y = batch
        logits = model(x)
        return nn.functional.cross_entropy(logits.reshape(-1, self.vocab), y.reshape(-1))

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> tuple[float, float]:
        """Mean cross-entropy (nats per character) and next-character accuracy."""
        logits = model(self.eval_x)
        loss = float(
            nn.functional.cross_entropy(logits.reshape(-1, self.vocab), self.eval_y.reshape(-1))
        )
        acc = float((logits.argmax(-1) == self.eval_y).float().mean())
        return loss, acc if math.isfinite(loss) else 0.0


TASKS = {"digits": DigitsTask, "shakespeare": ShakespeareTask}


def make_task(name: str) -> Task:
    try:
        task: Task = TASKS[name]()
    except KeyError:
        raise ValueError(f"unknown task {name!r}: one of {sorted(TASKS)}") from None
    return task
