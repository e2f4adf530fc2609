"""What both framework callbacks share: attaching to an optimizer that may hold
restored state, and bringing a framework's step count and schedule to the run's."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from ciuic_p2p.train.attach import attach
from ciuic_p2p.train.hook import MeshSync


def attach_with_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    framework_step: int,
    attach_kwargs: dict[str, Any],
) -> MeshSync:
    """``attach`` to an optimizer that a framework may have restored from its own
    checkpoint: its state is set aside while the parameters become the hook's views,
    then put back (unless the run's state came from the mesh, which is newer); a fresh
    replica counts on from ``framework_step``."""
    saved = optimizer.state_dict() if optimizer.state else None
    if saved is not None:
        optimizer.state.clear()  # the same Parameter objects stay; only their data moves
    sync = attach(model, optimizer, **attach_kwargs)
    if not isinstance(sync, MeshSync):
        raise TypeError("the framework callbacks train one replica per process")
    if sync.restored.get("source") != "mesh" and saved is not None:
        optimizer.load_state_dict(saved)
    sync.begin_at(framework_step)
    return sync


def advance_schedule(scheduler: Any, steps: int) -> None:
    """Step a learning-rate scheduler ``steps`` times (a late joiner's schedule is
    where the run's is); the warning that it runs before ``optimizer.step()`` is
    expected here."""
    if scheduler is None or steps <= 0:
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(steps):
            scheduler.step()
