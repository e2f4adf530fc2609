"""Replicas under different wrappers train one run: DDP (under torchrun), a compiled
model and a plain one have the same parameter layout once the wrappers' name parts are
taken out (core.codec.layout.canonical_name). Replicas of different models never train
alone in silence: attach fails, naming both layouts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from ciuic_p2p.core.codec.layout import BucketLayout, canonical_name
from ciuic_p2p.lab.cluster import LocalCluster, free_port_block


def small() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))


@pytest.mark.parametrize(
    ("name", "canonical"),
    [
        ("0.weight", "0.weight"),
        ("module.0.weight", "0.weight"),  # DDP, DataParallel, DeepSpeed
        ("_orig_mod.0.weight", "0.weight"),  # torch.compile
        ("module._orig_mod.0.weight", "0.weight"),  # DDP of a compiled model
        ("_orig_mod.module.0.weight", "0.weight"),  # a compiled DDP
        ("_forward_module.layer._fsdp_wrapped_module.weight", "layer.weight"),
        ("blocks.0._checkpoint_wrapped_module.attn.weight", "blocks.0.attn.weight"),
        ("encoder.module.weight", "encoder.module.weight"),  # a user's own "module" inside
        ("module", "module"),  # a parameter named so stays named
    ],
)
def test_wrapper_name_parts_are_taken_out(name: str, canonical: str) -> None:
    assert canonical_name(name) == canonical


def test_compiled_and_wrapped_models_have_the_plain_models_layout() -> None:
    torch.manual_seed(0)
    plain = small()
    compiled = torch.compile(small(), backend="eager")
    assert isinstance(compiled, torch.nn.Module)  # an OptimizedModule, named _orig_mod.*

    class Wrapper(torch.nn.Module):  # what DDP does to names, without a process group
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.module = inner

    layouts = [BucketLayout.for_module(m) for m in (plain, compiled, Wrapper(small()))]
    assert len({x.layout_id for x in layouts}) == 1
    other = BucketLayout.for_module(torch.nn.Linear(8, 33))
    assert other.layout_id != layouts[0].layout_id
    assert "2 tensors" in other.describe() and "297 parameters" in other.describe()


def test_names_that_collide_once_unwrapped_are_refused() -> None:
    class Both(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module = torch.nn.Linear(2, 2)
            self.weight = torch.nn.Parameter(torch.zeros(2, 2))
            self.bias = torch.nn.Parameter(torch.zeros(2))

    with pytest.raises(ValueError, match="duplicate tensor name"):
        BucketLayout.for_module(Both())


TRAINER = r"""
import json, os, sys, time, torch
from ciuic_p2p.config import load_config
from ciuic_p2p.errors import LayoutMismatchError
from ciuic_p2p.train.attach import attach
from ciuic_p2p.train.channel import ChannelError

socket_path, config_path, kind, width = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
steps = int(sys.argv[7]) if len(sys.argv) > 7 else 60
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Linear(width, 1))
if kind == "ddp":
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    dist.init_process_group("gloo")
    model = DDP(model)
elif kind == "compiled":
    model = torch.compile(model, backend="eager")
opt = torch.optim.SGD(model.parameters(), lr=0.05)
t0 = time.monotonic()
try:
    sync = attach(model, opt, run="wrappers", socket_path=socket_path,
                  config=load_config(config_path), min_replicas=int(sys.argv[5]),
                  join_timeout_s=float(sys.argv[6]) if len(sys.argv) > 6 else 90)
    gen = torch.Generator().manual_seed(width + len(kind))
    w = torch.linspace(-1, 1, 8).unsqueeze(1)
    for step in range(steps):
        x = torch.randn(16, 8, generator=gen)
        loss = (model(x) - x @ w).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
        sync.step()
        # A step of a real model takes time: without it, the replicas that attach first
        # can be done (their updates all held by the state a slower joiner fetches)
        # before a torchrun replica on a loaded machine takes its first step.
        time.sleep(0.1)
except (ChannelError, LayoutMismatchError) as exc:
    print(json.dumps({"kind": kind, "error": str(exc), "type": type(exc).__name__,
                      "after_s": time.monotonic() - t0}), flush=True)
    sys.exit(3)
complete = sync.finish(60)
st = sync.stats
print(json.dumps({"kind": kind, "complete": complete, "refused": st["refused"],
                  "applied_from": st["applied_from"], "peer": sync.peer}), flush=True)
sync.close()
"""

CONFIG = """
[codec]
density = 0.25
[train]
consensus_interval_steps = 0
"""


def _trainer(
    cluster: LocalCluster, name: str, script: Path, kind: str, width: int, replicas: int, port: int,
    timeout_s: float = 90.0, steps: int = 60,
) -> subprocess.Popen[str]:  # fmt: skip
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}
    args = [str(cluster.trainer_socket(name)), str(cluster.config_path), kind, str(width)]
    if kind == "ddp":  # a one-rank torchrun job, as a user would start it
        head = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
                "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
                "--master-port", str(port)]  # fmt: skip
    else:
        head = [sys.executable]
    return subprocess.Popen(
        [*head, str(script), *args, str(replicas), str(timeout_s), str(steps)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )


def _results(procs: list[subprocess.Popen[str]], timeout_s: float) -> list[dict[str, Any]]:
    out = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=timeout_s)
            lines = [line for line in stdout.splitlines() if line.startswith("{")]
            assert lines, stderr[-3000:]
            out.append({**json.loads(lines[-1]), "returncode": p.returncode})
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return out


@pytest.mark.processes
def test_a_ddp_a_compiled_and_a_plain_replica_train_one_run(tmp_path: Path) -> None:
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    names = ["n0", "n1", "n2"]
    with LocalCluster(None, names, tmp_path / "c", CONFIG) as cluster:
        cluster.start()
        port = free_port_block(1)
        procs = [
            _trainer(cluster, name, script, kind, 32, 3, port)
            for name, kind in zip(names, ["ddp", "compiled", "plain"], strict=True)
        ]
        results = _results(procs, 240)
    peers = {r["peer"] for r in results}
    for r in results:
        assert r["returncode"] == 0 and r["complete"], r
        assert r["refused"].get("layout", 0) == 0, r
        # Every replica applied the others' updates: one run, not three alone.
        applied = r["applied_from"]
        assert set(applied) == peers - {r["peer"]}, r
        assert all(n > 0 for n in applied.values()), r


@pytest.mark.processes
@pytest.mark.parametrize("min_replicas", [2, 1])
def test_replicas_of_different_models_both_stop_within_seconds_naming_both_layouts(
    tmp_path: Path, min_replicas: int
) -> None:
    """With ``min_replicas=2`` each waited out its whole join timeout before (90 s
    here); with 1 both trained alone for the whole run and exited 0."""
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    with LocalCluster(None, ["n0", "n1"], tmp_path / "c", CONFIG) as cluster:
        cluster.start()
        procs = [
            _trainer(cluster, name, script, "plain", width, min_replicas, 0, 90.0, 600)
            for name, width in (("n0", 32), ("n1", 16))
        ]
        results = _results(procs, 150)
    for r in results:
        assert r["returncode"] == 3, r
        assert r["type"] == "LayoutMismatchError" and r["after_s"] < 10.0, r
        assert r["error"].count("parameter layout") == 2, r
        assert "(3 tensors" not in r["error"]  # both have 4: the ids tell them apart
        assert "must train the same model" in r["error"]
