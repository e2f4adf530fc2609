"""Checkpoints of a sharded replica (train.sharded), written and read with
``torch.distributed.checkpoint`` (DCP): each rank writes its own shard, and a
checkpoint loads into any number of ranks (DCP reshards by the tensors' global
coordinates), one rank included.

Layout, under the checkpoint directory::

    RUN.dcp/step-000000000120/      one checkpoint: DCP's files (.metadata last)
        ciuic-rank-0.json ...       each rank's replica meta (step, floors, layout)
    RUN.dcp/.step-000000000160.tmp/ one being written (never read)

A checkpoint is written to its ``.tmp`` directory by every rank, then the first rank
renames it into place once DCP's save (which ends with the first rank writing
``.metadata``, after every rank's files) has returned: a directory named ``step-*``
is whole. The newest two are kept. What a checkpoint holds are the replica's shared
parameters (train.statesync: the base, not the unsent progress) as DTensors named as
the model names them, the optimizer's state as DCP's ``get_optimizer_state_dict``
gives it (with ``store.sync_optimizer_state``), and each rank's meta.

Every call here is collective over the node's ranks: they call it at the same step.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ciuic_p2p.core.codec.layout import BucketLayout, canonical_name
from ciuic_p2p.core.replica.rule import Replica
from ciuic_p2p.logsetup import get_logger
from ciuic_p2p.train.encoder import Encoder
from ciuic_p2p.train.sharded import Shard
from ciuic_p2p.train.statesync import finals_of, reached_of

log = get_logger("ciuic.checkpoint")
KEEP = 2
"""Checkpoints kept: the newest and the one before it."""
MAX_META_BYTES = 1 << 20
_STEP_DIR = re.compile(r"^step-(\d{12})$")


class ShardCheckpointError(ValueError):
    """A sharded checkpoint that does not fit this model, or that cannot be read."""


class ShardCheckpoints:
    """The checkpoints of one sharded replica's run, in ``directory``."""

    def __init__(
        self,
        directory: Path,
        run_hex: str,
        shard: Shard,
        model: torch.nn.Module,
        layout: BucketLayout,
        optimizer: torch.optim.Optimizer | None,
    ) -> None:
        self.root = directory / f"{run_hex}.dcp"
        self.shard = shard
        self.model = model
        self.layout = layout
        self.optimizer = optimizer
        self.params = {canonical_name(n): p for n, p in model.named_parameters() if p.requires_grad}

    def dir_of(self, step: int) -> Path:
        return self.root / f"step-{step:012d}"

    def write(self, step: int, shared: list[torch.Tensor], meta: dict[str, Any]) -> Path:
        """Write the checkpoint of ``step``: ``shared`` (one tensor per piece of this
        rank, in the shard's order) and this rank's ``meta``; its directory. Raises
        OSError when the disk refuses it (on every rank: they agree first)."""
        shard, final = self.shard, self.dir_of(step)
        tmp = self.root / f".step-{step:012d}.tmp"
        error = ""
        if shard.rank == 0:
            try:
                self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
                os.chmod(self.root, 0o700)
                shutil.rmtree(tmp, ignore_errors=True)  # a write cut short before
                tmp.mkdir(mode=0o700)
            except OSError as exc:
                error = f"{self.root}: {exc.strerror or exc}"
        error = str(shard.broadcast(error))
        if error:
            raise OSError(error)
        body = {
            "step": step,
            "rank": shard.rank,
            "ranks": shard.ranks,
            "layout": f"{self.layout.layout_id:016x}",
            "meta": meta,
        }
        (tmp / f"ciuic-rank-{shard.rank}.json").write_text(json.dumps(body))
        state: dict[str, Any] = {"model": self._model_state(shared)}
        if self.optimizer is not None:
            state["optim"] = _optimizer_state(self.model, self.optimizer)
        from torch.distributed.checkpoint.state_dict_saver import save  # noqa: PLC0415

        save(state, checkpoint_id=str(tmp), process_group=shard.group)
        dist.barrier(group=shard.group)  # every rank's meta file is written too
        if shard.rank == 0:
            try:
                if final.exists():
                    shutil.rmtree(final)
                os.replace(tmp, final)
                _fsync_dir(self.root)
                for old in self._complete()[:-KEEP]:
                    shutil.rmtree(self.dir_of(old), ignore_errors=True)
            except OSError as exc:
                error = f"{final}: {exc.strerror or exc}"
        error = str(shard.broadcast(error))  # the other ranks wait for the rename
        if error:
            raise OSError(error)
        return final

    def _model_state(self, shared: list[torch.Tensor]) -> dict[str, Any]:
        """The shared parameters as DTensors shaped and placed as the model's own."""
        from torch.distributed.tensor import DTensor  # noqa: PLC0415

        pieces = iter(shared)
        out: dict[str, Any] = {}
        for slot in self.layout.slots:
            p = self.params[slot.name]
            local = p._local_tensor if hasattr(p, "_local_tensor") else p.to_local()  # type: ignore[attr-defined]
            values = next(pieces).view(local.shape) if local.numel() else local.detach().clone()
            out[slot.name] = DTensor.from_local(
                values,
                p.device_mesh,  # type: ignore[attr-defined]
                p.placements,  # type: ignore[attr-defined]
                shape=p.shape,
                stride=p.stride(),
            )
        return out

    def _complete(self) -> list[int]:
        """The steps of the whole checkpoints here, oldest first."""
        steps = []
        with contextlib.suppress(OSError):
            for entry in self.root.iterdir():
                found = _STEP_DIR.match(entry.name)
                if found and (entry / ".metadata").is_file():
                    steps.append(int(found.group(1)))
        return sorted(steps)

    def newest(self) -> int | None:
        """The step of the newest whole checkpoint (the first rank's answer, on every
        rank), None when there is none."""
        steps = self._complete() if self.shard.rank == 0 else []
        found = self.shard.broadcast(steps[-1] if steps else None)
        return None if found is None else int(found)

    def load(self, step: int) -> dict[str, Any]:
        """Load the checkpoint of ``step`` into the model's parameters (this rank's
        rows of them) and the optimizer; the replica meta for this rank. Written by
        as many ranks as this node has now, each rank takes its own meta; otherwise
        (resharded) the meta of all of them, each origin's floor the lowest (a chunk
        that some rank's rows hold already is applied again on the others', rather
        than lost on those)."""
        from torch.distributed.checkpoint.state_dict_loader import load  # noqa: PLC0415

        where = self.dir_of(step)
        metas = self._metas(where)
        state: dict[str, Any] = {"model": dict(self.params)}
        if self.optimizer is not None:
            state["optim"] = _optimizer_state(self.model, self.optimizer)
        try:
            load(state, checkpoint_id=str(where), process_group=self.shard.group)
        except Exception as exc:  # DCP raises its own CheckpointException, and others
            raise ShardCheckpointError(f"{where}: {str(exc).splitlines()[0][:300]}") from None
        if self.optimizer is not None and "optim" in state:
            from torch.distributed.checkpoint.state_dict import (  # noqa: PLC0415
                set_optimizer_state_dict,
            )

            set_optimizer_state_dict(self.model, self.optimizer, state["optim"])
        ranks = {int(m["ranks"]) for m in metas.values()}
        if ranks == {self.shard.ranks} and self.shard.rank in metas:
            return dict(metas[self.shard.rank]["meta"])
        return merged_meta([m["meta"] for m in metas.values()])

    def _metas(self, where: Path) -> dict[int, dict[str, Any]]:
        """Each rank's meta file of the checkpoint at ``where``, checked against this
        model's layout."""
        metas: dict[int, dict[str, Any]] = {}
        for path in sorted(where.glob("ciuic-rank-*.json")):
            try:
                if path.stat().st_size > MAX_META_BYTES:
                    raise ValueError("too large")
                body = json.loads(path.read_text())
                rank, meta = int(body["rank"]), body["meta"]
                if not isinstance(meta, dict) or not 0 <= rank < int(body["ranks"]):
                    raise ValueError("not a rank's meta")
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise ShardCheckpointError(f"{path}: {exc}") from None
            if body.get("layout") != f"{self.layout.layout_id:016x}":
                raise ShardCheckpointError(
                    f"{where} is of another model (parameter layout {body.get('layout')}, "
                    f"this model's {self.layout.layout_id:016x})"
                )
            metas[rank] = body
        if not metas:
            raise ShardCheckpointError(f"{where} holds no rank's meta")
        return metas


