"""Encoding an update into chunks, with error feedback, and applying chunks.

One :class:`BucketEncoder` per bucket (a flat 1-D fp32 view of one or several
parameters, see core.codec.layout) keeps the error-feedback residual: each step

    acc      = residual + update
    sent     = Q(acc)           # top-k selection, then INT8 or fp16 values
    residual = acc - dequant(sent)

so what was not sent, and the quantization error of what was, carries into the next
step (Seide et al. 2014; Lin et al. 2018, "Deep Gradient Compression"). The residual
lives on the update's device and is updated in place; every tensor operation runs on
that device and only the packed sections of each chunk are copied to the host.

An encoded step is a list of chunks (core.codec.chunk) whose ranges tile the bucket. A
chunk's payload is at most ``chunk_payload_bytes``; a sparse chunk also starts at a
gap that would cost more to code in unary than a new header costs, so no input can
make a chunk's index stream blow up.

Non-finite input is refused before anything changes: :class:`NonFiniteUpdateError`
is raised and the residual is left as it was.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ciuic_p2p.config.sections import CodecSection
from ciuic_p2p.core.codec import indexcode
from ciuic_p2p.core.codec.chunk import (
    HEADER_V1_LEN,
    MAX_PAYLOAD_BYTES,
    MAX_RANGE_LEN,
    ORIGIN_LEN,
    RUN_ID_LEN,
    SCALE_BYTES,
    ChunkHeader,
    Codec,
    IndexCode,
    build_chunk,
    fixed_sections,
    parse_chunk,
)
from ciuic_p2p.core.codec.quant import (
    INT8_LEVELS,
    dequantize_int8,
    dequantize_packed,
    max_code,
    quantize_int8,
    quantize_packed,
    to_fp16,
    unpack,
)
from ciuic_p2p.core.codec.select import ApproxTopK, RunParts, exact_topk, sequential
from ciuic_p2p.errors import (
    ChunkMismatchError,
    InconsistentChunkError,
    NonFiniteUpdateError,
)

if not np.little_endian:  # pragma: no cover - every supported platform is
    raise ImportError(
        "ciuic-p2p's wire format maps tensors directly; it needs a little-endian host"
    )

#: A gap whose unary code would exceed this many bits starts a new chunk instead
#: (a header costs 184-188 bytes, about 1500 bits).
GAP_BREAK_BITS = 2048

_FLT_MAX = torch.finfo(torch.float32).max
_MAX_SCALE = {
    # A scale above FLT_MAX / (the grid's largest code) would turn a code into Inf.
    Codec.DENSE_INT8: _FLT_MAX / INT8_LEVELS,
    Codec.SPARSE_INT8: _FLT_MAX / INT8_LEVELS,
    Codec.SPARSE_INT4: _FLT_MAX / max_code(4),
    Codec.SPARSE_INT2: _FLT_MAX / max_code(2),
}

DENSE_DTYPES = {
    Codec.DENSE_FP32: torch.float32,
    Codec.DENSE_FP16: torch.float16,
    Codec.DENSE_BF16: torch.bfloat16,
}
_CODEC_OF_DTYPE = {dtype: codec for codec, dtype in DENSE_DTYPES.items()}
DENSE_BY_NAME = {"fp32": Codec.DENSE_FP32, "fp16": Codec.DENSE_FP16, "bf16": Codec.DENSE_BF16}
_SPARSE_BY_MODE = {
    "int8": Codec.SPARSE_INT8,
    "fp16": Codec.SPARSE_FP16,
    "int4": Codec.SPARSE_INT4,
    "int2": Codec.SPARSE_INT2,
}
_PACKED_BITS = {Codec.SPARSE_INT4: 4, Codec.SPARSE_INT2: 2}


@dataclass(frozen=True, slots=True)
class ChunkSource:
    """Who produces the chunks: stamped into every header."""

    run_id: bytes
    origin: bytes
    incarnation: int
    layout_id: int

    def __post_init__(self) -> None:
        if len(self.run_id) != RUN_ID_LEN or len(self.origin) != ORIGIN_LEN:
            raise ValueError("run_id is 16 bytes and origin 32 bytes")


@dataclass(frozen=True, slots=True)
class BucketSpec:
    """How one bucket is encoded."""

    codec: Codec
    density: float = 0.01
    block_size: int = 64
    exact: bool = False
    sample_size: int = 32_768
    chunk_payload_bytes: int = MAX_PAYLOAD_BYTES
    residual_max_ratio: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 < self.density <= 1.0:
            raise ValueError("density must be in (0, 1]")
        if not 4096 <= self.chunk_payload_bytes <= MAX_PAYLOAD_BYTES:
            raise ValueError("chunk_payload_bytes must be in [4096, 1 MiB]")
        if not self.block_size >= 1 or self.block_size + SCALE_BYTES > self.chunk_payload_bytes:
            raise ValueError("block_size must be >= 1 and one block must fit in a chunk")

    @classmethod
    def from_config(cls, section: CodecSection, numel: int, sparse: bool) -> BucketSpec:
        """The spec for a bucket of ``numel`` elements: sparse buckets use the value
        mode, dense ones the dense dtype; small sparse buckets select exactly."""
        if sparse:
            codec = _SPARSE_BY_MODE[section.value_mode]
        else:
            codec = DENSE_BY_NAME[section.dense_dtype]
        return cls(
            codec=codec,
            density=section.density,
            block_size=section.block_size,
            exact=section.selection == "exact" or numel < section.exact_below_numel,
            sample_size=section.sample_size,
            chunk_payload_bytes=section.chunk_payload_bytes,
            residual_max_ratio=section.residual_max_ratio,
        )

    def k_for(self, numel: int) -> int:
        """Values selected per step: ``ceil(density * numel)``."""
        return min(numel, math.ceil(self.density * numel))


@dataclass(slots=True)
class EncodeStats:
    """What the last :meth:`BucketEncoder.encode` did, for metrics and benchmarks."""

    k: int = 0
    selected: int = 0
    chunks: int = 0
    encoded_bytes: int = 0
    residual_scaled: bool = False


@dataclass(frozen=True, slots=True)
class SentChunk:
    """One chunk as sent, with what the receivers will decode from it."""

    payload: bytearray
    header: ChunkHeader
    positions: torch.Tensor | None
    """Sorted positions relative to ``header.range_start``; None when dense."""
    values: torch.Tensor
    """The values as decoded (after quantization)."""


class BucketEncoder:
    """Error-feedback encoder of one bucket. Not thread-safe; one per bucket."""

    def __init__(
        self,
        bucket: int,
        numel: int,
        spec: BucketSpec,
        source: ChunkSource,
        device: torch.device | str = "cpu",
        seed: int = 0,
        run_parts: RunParts[Any] = sequential,
        *,
        keep_residual: bool = True,
        numpy_scan: bool | None = None,
        offset: int = 0,
    ) -> None:
        """``run_parts``: how the CPU top-k scan runs its parts (codec.select).
        ``keep_residual=False``: this encoder serves :meth:`encode_progress` only, whose
        caller keeps the residual implicitly (no bucket-sized buffer here).
        ``numpy_scan``: see :class:`ApproxTopK`. ``offset``: where this encoder's
        ``numel`` elements start in bucket ``bucket`` (a sharded rank's piece of it,
        core.codec.pieces): its chunks' ranges are the bucket's, so that every replica
        reads them in the model's own coordinates."""
        if not 0 < numel <= MAX_RANGE_LEN:
            raise ValueError(f"bucket size must be in [1, {MAX_RANGE_LEN}]")
        if not 0 <= offset <= MAX_RANGE_LEN - numel:
            raise ValueError(f"offset must be in [0, {MAX_RANGE_LEN - numel}]")
        self.bucket = bucket
        self.offset = offset
        self.numel = numel
        self.spec = spec
        self.source = source
        self.device = torch.device(device)
        self.stats = EncodeStats()
        self.replicas = 0
        """Stamped on every chunk (the weight receivers give it is 1/replicas); 0:
        not stated."""
        self._update_norm_ema = 0.0
        # Dense fp32 is lossless: nothing is ever left behind, so no residual.
        self.residual: torch.Tensor | None = (
            None
            if spec.codec is Codec.DENSE_FP32 or not keep_residual
            else torch.zeros(numel, dtype=torch.float32, device=self.device)
        )
        self._keeps_residual = keep_residual
        self._sent_norm_ema = 0.0
        self.residual_norm = 0.0
        """The residual's L2 norm after the last :meth:`encode_progress`."""
        self.last_sent: list[SentChunk] = []
        """What the last :meth:`encode_progress` sent, chunk by chunk."""
        self.traffic_bytes = 0
        """Bytes of bucket memory the progress path read and wrote so far (full passes
        counted by the tensors they touch, O(k) work by its elements)."""
        self._selector: ApproxTopK | None = None
        if spec.codec.is_sparse and not spec.exact:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seed)
            self._selector = ApproxTopK(
                numel, self.device, spec.sample_size, generator, run_parts, numpy_scan
            )

    def held_bytes(self) -> int:
        """Bytes of the bucket-sized buffers this encoder holds (residual, selector)."""
        held = 0 if self.residual is None else self.residual.numel() * 4
        return held + (0 if self._selector is None else self._selector.held_bytes())

    # -- state ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The residual and the running update norm, for checkpoints."""
        return {
            "residual": None if self.residual is None else self.residual.detach().clone(),
            "update_norm_ema": self._update_norm_ema,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        residual = state["residual"]
        if self.residual is None:
            if residual is not None:
                raise ValueError("this bucket's codec keeps no residual")
        else:
            if residual is None or residual.shape != self.residual.shape:
                raise ValueError(f"residual must have shape {tuple(self.residual.shape)}")
            self.residual.copy_(residual)
        self._update_norm_ema = float(state["update_norm_ema"])

    # -- encoding ------------------------------------------------------------------------

    def encode(self, update: torch.Tensor, step: int) -> list[bytearray]:
        """Fold ``update`` (1-D, ``numel`` values on this encoder's device; other float
        dtypes are converted to fp32) into the residual and return the chunks to send
        for ``step``."""
        if update.dim() != 1 or update.numel() != self.numel:
            raise ValueError(f"update must be 1-D with {self.numel} elements")
        if not update.is_floating_point():
            raise ValueError(f"update must be a floating-point tensor, not {update.dtype}")
        if update.dtype != torch.float32:  # fp16/bf16/fp64 models: the residual is fp32
            update = update.to(torch.float32)
        _check_finite(update)
        if not self._keeps_residual:
            raise ValueError("this encoder keeps no residual: use encode_progress")
        if self.residual is None:  # dense fp32: lossless, nothing carries over
            chunks = self._dense_chunks(update, step)
        else:
            self.residual.add_(update)
            if self.spec.codec.is_sparse:
                chunks = self._encode_sparse(self.residual, step)
            else:
                chunks = self._encode_dense_lossy(self.residual, step)
            self._bound_residual(update)
        self.stats.chunks = len(chunks)
        self.stats.encoded_bytes = sum(len(c) for c in chunks)
        return chunks

    def _bound_residual(self, update: torch.Tensor) -> None:
        ratio = self.spec.residual_max_ratio
        self.stats.residual_scaled = False
        if ratio <= 0.0 or self.residual is None:
            return
        norm = float(torch.linalg.vector_norm(update))
        ema = self._update_norm_ema
        self._update_norm_ema = norm if ema == 0.0 else 0.9 * ema + 0.1 * norm
        limit = ratio * self._update_norm_ema
        rnorm = float(torch.linalg.vector_norm(self.residual))
        if limit > 0.0 and rnorm > limit:
            self.residual.mul_(limit / rnorm)
            self.stats.residual_scaled = True

    def _header(
        self, codec: Codec, step: int, start: int, length: int, count: int, **kw: Any
    ) -> ChunkHeader:
        src = self.source
        return ChunkHeader(
            codec=codec,
            index_code=kw.get("index_code", IndexCode.NONE),
            rice_bits=kw.get("rice_bits", 0),
            block_size=kw.get("block_size", 0),
            run_id=src.run_id,
            origin=src.origin,
            incarnation=src.incarnation,
            step=step,
            layout_id=src.layout_id,
            bucket=self.bucket,
            range_start=self.offset + start,
            range_len=length,
            count=count,
            replicas=self.replicas,
        )

    def _encode_sparse(self, acc: torch.Tensor, step: int) -> list[bytearray]:
        k = self.spec.k_for(self.numel)
        if self._selector is not None:
            positions, values = self._selector.select_with_values(acc, k)
        else:
            positions = exact_topk(acc, k)
            values = acc[positions]
        chunks, sent = self._emit_sparse(positions, values, step)
        values.sub_(sent)
        if acc.device.type == "cpu":  # numpy's scatter is ~3x torch's here
            acc.numpy()[positions.numpy()] = values.numpy()
        else:
            acc[positions] = values
        return [c.payload for c in chunks]

    def _emit_sparse(
        self, positions: torch.Tensor, values: torch.Tensor, step: int
    ) -> tuple[list[SentChunk], torch.Tensor]:
        """Chunks of the selected ``values`` at sorted ``positions``, and the values as
        the receivers will decode them."""
        spec = self.spec
        self.stats.k = spec.k_for(self.numel)
        self.stats.selected = positions.numel()
        gaps = indexcode.gaps_from_positions(positions)
        r = indexcode.choose_rice_bits(gaps)
        bounds = self._cut_sparse(gaps, r)
        sent = torch.empty_like(values)
        chunks: list[SentChunk] = []
        pos_cpu = positions[[b[0] for b in bounds]].tolist() if len(bounds) > 1 else []
        for j, (a, b) in enumerate(bounds):
            start = 0 if j == 0 else pos_cpu[j]
            end = self.numel if j == len(bounds) - 1 else pos_cpu[j + 1]
            chunk_gaps = gaps[a:b]
            if j > 0:
                chunk_gaps = chunk_gaps.clone()
                chunk_gaps[0] = 0
            rem, unary = indexcode.rice_encode(chunk_gaps, r)
            vals = values[a:b]
            if spec.codec is Codec.SPARSE_INT8:
                codes, scales = quantize_int8(vals, spec.block_size)
                dequantize_int8(codes, scales, spec.block_size, out=sent[a:b])
                sections = [scales, codes, rem, unary]
                block = spec.block_size
            elif spec.codec in _PACKED_BITS:
                bits = _PACKED_BITS[spec.codec]
                packed, scales, sent[a:b] = quantize_packed(vals, spec.block_size, bits)
                sections = [scales, packed, rem, unary]
                block = spec.block_size
            else:
                codes16 = to_fp16(vals)
                sent[a:b] = codes16
                sections = [codes16, rem, unary]
                block = 0
            header = self._header(
                spec.codec,
                step,
                start,
                end - start,
                b - a,
                index_code=IndexCode.RICE_SPLIT,
                rice_bits=r,
                block_size=block,
            )
            payload = build_chunk(header, [_host_bytes(t) for t in sections])
            chunks.append(SentChunk(payload, header, positions[a:b] - start, sent[a:b]))
        return chunks, sent

    def encode_progress(
        self, params: torch.Tensor, base: torch.Tensor, step: int
    ) -> list[bytearray]:
        """Encode ``params - base`` (the residual plus the progress since the last send:
        ``base`` is the parameters without this replica's unsent progress) and move
        ``base`` by what was sent, so the new residual is ``params - base`` again. The
        difference is never stored on CPU (see codec.select); ``params`` is read once
        per element, so an optimizer writing it meanwhile loses nothing. What was sent
        is in :attr:`last_sent` (the caller never decodes its own chunks). Non-finite
        input raises :class:`NonFiniteUpdateError` with nothing sent and ``base``
        unchanged."""
        if params.numel() != self.numel or base.numel() != self.numel:
            raise ValueError(f"params and base must have {self.numel} elements")
        with torch.no_grad():
            if self.spec.codec.is_sparse:
                chunks = self._progress_sparse(params, base, step)
            else:
                chunks = self._progress_dense(params, base, step)
        self.last_sent = chunks
        self.stats.chunks = len(chunks)
        self.stats.encoded_bytes = sum(len(c.payload) for c in chunks)
        return [c.payload for c in chunks]

    def _progress_sparse(
        self, params: torch.Tensor, base: torch.Tensor, step: int
    ) -> list[SentChunk]:
        k = self.spec.k_for(self.numel)
        if self._selector is not None:
            sel = self._selector.select_difference(params, base, k)
            positions, values, sumsq = sel.positions, sel.values, sel.sumsq
            # Each scan reads params and base; the torch path also writes and reads
            # its difference buffer once, and its mask.
            per_scan = 8 if self._selector.numpy_scan else 8 + 4 + 4 + 1
            self.traffic_bytes += sel.scans * per_scan * self.numel
        else:
            acc = params - base
            sumsq = float(torch.dot(acc, acc))
            positions = exact_topk(acc, k)
            values = acc[positions]
            self.traffic_bytes += 16 * self.numel
        if not math.isfinite(sumsq):
            raise NonFiniteUpdateError("update holds NaN or Inf; refused, nothing was sent")
        chunks, sent = self._emit_sparse(positions, values, step)
        # O(k): the positions and values read, base read and written where sent.
        self.traffic_bytes += positions.numel() * (8 + 4 + 4 + 8)
        if base.device.type == "cpu":
            b = base.numpy()
            idx = positions.numpy()
            b[idx] += sent.numpy()
        else:
            base.index_add_(0, positions, sent)
        # What stays behind: |acc|^2 minus the sent values' share of it.
        left = values - sent
        residual_sq = sumsq - float(torch.dot(values, values)) + float(torch.dot(left, left))
        self._bound_progress(params, base, max(0.0, residual_sq), float(sent.norm()))
        return chunks

    def _progress_dense(
        self, params: torch.Tensor, base: torch.Tensor, step: int
    ) -> list[SentChunk]:
        acc = params - base
        self.traffic_bytes += 16 * self.numel
        _check_finite(acc)
        codec = self.spec.codec
        self.stats.k = self.stats.selected = self.numel
        if codec is Codec.DENSE_FP32:
            sent = acc
            payloads = self._dense_chunks(acc, step)
        else:
            payloads, sent = self._dense_lossy(acc, step)
        base.add_(sent)
        # Dense buckets are the small ones (biases, norms): a pass more is nothing.
        self.residual_norm = 0.0 if sent is acc else float(torch.dist(acc, sent))
        self.traffic_bytes += 16 * self.numel
        chunks = []
        for payload in payloads:
            h, _ = parse_chunk(payload)
            at = h.range_start - self.offset
            chunks.append(SentChunk(payload, h, None, sent[at : at + h.range_len]))
        return chunks

    def _bound_progress(
        self, params: torch.Tensor, base: torch.Tensor, residual_sq: float, sent_norm: float
    ) -> None:
        """``residual_max_ratio`` on the progress path: the residual ``params - base`` is
        kept within the ratio times the running norm of what was sent, by moving
        ``base`` toward ``params`` (one pass, only when it is over)."""
        self.residual_norm = math.sqrt(residual_sq)
        ratio = self.spec.residual_max_ratio
        self.stats.residual_scaled = False
        if ratio <= 0.0:
            return
        ema = self._sent_norm_ema
        self._sent_norm_ema = sent_norm if ema == 0.0 else 0.9 * ema + 0.1 * sent_norm
        limit = ratio * self._sent_norm_ema
        if limit > 0.0 and self.residual_norm > limit:
            f = limit / self.residual_norm
            base.mul_(f).add_(params, alpha=1.0 - f)  # residual becomes f times itself
            self.traffic_bytes += 12 * self.numel
            self.residual_norm = limit
            self.stats.residual_scaled = True

    def encode_snapshot(self, values: torch.Tensor, start: int, step: int) -> list[bytearray]:
        """Parameters ``values`` of the range starting at ``start`` as dense INT8 chunks
        (the consensus mix; no error feedback: a snapshot, not a stream)."""
        if values.dim() != 1 or not 0 <= start <= start + values.numel() <= self.numel:
            raise ValueError("the snapshot's range lies outside the bucket")
        block = self.spec.block_size
        codes, scales = quantize_int8(values, block)
        return self._dense_int8_chunks(codes, scales, step, offset=start)

    def _cut_sparse(self, gaps: torch.Tensor, r: int) -> list[tuple[int, int]]:
        """Split selected values into chunks [a, b) whose payload fits, by an upper
        bound on each value's bits; also cut before any gap too long for unary."""
        k = gaps.numel()
        if k == 0:
            return [(0, 0)]
        spec = self.spec
        fixed = r + 1 + spec.codec.value_bits
        if spec.codec.has_scales:
            fixed += -(-SCALE_BYTES * 8 // spec.block_size)
        budget = (spec.chunk_payload_bytes - 16) * 8
        unary = gaps.cpu().numpy() >> r
        breaks = np.flatnonzero(unary > GAP_BREAK_BITS).tolist()
        if not breaks and int(unary.sum()) + fixed * k <= budget:
            return [(0, k)]
        cum = np.cumsum(unary + fixed)
        stops = [b for b in breaks if b > 0] + [k]
        bounds: list[tuple[int, int]] = []
        a = 0
        for stop in stops:
            while a < stop:
                base = int(cum[a - 1]) if a else 0
                b = int(np.searchsorted(cum[a:stop], base + budget, side="right")) + a
                b = max(b, a + 1)
                bounds.append((a, b))
                a = b
        return bounds

    def _encode_dense_lossy(self, acc: torch.Tensor, step: int) -> list[bytearray]:
        self.stats.k = self.stats.selected = self.numel
        chunks, sent = self._dense_lossy(acc, step)
        acc.sub_(sent)
        return chunks

    def _dense_lossy(self, acc: torch.Tensor, step: int) -> tuple[list[bytearray], torch.Tensor]:
        """Chunks of ``acc`` in the bucket's lossy dense codec, and the values as the
        receivers will decode them."""
        if self.spec.codec is Codec.DENSE_INT8:
            block = self.spec.block_size
            codes, scales = quantize_int8(acc, block)
            sent = dequantize_int8(codes, scales, block)
            return self._dense_int8_chunks(codes, scales, step), sent
        low = acc.to(DENSE_DTYPES[self.spec.codec])
        return self._dense_chunks(low, step), low.to(torch.float32)

    def encode_copy(self, values: torch.Tensor, step: int) -> list[bytearray]:
        """The whole bucket's parameters ``values``, already in an fp32, fp16 or bf16
        dtype, as dense chunks of that dtype (the run's last round, core.replica.final;
        no error feedback)."""
        if values.dim() != 1 or values.numel() != self.numel:
            raise ValueError("a copy holds the whole bucket")
        return self._dense_chunks(values, step, _CODEC_OF_DTYPE[values.dtype])

    def _dense_chunks(
        self, values: torch.Tensor, step: int, codec: Codec | None = None
    ) -> list[bytearray]:
        if codec is None:
            codec = self.spec.codec
            if codec is Codec.DENSE_FP32:
                self.stats.k = self.stats.selected = self.numel
        per_chunk = self.spec.chunk_payload_bytes // codec.value_bytes
        chunks = []
        for start in range(0, self.numel, per_chunk):
            end = min(self.numel, start + per_chunk)
            header = self._header(codec, step, start, end - start, end - start)
            chunks.append(build_chunk(header, [_host_bytes(values[start:end])]))
        return chunks

    def _dense_int8_chunks(
        self, codes: torch.Tensor, scales: torch.Tensor, step: int, offset: int = 0
    ) -> list[bytearray]:
        """Chunks of INT8 ``codes`` (and their block scales) for the range starting at
        ``offset``."""
        block = self.spec.block_size
        blocks_per_chunk = self.spec.chunk_payload_bytes // (block + SCALE_BYTES)
        per_chunk = blocks_per_chunk * block
        chunks = []
        numel = codes.numel()
        for start in range(0, numel, per_chunk):
            end = min(numel, start + per_chunk)
            b0, b1 = start // block, -(-end // block)
            header = self._header(
                Codec.DENSE_INT8,
                step,
                offset + start,
                end - start,
                end - start,
                block_size=block,
            )
            sections = [_host_bytes(scales[b0:b1]), _host_bytes(codes[start:end])]
            chunks.append(build_chunk(header, sections))
        return chunks


def _check_finite(update: torch.Tensor) -> None:
    # The sum is one cheap pass; it is non-finite whenever an element is (or, rarely,
    # when finite values overflow), and only then is the exact check paid for.
    if not math.isfinite(float(update.sum())) and not bool(torch.isfinite(update).all()):
        raise NonFiniteUpdateError("update holds NaN or Inf; refused, nothing was sent")


def _host_bytes(t: torch.Tensor) -> memoryview:
    """A tensor's bytes on the host (a copy only when it lives on another device)."""
    host = t.detach().contiguous().cpu()
    return host.view(torch.uint8).numpy().data


# -- decoding ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DecodedChunk:
    """A chunk's header and values, on the device asked for."""

    header: ChunkHeader
    positions: torch.Tensor | None
    """Sorted int64 positions relative to ``header.range_start``; None when dense (or
    not asked for)."""
    values: torch.Tensor
    """fp32 values, one per position (or per element of the range when dense)."""


def decode_chunk(
    chunk: bytes | bytearray | memoryview,
    device: torch.device | str = "cpu",
    *,
    positions: bool = True,
) -> DecodedChunk:
    """Parse and fully validate a chunk; decode its values and positions on ``device``
    (with ``positions=False``, the values only: the index stream is not decoded)."""
    header, payload = parse_chunk(chunk)
    if payload.readonly:
        payload = memoryview(bytearray(payload))
    raw = (
        torch.frombuffer(payload, dtype=torch.uint8)
        if payload
        else torch.empty(0, dtype=torch.uint8)
    ).to(device)
    scale_len, value_len = fixed_sections(header)
    codec = header.codec
    scales = raw[:scale_len].view(torch.float32)
    value_bytes = raw[scale_len : scale_len + value_len]
    if codec.has_scales and not bool(((scales >= 0) & (scales <= _MAX_SCALE[codec])).all()):
        raise InconsistentChunkError("scale negative, non-finite or too large")
    if codec is Codec.SPARSE_INT8 or codec is Codec.DENSE_INT8:
        values = dequantize_int8(value_bytes.view(torch.int8), scales, header.block_size)
    elif codec in _PACKED_BITS:
        bits = _PACKED_BITS[codec]
        codes = unpack(value_bytes, header.count, bits)
        if codes is None or (bits == 4 and bool((codes == 15).any())):
            raise InconsistentChunkError(f"{bits}-bit code outside the grid, or padding set")
        values = dequantize_packed(codes, scales, header.block_size, bits)
    elif codec is Codec.SPARSE_FP16:
        values = value_bytes.view(torch.float16).to(torch.float32)
    elif codec is Codec.DENSE_BF16:
        values = value_bytes.view(torch.bfloat16).to(torch.float32)
    else:
        values = value_bytes.view(DENSE_DTYPES[codec]).to(torch.float32)
    if not codec.has_scales and not bool(torch.isfinite(values).all()):
        raise InconsistentChunkError("non-finite value in chunk")
    found: torch.Tensor | None = None
    if codec.is_sparse and positions:
        index = raw[scale_len + value_len :]
        rem_len = indexcode.remainder_bytes(header.count, header.rice_bits)
        found = indexcode.rice_decode(
            index[:rem_len], index[rem_len:], header.count, header.rice_bits, header.range_len
        )
    return DecodedChunk(header=header, positions=found, values=values)


def apply_chunk(
    chunk: bytes | bytearray | memoryview,
    bucket: torch.Tensor,
    *,
    weight: float = 1.0,
    run_id: bytes | None = None,
    layout_id: int | None = None,
) -> ChunkHeader:
    """Decode a chunk and add ``weight`` times its values into ``bucket`` (1-D fp32).

    Raises a :class:`ChunkDecodeError` for bad bytes and :class:`ChunkMismatchError`
    for a valid chunk of another run, another layout, or a range outside ``bucket``;
    in both cases ``bucket`` is unchanged."""
    decoded = decode_chunk(chunk, bucket.device)
    h = decoded.header
    if run_id is not None and h.run_id != run_id:
        raise ChunkMismatchError(f"chunk of run {h.run_id.hex()}, expected {run_id.hex()}")
    if layout_id is not None and h.layout_id != layout_id:
        raise ChunkMismatchError(
            f"chunk for parameter layout {h.layout_id:016x}, this model is {layout_id:016x}"
        )
    if h.range_start + h.range_len > bucket.numel():
        raise ChunkMismatchError(
            f"range [{h.range_start}, {h.range_start + h.range_len}) outside a bucket "
            f"of {bucket.numel()} elements"
        )
    target = bucket[h.range_start : h.range_start + h.range_len]
    if decoded.positions is None:
        target.add_(decoded.values, alpha=weight)
    else:
        target.index_add_(0, decoded.positions, decoded.values, alpha=weight)
    return h


__all__ = [
    "HEADER_V1_LEN",
    "BucketEncoder",
    "BucketSpec",
    "ChunkSource",
    "DecodedChunk",
    "EncodeStats",
    "SentChunk",
    "apply_chunk",
    "decode_chunk",
]
