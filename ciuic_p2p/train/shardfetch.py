"""A sharded replica's start from the run's state on the mesh, by ranges: each rank
fetches only its rows of one replica's state (core.store.statefile), never the whole.

The first rank chooses the state: it asks the daemon for the head of the newest
state the run's window allows (one writer's version), and tells every rank the
writer, the version and the header. Each rank then reads from the header where its
rows lie (of every parameter bucket, of every optimizer tensor shaped as its
parameter) and asks its daemon for those ranges and the meta area, of that writer's
version exactly; the daemon's fetch takes the pieces that cover them from every
member holding that version (core.store.fetch), so the ranks of a node stripe their
fetches over the holders. Nothing is copied in until every rank has its ranges,
checked (the layout, sizes, every value finite, the version within the run's window
and the floors within what each origin announced); then all ranks take it, or none.
"""

from __future__ import annotations

import json
import math
import struct
import time
from dataclasses import dataclass
from typing import Any

import torch

from ciuic_p2p.core.codec.layout import BucketLayout, canonical_name
from ciuic_p2p.core.codec.pieces import PieceMap
from ciuic_p2p.core.store.runstate import RunWindow, state_refusal
from ciuic_p2p.core.store.statefile import (
    ALIGN,
    DTYPES,
    META_BYTES,
    StateFormatError,
    read_header,
)
from ciuic_p2p.logsetup import get_logger
from ciuic_p2p.train.channel import ChannelError, DaemonChannel
from ciuic_p2p.train.sharded import Shard
from ciuic_p2p.train.statesync import StateKeeper, finals_of, reached_of

log = get_logger("ciuic.train")
HEAD_BYTES = 16384
"""What the first rank asks for first: every state is longer (its meta area alone is
``META_BYTES``), and most headers fit."""
_LEN = struct.Struct("<I")


@dataclass(frozen=True, slots=True)
class Wanted:
    """One range of the state this rank needs, and where it goes."""

    at: int
    nbytes: int
    dtype: torch.dtype
    key: str
    """``bucket/I`` (its ``piece``-th piece of this rank), ``opt/P/NAME``, ``meta``."""
    piece: int = -1
    numel: int = 0


