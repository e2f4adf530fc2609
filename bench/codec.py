#!/usr/bin/env python3
"""Codec benchmark: selection, quantization, index coding and framing of one update.

For updates of 10M and 50M fp32 values (fresh heavy-tailed values every repetition:
Student-t with 3 degrees of freedom, never a tiled copy) at densities 1% and 0.1%,
measured in one run with one thread count, each figure the median of --reps:

- the memory copy rate (``copy_`` of 10M fp32 into a preallocated buffer),
- ``torch.topk(x.abs(), k, sorted=False)``,
- the codec's encode (error feedback, selection, quantization, index coding,
  framing) and decode (parse, dequantize, add into a dense tensor), with sizes,
  bits per selected value against the information bound, and errors;
- the selected values in INT8, INT4, INT2 and fp16, each against its bound;
- dense fp16 and plain uniform INT8 (no sparsity) as reference rows;
- index codings side by side (raw int32, LEB128 varints, fixed-width bit-packing,
  zlib, split Rice) and INT8 block sizes side by side.

    python bench/codec.py            # tables
    python bench/codec.py --json     # tables, then one JSON object as the last line
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ciuic_p2p.core.codec.bucket import BucketEncoder, BucketSpec, ChunkSource, apply_chunk
from ciuic_p2p.core.codec.chunk import Codec
from ciuic_p2p.core.codec.quant import dequantize_int8, quantize_int8
from ciuic_p2p.core.codec.select import exact_topk
from ciuic_p2p.train.parallel import thread_parts

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from support.index_coders import CODERS

SOURCE = ChunkSource(run_id=b"bench-run-000001", origin=bytes(32), incarnation=1, layout_id=1)


def heavy_tailed(n: int, gen: torch.Generator) -> torch.Tensor:
    """Fresh Student-t(3) values scaled like gradients: z / sqrt(chi2_3 / 3) * 1e-3."""
    z = torch.randn(n, generator=gen)
    chi = torch.randn(n, generator=gen).square_()
    chi.add_(torch.randn(n, generator=gen).square_()).add_(torch.randn(n, generator=gen).square_())
    return z.div_(chi.div_(3).sqrt_()).mul_(1e-3)


def median_ms(fn: Callable[[], object], reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def topk_abs(x: torch.Tensor, k: int) -> object:
    return torch.topk(x.abs(), k, sorted=False)


def index_bound_bits(n: int, k: int) -> float:
    if k == 0 or k >= n:
        return 0.0
    return (math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)) / math.log(2) / k


def codec_row(
    n: int, codec: Codec, density: float, reps: int, gen: torch.Generator
) -> dict[str, Any]:
    """Encode and decode ``reps`` fresh updates through one encoder (error feedback
    carries across them, as in training); medians of the timings."""
    spec = BucketSpec(codec=codec, density=density)
    enc = BucketEncoder(0, n, spec, SOURCE, seed=1, run_parts=thread_parts)
    target = torch.zeros(n)
    acc = torch.empty(n)
    enc_ms, dec_ms, sizes, sel, rel_err, q_err = [], [], [], [], [], []
    for rep in range(reps + 1):  # the first is a warm-up
        update = heavy_tailed(n, gen)
        if enc.residual is not None:
            torch.add(enc.residual, update, out=acc)
        else:
            acc.copy_(update)
        t0 = time.perf_counter()
        chunks = enc.encode(update, rep)
        t1 = time.perf_counter()
        target.zero_()
        t2 = time.perf_counter()
        for c in chunks:
            apply_chunk(c, target)
        t3 = time.perf_counter()
        if rep == 0:
            continue
        enc_ms.append((t1 - t0) * 1e3)
        dec_ms.append((t3 - t2) * 1e3)
        sizes.append(sum(len(c) for c in chunks))
        sel.append(enc.stats.selected)
        rel_err.append(float((target - acc).norm() / acc.norm()))
        if codec.is_sparse:
            picked = target != 0
            q_err.append(float((target[picked] - acc[picked]).norm() / acc[picked].norm()))
        else:
            q_err.append(rel_err[-1])
    k = spec.k_for(n) if codec.is_sparse else n
    selected = statistics.median(sel)
    nbytes = statistics.median(sizes)
    e_ms, d_ms = statistics.median(enc_ms), statistics.median(dec_ms)
    bound = index_bound_bits(n, k) if codec.is_sparse else 0.0
    return {
        "n": n,
        "codec": codec.name.lower(),
        "density": density if codec.is_sparse else 1.0,
        "k": k,
        "selected": int(selected),
        "selected_over_k": selected / k,
        "encode_ms": e_ms,
        "decode_ms": d_ms,
        "encode_gbps": n * 4 / e_ms / 1e6,
        "decode_gbps": n * 4 / d_ms / 1e6,
        "encoded_bytes": int(nbytes),
        "bits_per_value": nbytes * 8 / selected if selected else 0.0,
        "index_bound_bits": bound,
        "value_bits": codec.value_bits,
        # The information bound at this density: the positions' log2 C(n, k) / k plus
        # the value's own bits (its block's scale excluded).
        "bound_bits": bound + codec.value_bits if codec.is_sparse else None,
        "bits_over_bound": nbytes * 8 / selected / (bound + codec.value_bits)
        if codec.is_sparse and selected
        else None,
        "bits_limit": 1.15 * (codec.value_bits + bound)
        if codec.has_scales and codec.is_sparse
        else None,
        "ratio_vs_fp32": n * 4 / nbytes,
        "rel_error_step": statistics.median(rel_err),
        "rel_error_sent_values": statistics.median(q_err),
    }


def index_rows(n: int, density: float, reps: int, gen: torch.Generator) -> list[dict[str, Any]]:
    k = int(n * density)
    positions = exact_topk(heavy_tailed(n, gen), k).numpy()
    rows = []
    for name, (encode, decode) in CODERS.items():
        data = encode(positions)
        if not np.array_equal(decode(data, k), positions):
            raise AssertionError(f"{name} does not round-trip")
        rows.append(
            {
                "coder": name,
                "n": n,
                "density": density,
                "bits_per_index": len(data) * 8 / k,
                "bound_bits": index_bound_bits(n, k),
                "encode_ms": median_ms(functools.partial(encode, positions), reps),
                "decode_ms": median_ms(functools.partial(decode, data, k), reps),
            }
        )
    return rows


def block_rows(n: int, density: float, gen: torch.Generator) -> list[dict[str, Any]]:
    """INT8 error and cost per block size, on the values top-k selection keeps."""
    x = heavy_tailed(n, gen)
    values = x[exact_topk(x, int(n * density))]
    rows = []
    for block in (16, 32, 64, 128, 256, 1024):
        codes, scales = quantize_int8(values, block)
        back = dequantize_int8(codes, scales, block)
        rows.append(
            {
                "block_size": block,
                "rel_error": float((back - values).norm() / values.norm()),
                "scale_bits_per_value": 32 / block,
            }
        )
    return rows


def print_table(title: str, rows: list[dict[str, Any]], cols: list[str]) -> None:
    widths = [max(len(c), 9) for c in cols]
    print(f"\n{title}")
    print(" ".join(f"{c:>{w}}" for c, w in zip(cols, widths, strict=True)))
    for row in rows:
        cells = []
        for c, w in zip(cols, widths, strict=True):
            v = row.get(c)
            cells.append(f"{v:>{w}.4g}" if isinstance(v, float) else f"{v!s:>{w}}")
        print(" ".join(cells))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--sizes", default="10000000,50000000", help="comma-separated sizes")
    ap.add_argument("--densities", default="0.01,0.001")
    ap.add_argument("--reps", type=int, default=5, help="repetitions per figure (median)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    densities = [float(d) for d in args.densities.split(",")]
    gen = torch.Generator().manual_seed(args.seed)
    reps = args.reps

    base_n = sizes[0]
    src = heavy_tailed(base_n, gen)
    dst = torch.empty_like(src)
    memcpy_ms = median_ms(lambda: dst.copy_(src), max(reps, 5))
    memcpy_gbps = base_n * 4 / memcpy_ms / 1e6

    rows: list[dict[str, Any]] = []
    topk: dict[tuple[int, float], float] = {}
    for n in sizes:
        for density in densities:
            x = heavy_tailed(n, gen)
            k = int(n * density)
            topk[(n, density)] = median_ms(functools.partial(topk_abs, x, k), reps)
            del x
            row = codec_row(n, Codec.SPARSE_INT8, density, reps, gen)
            row["topk_ms"] = topk[(n, density)]
            row["encode_speedup_vs_topk"] = row["topk_ms"] / row["encode_ms"]
            rows.append(row)
        rows.append(codec_row(n, Codec.SPARSE_FP16, densities[0], reps, gen))
        for packed in (Codec.SPARSE_INT4, Codec.SPARSE_INT2):
            rows.append(codec_row(n, packed, densities[0], reps, gen))
        rows.append(codec_row(n, Codec.DENSE_FP16, 1.0, reps, gen))
        rows.append(codec_row(n, Codec.DENSE_INT8, 1.0, reps, gen))

    idx_rows = []
    for density in densities:
        idx_rows += index_rows(base_n, density, reps, gen)
    blk_rows = block_rows(base_n, densities[0], gen)

    print(
        f"memcpy: {memcpy_gbps:.2f} GB/s ({memcpy_ms:.2f} ms for {base_n} fp32), "
        f"torch threads {torch.get_num_threads()}"
    )
    print_table(
        f"codec (median of {reps}; encode includes error feedback and framing)",
        rows,
        [
            "n",
            "codec",
            "density",
            "topk_ms",
            "encode_ms",
            "decode_ms",
            "encode_gbps",
            "decode_gbps",
            "selected_over_k",
            "bits_per_value",
            "index_bound_bits",
            "bits_over_bound",
            "ratio_vs_fp32",
            "rel_error_sent_values",
        ],
    )
    print_table(
        "index coding of top-k positions",
        idx_rows,
        ["coder", "density", "bits_per_index", "bound_bits", "encode_ms", "decode_ms"],
    )
    print_table(
        "INT8 block size (fp32 scale)",
        blk_rows,
        ["block_size", "rel_error", "scale_bits_per_value"],
    )

    head = next(
        r
        for r in rows
        if r["n"] == base_n and r["codec"] == "sparse_int8" and r["density"] == densities[0]
    )
    result: dict[str, Any] = {
        "benchmark": "codec",
        "n": base_n,
        "density": densities[0],
        "encode_gbps": head["encode_gbps"],
        "decode_gbps": head["decode_gbps"],
        "memcpy_gbps": memcpy_gbps,
        "topk_ms": head["topk_ms"],
        "encode_ms": head["encode_ms"],
        "decode_ms": head["decode_ms"],
        "selected_over_k": head["selected_over_k"],
        "bits_per_value": head["bits_per_value"],
        "index_bound_bits": head["index_bound_bits"],
        "ratio_vs_fp32": head["ratio_vs_fp32"],
        "encode_speedup_vs_topk": head["encode_speedup_vs_topk"],
        "criteria": {
            "encode_8x_faster_than_topk": head["encode_speedup_vs_topk"] >= 8,
            "encode_at_least_memcpy_over_10": head["encode_gbps"] >= memcpy_gbps / 10,
            "decode_at_least_memcpy_over_10": head["decode_gbps"] >= memcpy_gbps / 10,
            "selected_within_3pct": abs(head["selected_over_k"] - 1) <= 0.03,
            "bits_within_1_15x_bound": head["bits_per_value"] <= head["bits_limit"],
            "ratio_at_least_150": head["ratio_vs_fp32"] >= 150,
        },
        "rows": rows,
        "value_widths": {
            r["codec"]: {
                k: r[k]
                for k in (
                    "bits_per_value",
                    "bound_bits",
                    "bits_over_bound",
                    "rel_error_sent_values",
                    "ratio_vs_fp32",
                )
            }
            for r in rows
            if r["n"] == base_n
            and r["density"] == densities[0]
            and r["value_bits"] <= 16
            and r["codec"].startswith("sparse")
        },
        "index_coding": idx_rows,
        "block_sizes": blk_rows,
        "threads": torch.get_num_threads(),
        "reps": reps,
        "torch": torch.__version__,
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, {platform.python_version()}",
    }
    print("\ncriteria (10M-class row at the first density):")
    for name, ok in result["criteria"].items():
        print(f"  {'PASS' if ok else 'FAIL'}  {name}")
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
