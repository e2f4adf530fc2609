"""The framework callbacks with the real libraries: Hugging Face's ``Trainer`` and
Lightning each train tiny random-initialized models (no downloads) on real daemons:
two nodes train one run; both resume from the framework's checkpoints; a third node
joins a run under way and continues its step count and learning-rate schedule."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from ciuic_p2p.lab.cluster import LocalCluster

pytestmark = pytest.mark.processes

COMMON = r"""
import json, sys, time, torch
from ciuic_p2p.config import load_config

socket_path, config_path, out, max_steps, resume, replicas, rank, run, pause_s = sys.argv[1:10]
max_steps, replicas, rank, pause_s = int(max_steps), int(replicas), int(rank), float(pause_s)
resume = resume == "1"
kwargs = dict(run=run, socket_path=socket_path, config=load_config(config_path),
              min_replicas=replicas, join_timeout_s=120)

def report(cb, global_step, first_lr):
    st = cb.sync.stats
    print(json.dumps({"started_at": cb.started_at, "global_step": global_step,
                      "finished": cb.finished, "applied_from": st["applied_from"],
                      "peer": st["peer"], "refused": st["refused"], "first_lr": first_lr,
                      "restored": st["restored"]["source"]}), flush=True)
"""

HUGGINGFACE = (
    COMMON
    + r"""
from transformers import (GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback,
                          TrainingArguments)
from ciuic_p2p.integrations.huggingface import MeshSyncCallback

torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64,
                                   n_positions=16, bos_token_id=0, eos_token_id=0))

class Data(torch.utils.data.Dataset):
    def __len__(self):
        return 100_000
    def __getitem__(self, i):
        ids = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(2 * i + rank))
        return {"input_ids": ids, "labels": ids}

class Watch(TrainerCallback):
    first_lr = None
    def on_step_begin(self, args, state, control, **kw):
        if self.first_lr is None:
            self.first_lr = kw["lr_scheduler"].get_last_lr()[0]
    def on_step_end(self, args, state, control, **kw):
        if state.global_step % 5 == 0:
            print(json.dumps({"progress": state.global_step}), flush=True)
        time.sleep(pause_s)

cb, watch = MeshSyncCallback(**kwargs), Watch()
args = TrainingArguments(output_dir=out, max_steps=max_steps, per_device_train_batch_size=8,
                         learning_rate=1e-3, lr_scheduler_type="linear", save_strategy="steps",
                         save_steps=10, logging_steps=10, report_to=[], use_cpu=True,
                         dataloader_num_workers=0, disable_tqdm=True, seed=0)
trainer = Trainer(model=model, args=args, train_dataset=Data(), callbacks=[cb, watch])
trainer.train(resume_from_checkpoint=True if resume else None)
report(cb, trainer.state.global_step, watch.first_lr)
"""
)

LIGHTNING = (
    COMMON
    + r"""
import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from ciuic_p2p.integrations.lightning import MeshSyncCallback

class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(),
                                       torch.nn.Linear(32, 1))
        self.first_lr = None
    def training_step(self, batch, i):
        if self.first_lr is None:
            self.first_lr = self.trainer.lr_scheduler_configs[0].scheduler.get_last_lr()[0]
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)
    def on_train_batch_end(self, outputs, batch, i):
        if self.trainer.global_step % 5 == 0:
            print(json.dumps({"progress": self.trainer.global_step}), flush=True)
        time.sleep(pause_s)
    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        decay = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, 1 - s / max_steps))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": decay, "interval": "step"}}

g = torch.Generator().manual_seed(rank)
x = torch.randn(4096, 8, generator=g)
data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)),
                                   batch_size=16, shuffle=True)
cb = MeshSyncCallback(**kwargs)
module = Tiny()
trainer = pl.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, logger=False,
                     default_root_dir=out, enable_progress_bar=False,
                     enable_model_summary=False,
                     callbacks=[cb, ModelCheckpoint(dirpath=out, save_last=True,
                                                    every_n_train_steps=10)])
