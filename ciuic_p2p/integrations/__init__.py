"""The hook inside the frameworks people train with: a ``transformers.TrainerCallback``
(:mod:`ciuic_p2p.integrations.huggingface`) and a Lightning ``Callback``
(:mod:`ciuic_p2p.integrations.lightning`). Each is an optional extra (``pip install
'ciuic-p2p[huggingface]'`` or ``[lightning]``) and imports its library only when used.

Both do what the three lines of the plain loop do, where the framework allows it:
attach at the start of training (after the framework made the optimizer, and after it
restored a checkpoint: the optimizer's restored state is put back once the parameters
are the hook's views), step after every optimizer step, finish at the end; a replica
that joins a run late continues the framework's step count and learning-rate schedule
from where the run is; one resumed from the framework's checkpoint continues counting
from that checkpoint's step."""

from __future__ import annotations

from ciuic_p2p.integrations.common import attach_with_state

__all__ = ["attach_with_state"]
