"""The flat parameter space: a model's tensors laid out in buckets.

A model is many tensors; the codec works on flat 1-D fp32 buckets. The layout
assigns each named tensor a slot (bucket, offset, shape) in a deterministic order,
puts tensors smaller than ``dense_below_numel`` (biases, norms: the index would
cost more than it saves) in dense buckets and the rest in sparse buckets, and caps
a bucket at ``max_bucket_numel`` elements so that positions fit the wire format.

``layout_id`` is a 64-bit fingerprint of every slot: a chunk produced for another
model shape carries another id and is refused (core.codec.bucket.apply_chunk).

Names are the model's own, less what wrappers add (:func:`canonical_name`): a
replica under DDP (``module.``), ``torch.compile`` (``_orig_mod.``), FSDP or
activation checkpointing trains the same run as a plain one of the same model.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from ciuic_p2p.core.codec.chunk import MAX_RANGE_LEN

DEFAULT_MAX_BUCKET_NUMEL = 1 << 28

WRAPPER_COMPONENTS = frozenset(
    {
        "_orig_mod",  # torch.compile's OptimizedModule
        "_fsdp_wrapped_module",  # FSDP (FullyShardedDataParallel, v1)
        "_checkpoint_wrapped_module",  # torch.distributed activation checkpointing
        "_forward_module",  # Lightning's and Fabric's module wrappers
    }
)
"""Name components that wrappers insert anywhere in a parameter's name."""
LEADING_WRAPPER = "module"
"""DDP, DataParallel and DeepSpeed put the model under ``module``: stripped where it
leads a name (every time: wrappers nest)."""


def describe_layout(layout_id: int, tensors: int, params: int) -> str:
    return f"parameter layout {layout_id:016x} ({tensors} tensors, {params:,} parameters)"


def canonical_name(name: str) -> str:
    """A parameter's name with the wrappers' components taken out: ``module.`` where
    it leads, ``_orig_mod.``, ``_fsdp_wrapped_module.``, ``_checkpoint_wrapped_module.``
    and ``_forward_module.`` anywhere."""
    parts = [p for p in name.split(".") if p not in WRAPPER_COMPONENTS]
    while len(parts) > 1 and parts[0] == LEADING_WRAPPER:
        parts.pop(0)
    return ".".join(parts)


@dataclass(frozen=True, slots=True)
class Slot:
    """Where one named tensor lives in the flat space."""

    name: str
    shape: tuple[int, ...]
    bucket: int
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, slots=True)
class BucketInfo:
    index: int
    numel: int
    sparse: bool


@dataclass(frozen=True, slots=True)
class BucketLayout:
    """Immutable assignment of named tensors to buckets."""

    slots: tuple[Slot, ...]
    buckets: tuple[BucketInfo, ...]
    layout_id: int

    @classmethod
    def build(
        cls,
        named_shapes: Iterable[tuple[str, Sequence[int]]],
        dense_below_numel: int = 16_384,
        max_bucket_numel: int = DEFAULT_MAX_BUCKET_NUMEL,
    ) -> BucketLayout:
        """Lay out tensors in the order given (a model's ``named_parameters()`` order
        is deterministic, and so is this layout)."""
        if not 1 <= max_bucket_numel <= MAX_RANGE_LEN:
            raise ValueError(f"max_bucket_numel must be in [1, {MAX_RANGE_LEN}]")
        slots: list[Slot] = []
        buckets: list[BucketInfo] = []
        open_bucket: dict[bool, int] = {}
        seen: set[str] = set()
        for name, shape in named_shapes:
            if name in seen:
                raise ValueError(f"duplicate tensor name {name!r}")
            seen.add(name)
            shape_t = tuple(int(d) for d in shape)
            numel = math.prod(shape_t)
            if numel > max_bucket_numel:
                raise ValueError(f"{name} has {numel} elements, more than a bucket holds")
            sparse = numel >= dense_below_numel
            current = open_bucket.get(sparse)
            if current is None or buckets[current].numel + numel > max_bucket_numel:
                current = len(buckets)
                buckets.append(BucketInfo(index=current, numel=0, sparse=sparse))
                open_bucket[sparse] = current
            info = buckets[current]
            slots.append(Slot(name=name, shape=shape_t, bucket=current, offset=info.numel))
            buckets[current] = BucketInfo(index=current, numel=info.numel + numel, sparse=sparse)
        digest = hashlib.blake2b(digest_size=8)
        for s in slots:
            digest.update(f"{s.name}|{s.shape}|{s.bucket}|{s.offset};".encode())
        return cls(
            slots=tuple(slots),
            buckets=tuple(buckets),
            layout_id=int.from_bytes(digest.digest(), "little"),
        )

    @classmethod
    def for_module(cls, module: torch.nn.Module, dense_below_numel: int = 16_384) -> BucketLayout:
        """The layout of a module's trainable parameters, by canonical name."""
        return cls.build(
            ((canonical_name(n), p.shape) for n, p in module.named_parameters() if p.requires_grad),
            dense_below_numel=dense_below_numel,
        )

    @property
    def numel(self) -> int:
        return sum(b.numel for b in self.buckets)

    def describe(self) -> str:
        """The layout in a few words, for an error that names two of them."""
        return describe_layout(self.layout_id, len(self.slots), self.numel)

    def new_buckets(self, device: torch.device | str = "cpu") -> list[torch.Tensor]:
        """Zero-filled fp32 bucket tensors."""
        return [torch.zeros(b.numel, dtype=torch.float32, device=device) for b in self.buckets]

    def views(self, buckets: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each named tensor as a shaped view into its bucket (no copy)."""
        self._check(buckets)
        return {
            s.name: buckets[s.bucket][s.offset : s.offset + s.numel].view(s.shape)
            for s in self.slots
        }

    def flatten_into(
        self, tensors: Mapping[str, torch.Tensor], buckets: Sequence[torch.Tensor]
    ) -> None:
        """Copy named tensors into the buckets (converting to fp32)."""
        views = self.views(buckets)
        for name, view in views.items():
            src = tensors[name]
            if tuple(src.shape) != tuple(view.shape):
                raise ValueError(f"{name}: shape {tuple(src.shape)}, layout has {view.shape}")
            with torch.no_grad():
                view.copy_(src)

    def _check(self, buckets: Sequence[torch.Tensor]) -> None:
        if len(buckets) != len(self.buckets):
            raise ValueError(f"expected {len(self.buckets)} buckets, got {len(buckets)}")
        for b, info in zip(buckets, self.buckets, strict=True):
            if b.dim() != 1 or b.numel() != info.numel:
                raise ValueError(f"bucket {info.index} must be 1-D with {info.numel} elements")
