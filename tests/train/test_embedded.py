"""Embedded mode: three daemons on threads of this process (real QUIC on loopback,
real membership and dissemination), one training loop each, the hook as a user
writes it."""

from __future__ import annotations

import dataclasses
import datetime as dt
import os
import threading
import urllib.request
from pathlib import Path

import pytest
import torch

from ciuic_p2p.admission import ClusterCA, Trust
from ciuic_p2p.config import Config
from ciuic_p2p.core.replica.rule import consensus_distance
from ciuic_p2p.identity import NodeKey
from ciuic_p2p.train.attach import attach
from ciuic_p2p.train.channel import ChannelError
from ciuic_p2p.train.checkpoint import load_newest
from ciuic_p2p.train.embedded import EmbeddedDaemon
from ciuic_p2p.train.hook import MeshSync

pytestmark = pytest.mark.network


def _start_daemons(tmp_path: Path, config: Config, count: int = 3) -> list[EmbeddedDaemon]:
    """``count`` embedded daemons of one new cluster, each joining through the first."""
    now = dt.datetime.now(dt.UTC)
    ca = ClusterCA.create("embedded", now)
    daemons: list[EmbeddedDaemon] = []
    for i in range(count):
        key = NodeKey.generate()
        cfg = dataclasses.replace(config, node=dataclasses.replace(config.node, name=f"n{i}"))
        daemon = EmbeddedDaemon(
            cfg, key, ca.issue(key.public_key, now), Trust(ca.certificate),
            state_dir=tmp_path / f"n{i}", join=daemons[0].address if daemons else None,
        )  # fmt: skip
        daemon.start()
        daemons.append(daemon)
    return daemons


