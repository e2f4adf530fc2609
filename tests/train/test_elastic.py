"""Elastic training with embedded daemons (real QUIC on loopback): a late joiner starts
from the mesh's parameters, the shared store outlives its writer, and checkpoints."""

from __future__ import annotations

import dataclasses
import datetime as dt
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from ciuic_p2p.admission import ClusterCA, Trust
from ciuic_p2p.config import Config
from ciuic_p2p.core.codec.layout import BucketLayout
from ciuic_p2p.core.replica.rule import consensus_distance
from ciuic_p2p.core.store.statefile import StateFormatError, pack_state, read_header, unpack_state
from ciuic_p2p.identity import NodeKey
from ciuic_p2p.train.attach import attach
from ciuic_p2p.train.checkpoint import (
    CheckpointError,
    load_newest,
    read_checkpoint,
    write_checkpoint,
)
from ciuic_p2p.train.embedded import EmbeddedDaemon
from ciuic_p2p.train.hook import MeshSync, flatten_parameters

pytestmark = pytest.mark.processes

REPO = Path(__file__).resolve().parents[2]


def _config() -> Config:
    base = Config.wan()
    return dataclasses.replace(
        base,
        node=dataclasses.replace(base.node, listen_port=0),
        # Density 1, no consensus mix and no influence bounds (each receiver scales a
        # peer's chunk by its own judgement, which the mix would even out): the update
        # rule is then exact (replicas that applied the same chunks are equal up to
        # INT8 rounding), so whatever a late joiner's state sync gets wrong shows in
        # the consensus distance.
        codec=dataclasses.replace(base.codec, density=1.0, dense_below_numel=0),
        train=dataclasses.replace(
            base.train,
            consensus_interval_steps=0,
            influence_clip_ratio=100.0,
            influence_disagreement=0.0,
        ),
        store=dataclasses.replace(base.store, piece_bytes=16384, query_timeout_s=1.0),
    )


def _daemons(tmp_path: Path, count: int, config: Config) -> list[EmbeddedDaemon]:
    now = dt.datetime.now(dt.UTC)
    ca = ClusterCA.create("elastic", now)
    out: list[EmbeddedDaemon] = []
    for i in range(count):
        key = NodeKey.generate()
        cfg = dataclasses.replace(config, node=dataclasses.replace(config.node, name=f"n{i}"))
        d = EmbeddedDaemon(
            cfg,
            key,
            ca.issue(key.public_key, now),
            Trust(ca.certificate),
            state_dir=tmp_path / f"n{i}",
            join=out[0].address if out else None,
        )
        d.start()
        out.append(d)
    return out


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))


def _ledger(sync: MeshSync) -> dict[str, object]:
    """What a replica applied, by origin, against what each origin sent: where replicas
    disagree, the origin whose counts differ is the one whose chunks went astray."""
    s: dict[str, object] = dict(sync.stats)
    keys = ("peer", "step", "start_step", "applied_by_origin", "held_by_state_by_origin",
            "refused_by_origin", "sent_by_origin", "chunks_sent", "residual_norm",
            "excused", "restored", "clipped", "weight_raised", "refused")  # fmt: skip
    return {k: s[k] for k in keys}


class Trainer(threading.Thread):
    """One replica's training loop on a thread (the others keep stepping while a
    joiner syncs from them, as on separate machines)."""

    def __init__(self, sync: MeshSync, model: torch.nn.Module, opt: torch.optim.Optimizer,
                 steps: int, seed: int) -> None:  # fmt: skip
        super().__init__(daemon=True)
        self.sync, self.model, self.opt, self.steps = sync, model, opt, steps
        self.gen = torch.Generator().manual_seed(seed)
        self.done_steps = 0
        self.error: BaseException | None = None
        self.complete = False
        self.go_on = threading.Event()
        self.go_on.set()

    def run(self) -> None:
        target = torch.linspace(-1, 1, 16).unsqueeze(1)
        try:
            while self.sync.replica.step < self.steps:  # the run's step, not this loop's
                self.go_on.wait(60)
                x = torch.randn(32, 16, generator=self.gen)
                loss = ((self.model(x) - x @ target) ** 2).mean()
                self.opt.zero_grad()
                loss.backward()
                self.opt.step()
                self.sync.step()
                self.done_steps += 1
                time.sleep(0.002)  # three loops share two cores with three daemons
            # Bounded, but long enough for three loaded daemons on two cores.
            self.complete = self.sync.finish(120)
        except BaseException as exc:
            self.error = exc