def rank_ranges(
    header: dict[str, Any],
    start: int,
    layout: BucketLayout,
    pieces: PieceMap,
    optimizer_params: list[str],
) -> list[Wanted]:
    """The ranges of a state with ``header`` (its tensor area at ``start``) that hold
    this rank's rows: of each bucket its pieces, of each optimizer tensor shaped as its
    parameter (``optimizer_params``: the names of the optimizer's parameters, in its
    order) the same rows, a scalar one whole; then the meta area. Pure; raises
    StateFormatError for a header that does not fit ``layout``."""
    if header.get("layout") != f"{layout.layout_id:016x}":
        raise StateFormatError("the state is of another model (layout differs)")
    slots = {s.name: s for s in layout.slots}
    wanted: list[Wanted] = []
    area_end = 0
    for entry in _entries(header):
        key, dtype, shape, offset, nbytes = entry
        area_end = max(area_end, offset + -(-nbytes // ALIGN) * ALIGN)
        size = torch.empty((), dtype=dtype).element_size()
        if key.startswith("bucket/"):
            bucket = _index(key.removeprefix("bucket/"), len(layout.buckets))
            if shape != [layout.buckets[bucket].numel] or dtype != torch.float32:
                raise StateFormatError(f"{key} is not of this layout's bucket {bucket}")
            for i, p in enumerate(pieces.pieces):
                if p.bucket == bucket and p.numel:
                    at = start + offset + p.start * size
                    wanted.append(Wanted(at, p.numel * size, dtype, key, i, p.numel))
        elif key.startswith("opt/"):
            index = key.removeprefix("opt/").partition("/")[0]
            param = optimizer_params[_index(index, len(optimizer_params))]
            slot = slots.get(param)
            if not shape:
                wanted.append(Wanted(start + offset, nbytes, dtype, key, -1, 1))
            elif slot is not None and tuple(shape) == slot.shape:
                for p in pieces.pieces:
                    first = p.start - slot.offset
                    if p.bucket == slot.bucket and 0 <= first < slot.numel:
                        at = start + offset + first * size
                        wanted.append(Wanted(at, p.numel * size, dtype, key, -1, p.numel))
            else:
                raise StateFormatError(f"{key}: an optimizer tensor not shaped as {param}")
        elif not key.startswith("outer/"):
            raise StateFormatError(f"{key}: not a tensor a state holds")
    wanted.append(Wanted(start + area_end, META_BYTES, torch.uint8, "meta"))
    return wanted


def _entries(header: dict[str, Any]) -> list[tuple[str, torch.dtype, list[int], int, int]]:
    entries = header.get("tensors")
    if not isinstance(entries, list):
        raise StateFormatError("state header lists no tensors")
    out = []
    for entry in entries:
        try:
            key, dtype, shape, offset, nbytes = entry
            torch_dtype = DTYPES[dtype]
            shape = [int(x) for x in shape]
            offset, nbytes = int(offset), int(nbytes)
        except (ValueError, TypeError, KeyError):
            raise StateFormatError(f"bad tensor entry {str(entry)[:80]}") from None
        size = torch.empty((), dtype=torch_dtype).element_size()
        if any(x < 0 for x in shape) or offset < 0 or nbytes != math.prod(shape) * size:
            raise StateFormatError(f"{key}: its size or place is out of range")
        out.append((str(key), torch_dtype, shape, offset, nbytes))
    return out


def _index(text: str, count: int) -> int:
    if not text.isdigit() or int(text) >= count:
        raise StateFormatError(f"index {text[:20]!r} is out of range (of {count})")
    return int(text)


@dataclass(frozen=True, slots=True)
class Chosen:
    """The state the first rank chose, as every rank is told."""

    writer: str
    version: int
    head: bytes
    got: dict[str, Any]


@dataclass
class Taken:
    """One rank's ranges of the chosen state, checked, not yet copied in."""

    pieces: dict[int, torch.Tensor]
    optimizer: dict[str, list[torch.Tensor]]
    meta: dict[str, Any]
    nbytes: int


class RangeFetch:
    """One sharded rank's fetch of the run's state by ranges (see the module)."""

    def __init__(
        self,
        channel: DaemonChannel,
        state_name: str,
        shard: Shard,
        layout: BucketLayout,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        timeout_s: float,
    ) -> None:
        self.channel = channel
        self.state_name = state_name
        self.shard = shard
        self.layout = layout
        self.model = model
        self.optimizer = optimizer
        self.timeout_s = timeout_s

    def choose(self, writers: set[str], low: int, high: int | None) -> Chosen:
        """The first rank: the head of the newest state of one of ``writers`` within
        the versions asked for."""
        ch = self.channel
        rid = ch.ask_object(
            self.state_name, low, writers=sorted(writers), max_version=high,
            one_writer=True, spans=[(0, HEAD_BYTES)],
        )  # fmt: skip
        head, got = ch.object_got(rid, self.state_name, self.timeout_s)
        writer, version = str(got.get("writer")), int(got["version"])
        (n,) = _LEN.unpack_from(head, 0)
        if _LEN.size + n > len(head):  # a long header: the rest of it, same version
            rest = self._ranges(writer, version, [(HEAD_BYTES, _LEN.size + n - HEAD_BYTES)])
            head = head + rest
        read_header(head)  # a head that is no state's is refused here, once
        return Chosen(writer, version, bytes(head), got)

    def _ranges(self, writer: str, version: int, spans: list[tuple[int, int]]) -> bytearray:
        rid = self.channel.ask_object(
            self.state_name, version, writer=writer, max_version=version, one_writer=True,
            spans=spans,
        )  # fmt: skip
        data, _ = self.channel.object_got(rid, self.state_name, self.timeout_s)
        return data

    def take(self, chosen: Chosen, window: RunWindow | None) -> Taken:
        """This rank's ranges of ``chosen``, fetched and checked (nothing copied in)."""
        header, start = read_header(chosen.head)
        names = self._optimizer_params()
        wanted = rank_ranges(header, start, self.layout, self.shard.pieces, names)
        data = self._ranges(
            chosen.writer, chosen.version, [(w.at, w.nbytes) for w in wanted if w.nbytes]
        )
        if len(data) != sum(w.nbytes for w in wanted):
            raise StateFormatError(f"{len(data)} bytes came for {len(wanted)} ranges")
        view = memoryview(data)
        at = 0
        taken = Taken({}, {}, {}, len(data))
        for w in wanted:
            raw = view[at : at + w.nbytes]
            at += w.nbytes
            if w.key == "meta":
                taken.meta = _meta_of(raw)
                continue
            values = torch.frombuffer(bytearray(raw), dtype=w.dtype) if w.nbytes else (
                torch.empty(0, dtype=w.dtype)
            )  # fmt: skip
            if values.is_floating_point() and not bool(torch.isfinite(values).all()):
                raise StateFormatError(f"{w.key} holds values that are not finite")
            if w.piece >= 0:
                taken.pieces[w.piece] = values
            elif self.optimizer is not None:
                taken.optimizer.setdefault(w.key, []).append(values)
        if len(taken.pieces) != sum(1 for p in self.shard.pieces.pieces if p.numel):
            raise StateFormatError("the state lacks some of this rank's rows")
        applied = taken.meta.get("applied")
        if window is not None:
            why = state_refusal(
                window, chosen.version, applied if isinstance(applied, dict) else {}
            )
            if why is not None:
                raise StateFormatError(why)
        return taken

    def commit(self, taken: Taken, buckets: list[torch.Tensor]) -> None:
        """Copy the ranges into this rank's pieces and its optimizer's state."""
        with torch.no_grad():
            for i, values in taken.pieces.items():
                buckets[i].copy_(values)
        if self.optimizer is None or not taken.optimizer:
            return
        from torch.distributed.checkpoint.state_dict import (  # noqa: PLC0415
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        names = self._optimizer_params()
        state: Any = get_optimizer_state_dict(self.model, self.optimizer)  # made if none
        by_name: dict[str, Any] = {canonical_name(k): v for k, v in state["state"].items()}
        with torch.no_grad():
            for key, parts in taken.optimizer.items():
                index, _, name = key.removeprefix("opt/").partition("/")
                slot_state = by_name.get(names[int(index)])
                target = slot_state.get(name) if isinstance(slot_state, dict) else None
                if not isinstance(target, torch.Tensor):
                    continue
                local = getattr(target, "_local_tensor", target)
                values = torch.cat(parts) if len(parts) > 1 else parts[0]
                if local.numel() == values.numel():
                    local.view(-1).copy_(values.to(local.dtype))
        set_optimizer_state_dict(self.model, self.optimizer, state)

    def _optimizer_params(self) -> list[str]:
        if self.optimizer is None:
            return []
        names = {id(p): canonical_name(n) for n, p in self.model.named_parameters()}
        return [names.get(id(p), "") for g in self.optimizer.param_groups for p in g["params"]]


def _meta_of(raw: memoryview) -> dict[str, Any]:
    (n,) = _LEN.unpack_from(raw, 0)
    if n > META_BYTES - _LEN.size:
        raise StateFormatError("state meta is too large")
    try:
        meta = json.loads(bytes(raw[_LEN.size : _LEN.size + n]) or b"{}")
    except (ValueError, RecursionError):
        raise StateFormatError("state meta is not JSON") from None
    if not isinstance(meta, dict):
        raise StateFormatError("state meta is not an object")
    return meta


def start_from_mesh(
    fetch: RangeFetch, keeper: StateKeeper, floor: int, buckets: list[torch.Tensor]
) -> dict[str, Any] | None:
    """Start a sharded replica from the run's state (collective): when a replica is
    past ``floor`` (the step of the node's newest checkpoint) by the first rank's view
    of the run, every rank takes its rows of the state the first rank chose, or none
    does; what was restored, None when nothing was."""
    shard, r = fetch.shard, keeper.replica
    t0 = time.monotonic()
    chosen: tuple[Chosen, RunWindow | None] | None = None
    if shard.rank == 0:
        writers = keeper.writers() - {r.peer}
        if writers and max((p.step for p in r.peers.values()), default=0) > floor:
            window = keeper.window()
            try:
                high = None if window is None else window.high
                chosen = (fetch.choose(writers, floor + 1, high), window)
            except (ChannelError, StateFormatError) as exc:
                log.warning("state_refused", reason=str(exc), ranges=True)
    chosen = shard.broadcast(chosen)
    if chosen is None:
        return None
    taken: Taken | None = None
    try:
        taken = fetch.take(*chosen)
    except (ChannelError, StateFormatError) as exc:
        log.warning("state_refused", reason=str(exc), ranges=True, rank=shard.rank)
    if shard.total(int(taken is None)) != 0:  # every rank has its rows, or none takes
        return None
    assert taken is not None
    fetch.commit(taken, buckets)
    state = chosen[0]
    start = keeper.start_of(state.version)
    applied = taken.meta.get("applied")
    bound = keeper.config.train.staleness_bound_steps
    r.start_at(
        start,
        applied if isinstance(applied, dict) else {},
        None,
        finals_of(taken.meta.get("finals"), bound),
        reached_of(taken.meta.get("reached")),
    )
    info = {
        "source": "mesh",
        "step": start,
        "state_version": state.version,
        "writer": state.writer,
        "bytes": taken.nbytes,
        "ranges": True,
        "seconds": round(time.monotonic() - t0, 3),
    }
    log.info("state_restored", **info)
    return info


__all__ = ["Chosen", "RangeFetch", "Taken", "Wanted", "rank_ranges", "start_from_mesh"]