def _attach_all(
    models: list[torch.nn.Module],
    optimizers: list[torch.optim.Optimizer],
    daemons: list[EmbeddedDaemon],
    config: Config,
) -> list[MeshSync]:
    """attach() waits until every trainer joined the run: attach them at once."""
    attached: dict[int, MeshSync] = {}

    def attach_one(i: int) -> None:
        attached[i] = attach(
            models[i], optimizers[i], run="t", daemon=daemons[i], config=config,
            min_replicas=len(models), join_timeout_s=60,
        )  # fmt: skip

    threads = [threading.Thread(target=attach_one, args=(i,)) for i in range(len(models))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert sorted(attached) == list(range(len(models)))
    return [attached[i] for i in range(len(models))]


def test_three_embedded_replicas_train_and_apply_every_chunk_once(tmp_path: Path) -> None:
    base = Config.wan()
    config = dataclasses.replace(
        base,
        node=dataclasses.replace(base.node, listen_port=0),
        codec=dataclasses.replace(base.codec, density=0.05, dense_below_numel=0),
        web=dataclasses.replace(base.web, port=0),
        # The three replicas step in one loop while their daemons are threads of this
        # process: on a loaded host the daemons fall behind and, unbounded, replicas
        # drift apart early on as far as a node sending zeros (measured 0.94 of the
        # parameters' RMS), which the consensus bound rightly refuses. A user bounds
        # staleness the same way: step() waits for peers more than 6 steps behind.
        train=dataclasses.replace(base.train, staleness_bound_steps=6, max_send_interval_steps=2),
    )
    daemons: list[EmbeddedDaemon] = []
    syncs: list[MeshSync] = []
    models: list[torch.nn.Module] = []
    optimizers: list[torch.optim.Optimizer] = []
    try:
        daemons += _start_daemons(tmp_path, config)
        for _ in daemons:
            torch.manual_seed(0)
            model = torch.nn.Sequential(
                torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)
            )
            models.append(model)
            optimizers.append(torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9))
        syncs += _attach_all(models, optimizers, daemons, config)
        gen = torch.Generator().manual_seed(1)
        target = torch.randn(16, 1, generator=gen)
        first = last = 0.0
        for step in range(120):
            for net, opt, sync in zip(models, optimizers, syncs, strict=True):
                x = torch.randn(32, 16, generator=gen)
                loss = ((net(x) - x @ target) ** 2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                sync.step()
                if step == 0:
                    first += float(loss.detach())
                last = float(loss.detach())
        # finish() waits for the others' DONE: call it from three threads at once.
        done: list[bool] = []
        threads = [threading.Thread(target=lambda s=s: done.append(s.finish(60))) for s in syncs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        assert done == [True, True, True]
        for sync in syncs:
            stats = sync.stats
            assert stats["step"] == 120
            assert stats["sent_by_origin"] and all(
                stats["applied_by_origin"][o] + stats["held_by_state_by_origin"][o] == n
                for o, n in stats["sent_by_origin"].items()
            )
            assert stats["refused"] == {}
        for daemon in daemons:  # the hook's figures reached its daemon (sent with chunks)
            figures = daemon.server.progress.trainer
            assert figures["hook_s"] > 0 and figures["encode_s"] > 0 and figures["decode_s"] > 0
            # Embedded too, the daemon serves its metrics, the run named.
            assert daemon.web_url is not None, daemon.web_error
            with urllib.request.urlopen(daemon.web_url + "metrics", timeout=10) as answer:
                text = answer.read().decode()
            assert 'ciuic_trainer_hook_seconds_total{run="t"}' in text
        assert last < 0.2 * first / 3
        assert consensus_distance([s.buckets for s in syncs]) < 0.05
    finally:
        for sync in syncs:
            sync.close()  # stops its embedded daemon too


def test_a_trainer_whose_daemon_stops_writes_a_checkpoint_before_it_gives_up(
    tmp_path: Path,
) -> None:
    now = dt.datetime.now(dt.UTC)
    ca = ClusterCA.create("embedded", now)
    base = Config.wan()
    config = dataclasses.replace(base, node=dataclasses.replace(base.node, listen_port=0))
    key = NodeKey.generate()
    daemon = EmbeddedDaemon(
        config, key, ca.issue(key.public_key, now), Trust(ca.certificate), state_dir=tmp_path
    )
    daemon.start()
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sync = attach(
        model, optimizer, run="gone", daemon=daemon, config=config,
        checkpoint_dir=tmp_path / "ck",
    )  # fmt: skip
    try:
        for _ in range(7):
            optimizer.zero_grad()
            model(torch.ones(4, 8)).sum().backward()
            optimizer.step()
            sync.step()
        daemon.stop()
        closed = threading.Event()
        for _ in range(500):  # the reader thread notices the closed socket
            if sync.channel.closed:
                closed.set()
                break
            sync.channel.wait_any(0.01)
        assert closed.is_set()
        try:
            sync.step()
        except ChannelError as exc:
            assert "checkpoint of step 7 written" in str(exc)
        else:
            raise AssertionError("step() went on without its daemon")
    finally:
        sync.close()
    (name,) = [n for n in os.listdir(tmp_path / "ck") if n.endswith(".ckpt")]
    ckpt = load_newest(tmp_path / "ck" / name)
    assert ckpt is not None and ckpt.step == 7  # every step it completed


def _pairwise_distance_max(replicas: list[list[torch.Tensor]]) -> float:
    """The largest relative L2 distance between two replicas' parameters."""
    flat = [torch.cat([b.detach().float().flatten() for b in r]) for r in replicas]
    return max(float((a - b).norm() / a.norm()) for i, a in enumerate(flat) for b in flat[i + 1 :])


@pytest.mark.parametrize("mode", ["step", "outer"])
def test_finish_leaves_three_replicas_as_one_model(tmp_path: Path, mode: str) -> None:
    """Three plain replicas, 200 steps, the defaults but the mode: after finish(),
    every pair of replicas is within 1e-3 (relative L2). Each replica's own residual
    and the consensus mix's partial cover left them 0.6-1.0% apart; the last round
    averages the same copies everywhere."""
    base = Config.wan()
    config = dataclasses.replace(
        base,
        node=dataclasses.replace(base.node, listen_port=0),
        web=dataclasses.replace(base.web, port=0),
        train=dataclasses.replace(base.train, mode=mode),  # type: ignore[arg-type]
    )
    daemons: list[EmbeddedDaemon] = []
    syncs: dict[int, MeshSync] = {}
    try:
        daemons += _start_daemons(tmp_path, config)
        models: list[torch.nn.Module] = []
        optimizers: list[torch.optim.Optimizer] = []
        for _ in daemons:
            torch.manual_seed(0)
            models.append(
                torch.nn.Sequential(
                    torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)
                )
            )
            optimizers.append(torch.optim.AdamW(models[-1].parameters(), lr=3e-3))
        syncs.update(enumerate(_attach_all(models, optimizers, daemons, config)))
        gens = [torch.Generator().manual_seed(10 + i) for i in range(3)]  # each its data
        target = torch.randn(16, 1, generator=torch.Generator().manual_seed(1))
        for _ in range(200):
            for i in range(3):
                x = torch.randn(32, 16, generator=gens[i])
                loss = ((models[i](x) - x @ target) ** 2).mean()
                optimizers[i].zero_grad()
                loss.backward()
                optimizers[i].step()
                syncs[i].step()
        done: dict[int, bool] = {}
        threads = [
            threading.Thread(target=lambda i=i: done.__setitem__(i, syncs[i].finish(60)))
            for i in range(3)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(150)
        rounds = [syncs[i].stats["final_round"] for i in range(3)]
        assert done == {0: True, 1: True, 2: True}, rounds
        before = 0.0
        for summary in rounds:
            assert summary is not None and summary["members"] == 3 and summary["complete"]
            before = max(before, summary["distance_max"])
        distance = _pairwise_distance_max([syncs[i].buckets for i in range(3)])
        print(f"{mode}: apart before the last round {before:.4f}, after {distance:.2e}")
        assert distance <= 1e-3, distance
    finally:
        for sync in syncs.values():
            sync.close()