def merged_meta(metas: list[dict[str, Any]]) -> dict[str, Any]:
    """The meta of a checkpoint loaded into another number of ranks: each origin's
    applied floor the lowest of the ranks' (pure)."""
    out = dict(metas[0]) if metas else {}
    lowest: dict[str, int] = {}
    for meta in metas:
        found = meta.get("applied")
        for origin, n in found.items() if isinstance(found, dict) else ():
            if isinstance(origin, str) and type(n) is int:
                lowest[origin] = min(n, lowest.get(origin, n))
    out["applied"] = lowest
    # The counts are of what the ranks reached alike (every rank gets every chunk);
    # with the floors lowered they no longer say what is held: counted on arrival.
    out.pop("reached", None)
    return out


def _optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Any:
    from torch.distributed.checkpoint.state_dict import (  # noqa: PLC0415
        get_optimizer_state_dict,
    )

    return get_optimizer_state_dict(model, optimizer)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ShardKeeper:
    """When a sharded replica writes its checkpoints, and the one it starts from: the
    counterpart of train.statesync's StateKeeper for a replica whose ranks must all
    write at the same step (the first rank's clock decides, every
    ``CHECK_EVERY_STEPS`` steps)."""

    CHECK_EVERY_STEPS = 16

    def __init__(
        self,
        checkpoints: ShardCheckpoints | None,
        replica: Replica,
        encoder: Encoder,
        *,
        interval_s: float,
        wait_s: float,
        now: float,
    ) -> None:
        self.checkpoints = checkpoints
        self.replica = replica
        self.encoder = encoder
        self.interval_s = interval_s
        self.wait_s = wait_s
        self._written_at = now
        self._found: int | None = None
        self.written = 0
        self.failed = 0

    @property
    def path(self) -> Path | None:
        return None if self.checkpoints is None else self.checkpoints.root

    def find(self) -> None:
        """Look for the newest checkpoint (collective)."""
        self._found = self.checkpoints.newest() if self.checkpoints is not None else None

    @property
    def found_step(self) -> int:
        return self._found or 0

    def restore(self) -> dict[str, Any] | None:
        """Load the newest checkpoint into the model and start the replica from it
        (collective); what was restored, None when there is none."""
        if self.checkpoints is None or self._found is None:
            return None
        step = self._found
        meta = self.checkpoints.load(step)
        applied = meta.get("applied")
        self.replica.start_at(
            step,
            applied if isinstance(applied, dict) else {},
            None,
            finals_of(meta.get("finals"), self.replica.train.staleness_bound_steps),
            reached_of(meta.get("reached")),
        )
        info = {"source": "checkpoint", "step": step, "path": str(self.checkpoints.dir_of(step))}
        log.info("state_restored", **info)
        return info

    def after_step(self, now: float) -> None:
        """Write one when the interval is up by the first rank's clock (collective)."""
        r = self.replica
        if self.checkpoints is None or self.interval_s <= 0:
            return
        if r.step % self.CHECK_EVERY_STEPS:
            return
        due = now - self._written_at >= self.interval_s
        if self.checkpoints.shard.broadcast(due):
            self.write(now)

    def write(self, now: float) -> Path | None:
        """Write a checkpoint now (collective); its directory, or None when there is
        no checkpoint directory or the disk refused it (logged: training goes on)."""
        if self.checkpoints is None:
            return None
        self.encoder.idle.wait(self.wait_s)
        r = self.replica
        self._written_at = now
        try:
            path = self.checkpoints.write(r.step, r.shared_params(), r.state_meta())
        except OSError as exc:
            self.failed += 1
            log.error(
                "checkpoint_not_written",
                path=str(self.checkpoints.root),
                step=r.step,
                error=str(exc),
                hint="training goes on; free the disk or set store.checkpoint_dir",
            )
            return None
        self.written += 1
        log.info("checkpoint_written", path=str(path), step=r.step)
        return path
