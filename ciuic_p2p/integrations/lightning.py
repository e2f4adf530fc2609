"""Lightning on the mesh: add :class:`MeshSyncCallback` to the ``Trainer``'s callbacks.

    trainer = lightning.Trainer(max_steps=1000,
                                callbacks=[MeshSyncCallback(run="my-run", min_replicas=2)])
    trainer.fit(module, data)  # or trainer.fit(module, data, ckpt_path="last.ckpt")

At ``on_train_start`` (optimizers made, a checkpoint restored) it attaches to the first
optimizer; a late joiner's ``trainer.global_step`` and step-interval schedulers jump to
the run's step, a resumed one counts on from its checkpoint's; after each optimizer
step (seen as ``global_step`` moving at ``on_train_batch_end``, so gradient
accumulation is respected) it steps the hook; ``on_train_end`` finishes and closes.
Keyword arguments go to :func:`ciuic_p2p.attach`."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch

from ciuic_p2p.integrations.common import advance_schedule, attach_with_state
from ciuic_p2p.train.hook import MeshSync

__all__ = ["MeshSyncCallback"]


def _advance_global_step(trainer: pl.Trainer, steps: int) -> None:
    """Move Lightning's optimizer-step count (what ``global_step`` and ``max_steps``
    read) on by ``steps``."""
    loop = trainer.fit_loop.epoch_loop
    module = trainer.lightning_module
    if module is None or module.automatic_optimization:
        total = loop.automatic_optimization.optim_progress.optimizer.step.total
    else:
        total = loop.manual_optimization.optim_step_progress.total
    total.ready += steps
    total.completed += steps


class MeshSyncCallback(pl.Callback):
    def __init__(self, **attach_kwargs: Any) -> None:
        self.attach_kwargs = attach_kwargs
        self.sync: MeshSync | None = None
        self.started_at = 0
        """The trainer's global step when this replica began (a late joiner's > 0)."""
        self.finished: bool | None = None
        self._seen_step = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if len(trainer.optimizers) != 1:
            raise ValueError("MeshSyncCallback trains a module with one optimizer")
        optimizer = trainer.optimizers[0]
        inner = getattr(optimizer, "optimizer", optimizer)  # a strategy's wrapper
        if not isinstance(inner, torch.optim.Optimizer):
            raise TypeError(f"the optimizer is a {type(inner).__name__}")
        sync = attach_with_state(pl_module, inner, trainer.global_step, self.attach_kwargs)
        behind = sync.start_step - trainer.global_step
        if trainer.max_steps > 0:  # never past the end the user set
            behind = min(behind, trainer.max_steps - trainer.global_step)
        if behind > 0:  # joined a run already under way: its step, its schedule
            _advance_global_step(trainer, behind)
            for config in trainer.lr_scheduler_configs:
                if config.interval == "step":
                    advance_schedule(config.scheduler, behind // max(1, config.frequency))
        self.started_at = self._seen_step = trainer.global_step
        self.sync = sync

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if self.sync is None:
            return
        while self._seen_step < trainer.global_step:  # one per optimizer step
            self._seen_step += 1
            self.sync.step()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.sync is not None:
            self.finished = self.sync.finish()
            self.sync.close()
