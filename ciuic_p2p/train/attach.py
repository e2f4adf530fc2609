"""``ciuic_p2p.attach``: connect a model to the node's daemon (or an embedded one) and
return its :class:`~ciuic_p2p.train.hook.MeshSync`, or, for the local ranks of a node
with several GPUs, their :class:`~ciuic_p2p.train.localranks.LocalRanks`."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, overload

import torch

from ciuic_p2p.config import Config, load_layered, runtime_dir
from ciuic_p2p.config.locate import (
    first_present,
    node_config_file,
    not_found_hint,
    socket_candidates,
)
from ciuic_p2p.core.replica.parameters import AddSink
from ciuic_p2p.logsetup import configure_trainer_logging, get_logger
from ciuic_p2p.train.channel import ChannelError, DaemonChannel, LocalDaemon
from ciuic_p2p.train.checkpoint import checkpoint_choice
from ciuic_p2p.train.encoder import check_unsharded
from ciuic_p2p.train.hook import MeshSync
from ciuic_p2p.train.sharded import is_sharded

if TYPE_CHECKING:
    from ciuic_p2p.train.localranks import LocalRanks

__all__ = ["attach"]

DAEMON_WAIT_S = 30.0
"""How long attach waits for a daemon's trainer socket to appear."""
log = get_logger("ciuic.train")


@overload
def attach(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    run: str = "default",
    socket_path: str | Path | None = None,
    daemon: LocalDaemon | None = None,
    config: Config | None = None,
    min_replicas: int = 1,
    join_timeout_s: float = 120.0,
    seed: int = 0,
    checkpoint_dir: str | Path | None = None,
    handle_sigterm: bool | None = None,
    process_group: None = None,
) -> MeshSync: ...


@overload
def attach(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    run: str = "default",
    socket_path: str | Path | None = None,
    daemon: LocalDaemon | None = None,
    config: Config | None = None,
    min_replicas: int = 1,
    join_timeout_s: float = 120.0,
    seed: int = 0,
    checkpoint_dir: str | Path | None = None,
    handle_sigterm: bool | None = None,
    process_group: Any,
) -> MeshSync | LocalRanks: ...


def attach(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    run: str = "default",
    socket_path: str | Path | None = None,
    daemon: LocalDaemon | None = None,
    config: Config | None = None,
    min_replicas: int = 1,
    join_timeout_s: float = 120.0,
    seed: int = 0,
    checkpoint_dir: str | Path | None = None,
    handle_sigterm: bool | None = None,
    process_group: Any = None,
) -> MeshSync | LocalRanks:
    """Attach a model to the node's daemon (see the module docstring).

    ``config`` is the node's: its ``codec`` and ``train`` sections steer the hook.
    Without it, attach reads the node's file as the CLI does (``$CIUIC_CONFIG``, else
    the service's ``/etc/ciuic/node.toml``, else the WAN preset's defaults) with the
    ``CIUIC_*`` variables over it. ``socket_path`` defaults to ``train.socket_path``,
    else ``trainer.sock`` in ``node.runtime_dir`` (``node.state_dir`` when unset), and
    with no file named, the service's ``/run/ciuic`` and ``/var/lib/ciuic`` too
    (config.locate). Pass ``daemon`` (an :class:`EmbeddedDaemon`) to run the daemon in
    this process instead. Call before
    the optimizer's first step (its state must not exist yet: parameters become views
    into the buckets). ``run`` names the training run: chunks of other runs are
    refused.

    State: when the run's other replicas are past step 0 (or past this node's
    checkpoint), the model (and, with ``store.sync_optimizer_state``, the optimizer's
    state) is fetched from the nearest up-to-date replica before ``attach`` returns;
    ``sync.start_step`` says where to continue. ``checkpoint_dir`` (default
    ``store.checkpoint_dir``, whose default is the directory the daemon names;
    ``""``: none) gets a checkpoint every ``store.checkpoint_interval_s``, when the
    daemon stops, at :meth:`MeshSync.finish` and on SIGTERM (``handle_sigterm``,
    default: when checkpointing, in the main thread); the newest two are kept, and
    ``sync.stats["checkpoint_path"]`` says where.

    ``process_group``: the local ranks of a node with several GPUs (under torchrun);
    they train as one replica. A model sharded with FSDP2 (``fully_shard``): each rank
    trains its shard and talks to the daemon itself (train.sharded). A replicated one
    (DDP): the group's first rank talks to the daemon, the others follow it
    (train.localranks)."""
    sharded = is_sharded(model)
    if not sharded or process_group is None:
        check_unsharded(model)  # before any connection: the answer does not depend on it
    file_named = config is not None or bool(os.environ.get("CIUIC_CONFIG"))
    cfg = config or load_layered(node_config_file(None, os.environ), os.environ)
    configure_trainer_logging(cfg.log)
    if sharded:
        return _attach_replica(
            model, optimizer, cfg, file_named, run=run, socket_path=socket_path,
            daemon=daemon, min_replicas=min_replicas, join_timeout_s=join_timeout_s,
            seed=seed, checkpoint_dir=checkpoint_dir, handle_sigterm=handle_sigterm,
            process_group=process_group,
        )  # fmt: skip
    if process_group is not None:
        import torch.distributed as dist  # noqa: PLC0415

        from ciuic_p2p.core.replica.mirror import MirrorLog  # noqa: PLC0415
        from ciuic_p2p.train.localranks import LocalRanks  # noqa: PLC0415

        lead: MeshSync | None = None
        log: MirrorLog | None = None
        if dist.get_rank(process_group) == 0:
            log = MirrorLog()  # the other ranks replay its adds
            lead = _attach_replica(
                model, optimizer, cfg, file_named, run=run, socket_path=socket_path,
                daemon=daemon, min_replicas=min_replicas, join_timeout_s=join_timeout_s,
                seed=seed, checkpoint_dir=checkpoint_dir, handle_sigterm=handle_sigterm,
                sink=log,
            )  # fmt: skip
        return LocalRanks(model, optimizer, process_group, lead, cfg.codec.dense_below_numel, log)
    return _attach_replica(
        model, optimizer, cfg, file_named, run=run, socket_path=socket_path, daemon=daemon,
        min_replicas=min_replicas, join_timeout_s=join_timeout_s, seed=seed,
        checkpoint_dir=checkpoint_dir, handle_sigterm=handle_sigterm,
    )  # fmt: skip


