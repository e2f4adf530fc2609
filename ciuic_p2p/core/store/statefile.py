"""A replica's training state as one flat byte string: what state sync moves and what
a checkpoint holds. Pure (no I/O).

Layout (version 1)::

    u32 LE header length | header (UTF-8 JSON) | zero padding to 64 | tensor bytes
    | meta (META_BYTES: u32 LE length, UTF-8 JSON, zero padding)

The header lists each tensor as ``[key, dtype, shape, offset, nbytes]`` (offsets from
the start of the tensor area): ``bucket/I`` for the parameter buckets (core.codec.layout)
and, when the optimizer's state travels too, ``opt/P/NAME`` for state NAME of the
optimizer's P-th parameter, and ``outer/I`` for the outer step's momentum of bucket I
(``train.mode = "outer"`` with ``nesterov``). The header depends only on the model's layout and the
optimizer's kind, never on values or the step, so two replicas' states of one run
have the same header, and the same offsets: its digest is the state's ``compat``
(core.store.fetch mixes pieces only within one compat). The meta area has a fixed size for
the same reason; it holds what varies: for each origin, the newest of its update steps
already in these parameters (the joiner drops older chunks, which the state holds
already). Unpacking trusts nothing: a header
that is malformed, names another layout or points outside the data, or values that
are not finite (NaN, infinities), raise :class:`StateFormatError`.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ciuic_p2p.errors import CiuicError

FORMAT = "ciuic-state"
VERSION = 1
ALIGN = 64
MAX_HEADER_BYTES = 1 << 20
META_BYTES = 16384
_LEN = struct.Struct("<I")
DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
}


class StateFormatError(CiuicError):
    """Bytes that are not a state of this model."""


def _optimizer_tensors(optimizer: torch.optim.Optimizer | None) -> list[tuple[str, torch.Tensor]]:
    if optimizer is None:
        return []
    out: list[tuple[str, torch.Tensor]] = []
    state = optimizer.state_dict()["state"]
    for index in sorted(state):
        for name in sorted(state[index]):
            value = state[index][name]
            if value is None:
                continue
            tensor = value if isinstance(value, torch.Tensor) else torch.tensor(float(value))
            out.append((f"opt/{index}/{name}", tensor))
    return out


def pack_state(
    layout_id: int,
    buckets: Sequence[torch.Tensor],
    optimizer: torch.optim.Optimizer | None = None,
    meta: dict[str, Any] | None = None,
    momentum: Sequence[torch.Tensor] = (),
) -> tuple[bytearray, bytes]:
    """(state bytes, compat digest). Copies each tensor to the host once; ``meta``
    (JSON, at most ``META_BYTES`` - 4 encoded) travels in the meta area; ``momentum``:
    the outer step's buffers, one per bucket (core.replica.outer)."""
    meta_raw = json.dumps(meta or {}, separators=(",", ":")).encode()
    if len(meta_raw) > META_BYTES - _LEN.size:
        raise StateFormatError(f"state meta of {len(meta_raw)} bytes is over the limit")
    tensors = [(f"bucket/{i}", b.detach()) for i, b in enumerate(buckets)]
    tensors += _optimizer_tensors(optimizer)
    tensors += [(f"outer/{i}", m.detach()) for i, m in enumerate(momentum)]
    entries = []
    offset = 0
    for key, t in tensors:
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in DTYPES:
            raise StateFormatError(f"{key}: dtype {dtype} is not supported in a state")
        nbytes = t.numel() * t.element_size()
        entries.append([key, dtype, list(t.shape), offset, nbytes])
        offset += -(-nbytes // ALIGN) * ALIGN
    header = json.dumps(
        {
            "format": FORMAT,
            "v": VERSION,
            "layout": f"{layout_id:016x}",
            "tensors": entries,
            "meta_bytes": META_BYTES,
        },
        separators=(",", ":"),
    ).encode()
    start = -(-(_LEN.size + len(header)) // ALIGN) * ALIGN
    out = bytearray(start + offset + META_BYTES)
    _LEN.pack_into(out, 0, len(header))
    _LEN.pack_into(out, start + offset, len(meta_raw))
    out[start + offset + _LEN.size : start + offset + _LEN.size + len(meta_raw)] = meta_raw
    out[_LEN.size : _LEN.size + len(header)] = header
    view = memoryview(out)
    for (_, t), entry in zip(tensors, entries, strict=True):
        at = start + int(entry[3])  # type: ignore[call-overload]
        flat = t.contiguous().view(-1).view(torch.uint8).cpu()
        if flat.numel():
            view[at : at + flat.numel()] = flat.numpy().data
    return out, hashlib.blake2b(header, digest_size=32).digest()


def read_header(data: bytes | bytearray | memoryview) -> tuple[dict[str, Any], int]:
    """(header, start of the tensor area)."""
    view = memoryview(data)
    if len(view) < _LEN.size:
        raise StateFormatError("state is truncated")
    (n,) = _LEN.unpack_from(view, 0)
    if n > MAX_HEADER_BYTES or _LEN.size + n > len(view):
        raise StateFormatError("state header is truncated or too large")
    try:
        header = json.loads(bytes(view[_LEN.size : _LEN.size + n]))
    except (ValueError, RecursionError):
        raise StateFormatError("state header is not JSON") from None
    if (
        not isinstance(header, dict)
        or header.get("format") != FORMAT
        or header.get("v") != 1
        or header.get("meta_bytes") != META_BYTES
    ):
        raise StateFormatError("not a ciuic state (format/version)")
    return header, -(-(_LEN.size + n) // ALIGN) * ALIGN


def unpack_state(
    data: bytes | bytearray | memoryview,
    layout_id: int,
    buckets: Sequence[torch.Tensor],
    optimizer: torch.optim.Optimizer | None = None,
    momentum: Sequence[torch.Tensor] = (),
    check_meta: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Copy a state into the buckets (and the optimizer, when it carries one and
    ``optimizer`` is given, and the outer momentum buffers ``momentum``: zeroed when
    the state has none); its meta. Everything is checked before anything changes:
    the layout, every value finite, and the meta by ``check_meta`` (which raises
    :class:`StateFormatError` to refuse it)."""
    view = memoryview(data)
    header, start = read_header(view)
    if header.get("layout") != f"{layout_id:016x}":
        raise StateFormatError("the state is of another model (layout differs)")
    found = _read_tensors(view, header, start)
    for i, bucket in enumerate(buckets):
        t = found.get(f"bucket/{i}")
        if t is None or t.shape != bucket.shape or t.dtype != bucket.dtype:
            raise StateFormatError(f"bucket {i} is missing or of another shape")
    for i, m in enumerate(momentum):
        t = found.get(f"outer/{i}")
        if t is not None and (t.shape != m.shape or t.dtype != m.dtype):
            raise StateFormatError(f"outer momentum {i} is of another shape")
    for key, t in found.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise StateFormatError(f"{key} holds values that are not finite")
    opt_state = _optimizer_state(found)
    meta = _read_meta(view, start)
    if check_meta is not None:
        check_meta(meta)
    if optimizer is not None and opt_state:
        count = sum(len(g["params"]) for g in optimizer.param_groups)
        if any(i >= count for i in opt_state):
            raise StateFormatError("optimizer state of more parameters than this optimizer has")
    with torch.no_grad():
        for i, bucket in enumerate(buckets):
            bucket.copy_(found[f"bucket/{i}"])
        for i, m in enumerate(momentum):
            t = found.get(f"outer/{i}")
            m.copy_(t) if t is not None else m.zero_()
    if optimizer is not None and opt_state:
        groups = optimizer.state_dict()["param_groups"]
        optimizer.load_state_dict({"state": opt_state, "param_groups": groups})
    return meta


def _read_tensors(view: memoryview, header: dict[str, Any], start: int) -> dict[str, torch.Tensor]:
    entries = header.get("tensors")
    if not isinstance(entries, list):
        raise StateFormatError("state header lists no tensors")
    found: dict[str, torch.Tensor] = {}
    for entry in entries:
        try:
            key, dtype, shape, offset, nbytes = entry
            torch_dtype = DTYPES[dtype]
            shape = [int(x) for x in shape]
            offset, nbytes = int(offset), int(nbytes)
        except (ValueError, TypeError, KeyError):
            raise StateFormatError(f"bad tensor entry {str(entry)[:80]}") from None
        if any(x < 0 for x in shape):
            raise StateFormatError(f"{key}: negative dimension")
        size = math.prod(shape) * torch.empty((), dtype=torch_dtype).element_size()
        if nbytes != size or offset < 0 or start + offset + nbytes > len(view) - META_BYTES:
            raise StateFormatError(f"{key}: outside the state")
        raw = view[start + offset : start + offset + nbytes]
        found[str(key)] = (
            torch.frombuffer(bytearray(raw), dtype=torch_dtype).reshape(shape)
            if nbytes
            else torch.empty(shape, dtype=torch_dtype)
        )
    return found


def _optimizer_state(found: dict[str, torch.Tensor]) -> dict[int, dict[str, torch.Tensor]]:
    opt_state: dict[int, dict[str, torch.Tensor]] = {}
    for key, t in found.items():
        if key.startswith("opt/"):
            _, index, name = key.split("/", 2)
            if not index.isdigit():
                raise StateFormatError(f"{key}: bad optimizer parameter index")
            opt_state.setdefault(int(index), {})[name] = t
    return opt_state


def _read_meta(view: memoryview, start: int) -> dict[str, Any]:
    at = len(view) - META_BYTES
    if at < start:
        raise StateFormatError("state lacks its meta area")
    (n,) = _LEN.unpack_from(view, at)
    try:
        meta = json.loads(bytes(view[at + _LEN.size : at + _LEN.size + n])) if n else {}
    except (ValueError, RecursionError):
        raise StateFormatError("state meta is not JSON") from None
    if n > META_BYTES - _LEN.size or not isinstance(meta, dict):
        raise StateFormatError("state meta is malformed")
    return meta
