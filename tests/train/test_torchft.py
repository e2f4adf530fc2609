"""torchft's DiLoCo as the training benchmark's baseline peer: real torchft replicas
(lighthouse, managers, Gloo) in a loopback-only network namespace of their own
(ciuic_p2p.lab.torchft_peer), trained on the same task, batches and schedule as the
other modes. Checked against DiLoCo computed in this process from the same batches."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from ciuic_p2p.lab import torchft_peer
from ciuic_p2p.lab.tasks import make_task

pytestmark = pytest.mark.processes

WHY = torchft_peer.available()


def diloco_in_process(world: int, steps: int, inner_steps: int, seed: int) -> torch.Tensor:
    """DiLoCo from the textbook, on the worker's batches: ``world`` replicas of the
    task's optimizer, every H steps the mean pseudo-gradient through outer SGD with
    Nesterov momentum; the final global parameters, flat."""
    task = make_task("digits")
    torch.manual_seed(seed)
    anchor = task.model()
    models = [make_task("digits").model() for _ in range(world)]
    for m in models:
        m.load_state_dict(anchor.state_dict())
    inner = [task.optimizer(list(m.parameters())) for m in models]
    outer = torch.optim.SGD(
        anchor.parameters(),
        lr=torchft_peer.DILOCO_OUTER["outer_lr"],
        momentum=torchft_peer.DILOCO_OUTER["outer_momentum"],
        nesterov=True,
    )
    gens = [torch.Generator().manual_seed(seed * 1000 + r + 1) for r in range(world)]
    base_lr = inner[0].param_groups[0]["lr"]
    for step in range(1, steps + 1):
        scale = 0.5 * (1 + math.cos(math.pi * (step - 1) / steps))
        for r, (m, opt) in enumerate(zip(models, inner, strict=True)):
            for g in opt.param_groups:
                g["lr"] = base_lr * scale
            opt.zero_grad(set_to_none=False)
            torch.autograd.backward(task.loss(m, task.batch(r, world, gens[r])))
            opt.step()
        if step % inner_steps == 0:
            with torch.no_grad():
                for i, p in enumerate(anchor.parameters()):
                    locals_ = [list(m.parameters())[i] for m in models]
                    p.grad = torch.stack([p - q for q in locals_]).mean(0)
            outer.step()
            for m in models:
                m.load_state_dict(anchor.state_dict())
    return torch.cat([p.detach().flatten() for p in anchor.parameters()])


@pytest.mark.skipif(WHY is not None, reason=f"torchft baseline: {WHY}")
def test_torchft_replicas_compute_diloco_on_the_same_batches(tmp_path: Path) -> None:
    world, steps, h, seed = 2, 12, 4, 3
    args = ["--world", str(world), "--inner-steps", str(h), "--out", str(tmp_path)]
    args += ["--task", "digits", "--steps", str(steps), "--seed", str(seed), "--evals", "2"]
    launcher = subprocess.Popen(
        torchft_peer.command([*args, "--timeout-s", "90"]),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,  # its replicas in its group: ended with it, by its PID
    )
    try:
        _, err = launcher.communicate(timeout=150)
    finally:
        if launcher.poll() is None:
            launcher.terminate()  # the launcher ends its replicas on SIGTERM
            try:
                launcher.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(launcher.pid, signal.SIGKILL)
                launcher.wait(10)
    assert launcher.returncode == 0, err.decode()[-2000:]
    results = [json.loads((tmp_path / f"result-{r}.json").read_text()) for r in range(world)]
    assert [r["rounds"] for r in results] == [steps // h] * world
    params = [torch.cat(torch.load(tmp_path / f"params-{r}.pt")) for r in range(world)]
    assert torch.equal(params[0], params[1])  # a round's end: every replica holds the anchor
    expected = diloco_in_process(world, steps, h, seed)
    assert torch.allclose(params[0], expected, atol=1e-5), (params[0] - expected).abs().max()
    # Every byte on the namespace's loopback, shared out: at least the fp32 ring's.
    ring = 2 * (world - 1) / world * 4 * params[0].numel() * (steps // h)
    assert results[0]["udp_bytes_sent"] * world >= ring
    # The curve's byte column counts the same wire, as it goes (the plot's x axis).
    sent = [c[4] for c in results[0]["curve"]]
    assert sent == sorted(sent) and sent[-1] > 0