def _attach_replica(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    cfg: Config,
    file_named: bool,
    *,
    run: str,
    socket_path: str | Path | None,
    daemon: LocalDaemon | None,
    min_replicas: int,
    join_timeout_s: float,
    seed: int,
    checkpoint_dir: str | Path | None,
    handle_sigterm: bool | None,
    sink: AddSink | None = None,
    process_group: Any = None,
) -> MeshSync:
    """One replica's hook (``attach`` without a process group)."""
    ckpt_path = checkpoint_choice(checkpoint_dir, cfg.store.checkpoint_dir)
    if optimizer is not None and optimizer.state:
        raise ValueError("attach before the optimizer's first step")
    started = False
    if daemon is not None:
        if not daemon.address:
            daemon.start()
            started = True
        try:
            channel = daemon.connect()
        except BaseException:
            if started:
                daemon.stop(leave=False)
            raise
    else:
        channel = _connect(cfg, socket_path, file_named)
    try:
        sync = MeshSync(
            model,
            channel,
            run=run,
            config=cfg,
            optimizer=optimizer,
            min_replicas=min_replicas,
            join_timeout_s=join_timeout_s,
            seed=seed,
            embedded=daemon,
            checkpoint_dir=ckpt_path,
            sink=sink,
            process_group=process_group,
        )
        if handle_sigterm or (
            handle_sigterm is None
            and ckpt_path is not None
            and threading.current_thread() is threading.main_thread()
        ):
            sync.install_sigterm()
        return sync
    except BaseException:
        channel.close()
        if started and daemon is not None:
            daemon.stop(leave=False)
        raise


def _connect(cfg: Config, socket_path: str | Path | None, file_named: bool) -> DaemonChannel:
    """The daemon's trainer socket, where config.locate says (waiting up to
    ``DAEMON_WAIT_S`` for one to appear: a daemon started beside the trainer may still
    be coming up)."""
    explicit = socket_path or cfg.train.socket_path
    if explicit:
        return DaemonChannel.connect(Path(explicit).expanduser())
    candidates = socket_candidates(runtime_dir(cfg), "trainer.sock", file_named)
    t0 = time.monotonic()
    told = t0
    while (found := first_present(candidates)) is None:
        now = time.monotonic()
        if now - told >= 5.0:
            told = now
            log.info("waiting_for_daemon", looked_at=[str(c) for c in candidates])
        if now - t0 > DAEMON_WAIT_S:
            raise ChannelError(
                not_found_hint(
                    candidates,
                    "daemon serving trainers",
                    "start one (`ciuic-node run`) or name its socket: attach(..., "
                    "socket_path=...), $CIUIC_TRAIN_SOCKET_PATH or $CIUIC_CONFIG",
                )
            )
        time.sleep(0.1)
    return DaemonChannel.connect(found)
