"""The codec benchmark runs and prints the keys the README and the issues quote.
Timings are the benchmark's business; this only checks that it works."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes

BENCH = Path(__file__).resolve().parents[1] / "bench" / "codec.py"
KEYS = {
    "encode_gbps",
    "decode_gbps",
    "memcpy_gbps",
    "topk_ms",
    "encode_ms",
    "selected_over_k",
    "bits_per_value",
    "index_bound_bits",
    "ratio_vs_fp32",
}


def test_codec_benchmark_prints_one_json_object_last() -> None:
    cmd = [sys.executable, str(BENCH), "--sizes", "200000", "--densities", "0.01", "--reps", "1"]
    out = subprocess.run([*cmd, "--json"], capture_output=True, text=True, check=True, timeout=120)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result.keys() >= KEYS
    assert result["selected_over_k"] == 1.0
    assert (
        result["index_bound_bits"]
        < result["bits_per_value"]
        < 1.15 * (8 + result["index_bound_bits"])
    )
    widths = result["value_widths"]
    assert set(widths) == {"sparse_int8", "sparse_fp16", "sparse_int4", "sparse_int2"}
    bits = [widths[f"sparse_int{b}"]["bits_per_value"] for b in (8, 4, 2)]
    assert bits[0] > bits[1] > bits[2] > result["index_bound_bits"]
    errors = [widths[f"sparse_int{b}"]["rel_error_sent_values"] for b in (8, 4, 2)]
    assert errors[0] < errors[1] < errors[2] < 1
    coders = {row["coder"] for row in result["index_coding"]}
    assert "rice_split (ciuic)" in coders and "raw_int32" in coders
