"""bench/rounds.py runs and its outer mode reduces to DDP where it must: one inner
step, dense values, no delay, the replicas equal (averaging parameters after each step of SGD with
momentum is stepping with the mean gradient: the momentum is linear)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes

BENCH = Path(__file__).resolve().parents[1] / "bench" / "rounds.py"


def test_one_dense_inner_step_is_ddp_and_compression_is_not() -> None:
    cmd = [
        sys.executable, str(BENCH), "--task", "digits", "--steps", "30", "--seeds", "1",
        "--lr-scales", "1", "2", "--configs", "1:1:fp16:1:0", "5:0.01:int2:1:1", "--json",
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=120)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(result["ddp_eval_loss_by_lr_scale"]) == {"1", "2"}
    rows = {(r["lr_scale"], r["config"]): r for r in result["rows"]}
    assert len(rows) == 4
    for scale in (1.0, 2.0):
        dense, sparse = rows[(scale, "1:1:fp16:1:0")], rows[(scale, "5:0.01:int2:1:1")]
        assert abs(dense["loss_vs_ddp_pct"]) < 0.2  # fp16 rounding only
        assert dense["consensus_distance"] < 1e-3
        # Nothing is left unsent: the anchor is the parameters.
        assert dense["anchor_eval_loss"] == pytest.approx(dense["eval_loss"], rel=1e-3)
        assert sparse["consensus_distance"] > 1e-3  # the replicas differ: not DDP
        assert sparse["eval_loss"] != pytest.approx(dense["eval_loss"], rel=1e-4)
        assert sparse["anchor_eval_loss"] != pytest.approx(sparse["eval_loss"], rel=1e-4)
        assert sparse["payload_bytes_per_step"] < dense["payload_bytes_per_step"] / 10
