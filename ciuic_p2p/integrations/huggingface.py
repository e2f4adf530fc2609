"""``transformers.Trainer`` on the mesh: add :class:`MeshSyncCallback` to its callbacks.

    trainer = Trainer(model, args, train_dataset=data,
                      callbacks=[MeshSyncCallback(run="my-run", min_replicas=2)])
    trainer.train()  # or trainer.train(resume_from_checkpoint=True)

At ``on_train_begin`` (the optimizer exists, a checkpoint's state is loaded) it
attaches, a late joiner's ``state.global_step`` and learning-rate schedule jump to the
run's step, a resumed one counts on from its checkpoint's; ``on_step_end`` (after each
optimizer step) steps the hook; ``on_train_end`` finishes and closes. Keyword arguments
go to :func:`ciuic_p2p.attach` (``socket_path``, ``config``, ``checkpoint_dir``...)."""

from __future__ import annotations

from typing import Any

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from ciuic_p2p.integrations.common import advance_schedule, attach_with_state
from ciuic_p2p.train.hook import MeshSync

__all__ = ["MeshSyncCallback"]


def _torch_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper
    if not isinstance(inner, torch.optim.Optimizer):
        raise TypeError(f"the Trainer's optimizer is a {type(inner).__name__}")
    return inner


class MeshSyncCallback(TrainerCallback):
    def __init__(self, **attach_kwargs: Any) -> None:
        self.attach_kwargs = attach_kwargs
        self.sync: MeshSync | None = None
        self.started_at = 0
        """The Trainer's global step when this replica began (a late joiner's > 0)."""
        self.finished: bool | None = None

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        model, optimizer = kwargs["model"], _torch_optimizer(kwargs["optimizer"])
        sync = attach_with_state(model, optimizer, state.global_step, self.attach_kwargs)
        behind = min(sync.start_step - state.global_step, state.max_steps - state.global_step)
        if behind > 0:  # joined a run already under way: its step, its schedule
            state.global_step = sync.start_step
            advance_schedule(kwargs.get("lr_scheduler"), behind)
        self.started_at = state.global_step
        self.sync = sync

    def on_step_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        if self.sync is not None:
            self.sync.step()

    def on_train_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        if self.sync is not None:
            self.finished = self.sync.finish()
            self.sync.close()