def test_late_joiner_starts_from_the_mesh_state_and_the_store_outlives_its_writer(
    tmp_path: Path,
) -> None:
    config = _config()
    daemons = _daemons(tmp_path, 3, config)
    trainers: list[Trainer] = []
    try:
        models = [_model(0), _model(0)]
        opts = [torch.optim.SGD(m.parameters(), lr=0.02, momentum=0.9) for m in models]
        attached: dict[int, MeshSync] = {}

        def attach_one(i: int) -> None:
            attached[i] = attach(models[i], opts[i], run="e", daemon=daemons[i], config=config,
                                 min_replicas=2, join_timeout_s=60)  # fmt: skip

        threads = [threading.Thread(target=attach_one, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        assert all(attached[i].restored["source"] == "fresh" for i in range(2))
        trainers = [Trainer(attached[i], models[i], opts[i], 400, i) for i in range(2)]
        for t in trainers:
            t.start()
        deadline = time.monotonic() + 120
        while min(t.done_steps for t in trainers) < 60 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert min(t.done_steps for t in trainers) >= 60, [t.error for t in trainers]

        # A third node joins mid-run with different random weights.
        late_model = _model(99)
        fresh = [p.detach().clone() for p in late_model.parameters()]
        late_opt = torch.optim.SGD(late_model.parameters(), lr=0.02, momentum=0.9)
        late = attach(late_model, late_opt, run="e", daemon=daemons[2], config=config,
                      min_replicas=3, join_timeout_s=60)  # fmt: skip
        info = late.restored
        assert info["source"] == "mesh", info
        assert late.start_step >= 60 and info["bytes"] > 0
        assert set(info["donors"]) <= set(late.replica.peers)
        assert late_opt.state, "the optimizer's momentum came with the state"
        assert any(
            not torch.equal(a, b) for a, b in zip(fresh, late_model.parameters(), strict=True)
        )
        # Its parameters are the replicas' (mid-run they differ by their unsent
        # residuals), far closer to them than its own random ones.
        for t in trainers:
            t.go_on.clear()
        time.sleep(0.3)
        old = [torch.cat([b.detach().flatten() for b in s.buckets]) for s in attached.values()]
        mine = torch.cat([b.detach().flatten() for b in late.buckets])
        for t in trainers:
            t.go_on.set()
        mean = (old[0] + old[1]) / 2
        from_fresh = float((torch.cat([f.flatten() for f in fresh]) - mean).norm())
        assert float((mine - mean).norm()) < 0.5 * from_fresh

        joined = Trainer(late, late_model, late_opt, 400, 7)
        joined.start()
        trainers.append(joined)
        for t in trainers:
            t.join(180)
            assert t.error is None, t.error
        # The joiner's state left out the donor's unsent and unsettled parts, and every
        # chunk carries its origin's weight: the three agree to float rounding plus
        # their own last residuals (measured 1e-4 to 6e-4 here, 0.006 to 0.19 before).
        syncs = (*attached.values(), late)
        assert all(t.complete for t in trainers), [s.summary() for s in syncs]
        final = [[b.detach().clone() for b in s.buckets] for s in syncs]
        distance = consensus_distance(final)
        if distance >= 0.01:  # pytest cuts a long message; captured output comes whole
            for s in syncs:
                print(_ledger(s))
        assert distance < 0.01

        # The shared store: node 0 puts a state dict; two others hold it; node 0 leaves.
        written = {k: v.clone() for k, v in models[0].state_dict().items()}
        version = attached[0].put("model_state", written)
        assert version >= 1
        attached[0].close()
        daemons[0].stop(leave=True)
        got = late.get("model_state")
        assert got.keys() == written.keys()
        assert all(torch.equal(got[k], written[k]) for k in written)
        got_b = attached[1].get("model_state", min_version=version)
        assert all(torch.equal(got_b[k], written[k]) for k in written)
        with pytest.raises(Exception, match="no member holds"):
            late.get("never_written")
    finally:
        for t in trainers:
            t.go_on.set()
        for d in daemons:
            d.stop(leave=False)


# -- state format and checkpoints ---------------------------------------------------------


@pytest.mark.parametrize("opt_kind", ["sgd", "adamw"])
def test_state_round_trip_with_optimizer_state(opt_kind: str) -> None:
    def setup(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, list[torch.Tensor]]:
        m = _model(seed)
        layout = BucketLayout.for_module(m, dense_below_numel=0)
        buckets = flatten_parameters(m, layout)
        o: torch.optim.Optimizer = (
            torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
            if opt_kind == "sgd"
            else torch.optim.AdamW(m.parameters(), lr=1e-3)
        )
        return m, o, buckets

    m, o, buckets = setup(1)
    for _ in range(3):
        m(torch.randn(4, 16)).sum().backward()
        o.step()
    layout_id = BucketLayout.for_module(m, dense_below_numel=0).layout_id
    blob, compat = pack_state(layout_id, buckets, o)
    m2, o2, buckets2 = setup(2)
    unpack_state(blob, layout_id, buckets2, o2)
    assert all(torch.equal(a, b) for a, b in zip(buckets, buckets2, strict=True))
    for p, p2 in zip(m.parameters(), m2.parameters(), strict=True):
        assert torch.equal(p, p2)
        for k, v in o.state[p].items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(o2.state[p2][k]))
    # The layout of a state (its compat) does not depend on the values or the step.
    m2(torch.randn(4, 16)).sum().backward()
    o2.step()
    assert pack_state(layout_id, buckets2, o2)[1] == compat
    assert read_header(blob)[0]["layout"] == f"{layout_id:016x}"
    # Another model's state, and broken bytes, are refused before anything changes.
    before = [b.clone() for b in buckets2]
    with pytest.raises(StateFormatError, match="another model"):
        unpack_state(blob, layout_id ^ 1, buckets2, o2)
    for bad in (blob[:10], blob[:-100], b"\xff" * 64, bytes(blob[:4]) + b"{}" + bytes(blob[6:])):
        with pytest.raises(StateFormatError):
            unpack_state(bad, layout_id, buckets2, o2)
    assert all(torch.equal(a, b) for a, b in zip(before, buckets2, strict=True))


def test_checkpoints_are_atomic_and_a_cut_short_one_is_never_loaded(tmp_path: Path) -> None:
    path = tmp_path / "ck" / "run.ckpt"
    write_checkpoint(path, 10, b"state-10" * 1000, b"c" * 32)
    write_checkpoint(path, 20, b"state-20" * 1000, b"c" * 32)
    assert read_checkpoint(path).step == 20
    assert load_newest(path).step == 20  # type: ignore[union-attr]
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]
    # Power loss in the middle of the write: the file is cut short.
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(CheckpointError, match="cut short"):
        read_checkpoint(path)
    assert load_newest(path).step == 10  # type: ignore[union-attr]  # the previous one
    # A flipped byte anywhere is caught by the digest.
    write_checkpoint(path, 30, b"state-30" * 1000, b"c" * 32)
    flipped = bytearray(path.read_bytes())
    flipped[100] ^= 1
    path.write_bytes(flipped)
    with pytest.raises(CheckpointError, match="digest"):
        read_checkpoint(path)
    assert load_newest(path).step == 10  # type: ignore[union-attr]  # the cut one was not kept
    path.with_name(path.name + ".prev").write_bytes(b"CIUCKPT1")
    assert load_newest(path) is None