trainer.fit(module, data, ckpt_path=f"{out}/last.ckpt" if resume else None)
report(cb, trainer.global_step, module.first_lr)
"""
)

SCRIPTS = {"huggingface": HUGGINGFACE, "lightning": LIGHTNING}
FIRST_LR = {"huggingface": 1e-3, "lightning": 0.05}
CONFIG = """
[codec]
density = 0.25
[train]
consensus_interval_steps = 0
"""


class Trainers:
    def __init__(self, cluster: LocalCluster, script: Path, out: Path) -> None:
        self.cluster = cluster
        self.script = script
        self.out = out
        self.procs: list[subprocess.Popen[str]] = []

    def start(
        self, name: str, rank: int, steps: int, replicas: int, run: str, *, resume: bool = False,
        pause_s: float = 0.0,
    ) -> subprocess.Popen[str]:  # fmt: skip
        repo = Path(__file__).resolve().parents[2]
        env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}
        args = [
            str(self.cluster.trainer_socket(name)), str(self.cluster.config_path),
            str(self.out / f"{run}-{name}"), str(steps), "1" if resume else "0", str(replicas),
            str(rank), run, str(pause_s),
        ]  # fmt: skip
        proc = subprocess.Popen(
            [sys.executable, str(self.script), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,
        )
        self.procs.append(proc)
        return proc

    @staticmethod
    def wait_for_progress(proc: subprocess.Popen[str], step: int, timeout_s: float) -> None:
        assert proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            if line.startswith('{"progress"') and json.loads(line)["progress"] >= step:
                return
        raise AssertionError(f"no progress to step {step}: {proc.stderr.read()[-3000:]}")  # type: ignore[union-attr]

    @staticmethod
    def result(proc: subprocess.Popen[str], timeout_s: float) -> dict[str, Any]:
        stdout, stderr = proc.communicate(timeout=timeout_s)
        lines = [x for x in stdout.splitlines() if x.startswith('{"started_at"')]
        assert proc.returncode == 0 and lines, stderr[-4000:]
        return dict(json.loads(lines[-1]))

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.communicate()


def trained_together(results: list[dict[str, Any]]) -> None:
    peers = {r["peer"] for r in results}
    for r in results:
        assert r["finished"] and not r["refused"], r
        assert set(r["applied_from"]) == peers - {r["peer"]}, r
        assert all(n > 0 for n in r["applied_from"].values()), r


@pytest.mark.parametrize("framework", ["huggingface", "lightning"])
def test_framework_trains_two_nodes_resumes_and_takes_a_late_joiner(
    framework: str, tmp_path: Path
) -> None:
    pytest.importorskip("transformers" if framework == "huggingface" else "lightning")
    script = tmp_path / "trainer.py"
    script.write_text(SCRIPTS[framework])
    names = ["n0", "n1", "n2"]
    with LocalCluster(None, names, tmp_path / "c", CONFIG) as cluster:
        cluster.start()
        t = Trainers(cluster, script, tmp_path / "out")
        try:
            # Two nodes train one run.
            procs = [t.start(n, i, 20, 2, "first") for i, n in enumerate(names[:2])]
            first = [t.result(p, 240) for p in procs]
            trained_together(first)
            assert [r["global_step"] for r in first] == [20, 20]

            # Both resume from the framework's checkpoint of step 20 (its optimizer
            # state restored before the callback attaches) and go on to 40, slowly
            # enough (0.2 s a step) that a replica whose restore is slow under load
            # still trains beside the other.
            procs = [
                t.start(n, i, 40, 2, "first", resume=True, pause_s=0.2)
                for i, n in enumerate(names[:2])
            ]
            resumed = [t.result(p, 240) for p in procs]
            trained_together(resumed)
            # (one may start from the other's state some steps on, from the mesh)
            assert all(20 <= r["started_at"] < 40 for r in resumed), resumed
            assert [r["global_step"] for r in resumed] == [40, 40]

            # A third node joins a run under way: the run's step, and the schedule
            # there (the learning rate decays linearly to 0 at the last step).
            steps = 60
            procs = [t.start(n, i, steps, 2, "late", pause_s=0.15) for i, n in enumerate(names[:2])]
            t.wait_for_progress(procs[0], 15, 180)
            late = t.start("n2", 2, steps, 1, "late")
            results = [t.result(p, 300) for p in [*procs, late]]
        finally:
            t.close()
    joiner = results[2]
    assert joiner["restored"] == "mesh" and joiner["started_at"] >= 15, joiner
    assert joiner["global_step"] == steps
    expected_lr = FIRST_LR[framework] * (1 - joiner["started_at"] / steps)
    assert joiner["first_lr"] == pytest.approx(expected_lr, rel=0.05, abs=1e-9), joiner
    assert all(r["global_step"] == steps for r in results)
    others = {r["peer"] for r in results[:2]}
    assert others <= set(joiner["applied_from"]), joiner