SIGTERM_SCRIPT = r"""
import dataclasses, sys, datetime as dt, torch
from pathlib import Path
from ciuic_p2p.admission import ClusterCA, Trust
from ciuic_p2p.config import Config
from ciuic_p2p.identity import NodeKey
from ciuic_p2p.train.embedded import EmbeddedDaemon
from ciuic_p2p.train.attach import attach

tmp = Path(sys.argv[1])
base = Config.wan()
config = dataclasses.replace(base, node=dataclasses.replace(base.node, listen_port=0))
now = dt.datetime.now(dt.UTC)
ca = ClusterCA.create("t", now)
key = NodeKey.generate()
daemon = EmbeddedDaemon(config, key, ca.issue(key.public_key, now), Trust(ca.certificate),
                        state_dir=tmp / "state")
torch.manual_seed(int(sys.argv[2]))
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
sync = attach(model, opt, run="ck", daemon=daemon, config=config, checkpoint_dir=tmp / "ck")
print("start", sync.start_step, sync.restored["source"], float(model.weight.sum()), flush=True)
step = sync.start_step
while True:
    x = torch.randn(16, 8)
    loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    sync.step()
    step += 1
    if step % 10 == 0:
        print("step", step, float(model.weight.detach().sum()), flush=True)
"""


def _line(proc: subprocess.Popen[str], word: str) -> list[str]:
    """The next line of the script's output that starts with ``word`` (logs between)."""
    assert proc.stdout is not None
    for _ in range(1000):
        line = proc.stdout.readline()
        if not line:
            break
        if line.split()[:1] == [word]:
            return line.split()
    raise AssertionError(f"no {word!r} line")


def test_sigterm_writes_a_checkpoint_and_a_restart_resumes_from_it(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def start(seed: int) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-c", SIGTERM_SCRIPT, str(tmp_path), str(seed)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip

    proc = start(1)
    try:
        first = _line(proc, "start")
        assert first[:3] == ["start", "0", "fresh"], first
        while int(_line(proc, "step")[1]) < 50:
            pass
        proc.terminate()  # SIGTERM
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 143, err[-2000:]
    (name,) = [n for n in os.listdir(tmp_path / "ck") if n.endswith(".ckpt")]
    ckpt = load_newest(tmp_path / "ck" / name)
    assert ckpt is not None and ckpt.step >= 50
    # The restart (other seed: other random weights) resumes from the checkpoint.
    proc = start(2)
    try:
        again = _line(proc, "start")
    finally:
        proc.kill()
        proc.communicate()
    assert again[:3] == ["start", str(ckpt.step), "checkpoint"], again
