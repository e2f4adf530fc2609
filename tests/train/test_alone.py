"""A replica that trained alone while replicas of its run were there says so: its
``finish()`` returns False and it logs ``no_peer_update_applied`` (embedded daemons,
real QUIC on loopback)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from ciuic_p2p.train.attach import attach
from ciuic_p2p.train.hook import MeshSync
from tests.train.test_elastic import _config, _daemons, _model

pytestmark = pytest.mark.processes


def test_a_replica_that_applied_nothing_from_the_replicas_it_saw_does_not_finish_in_sync(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """The peer joins the run and never sends an update (a trainer stuck before its
    first step, or whose every chunk was refused): the other's run looked complete
    (``finish()`` True) while nothing of the peer's reached its model."""
    config = _config()
    daemons = _daemons(tmp_path, 2, config)
    try:
        models = [_model(0), _model(0)]
        opts = [torch.optim.SGD(m.parameters(), lr=0.02) for m in models]
        attached: dict[int, MeshSync] = {}

        def attach_one(i: int) -> None:
            attached[i] = attach(models[i], opts[i], run="alone", daemon=daemons[i],
                                 config=config, min_replicas=2, join_timeout_s=60)  # fmt: skip

        threads = [threading.Thread(target=attach_one, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        syncs = [attached[0], attached[1]]
        gen = torch.Generator().manual_seed(0)
        for _ in range(20):
            x = torch.randn(8, 16, generator=gen)
            loss = models[0](x).pow(2).mean()
            opts[0].zero_grad()
            loss.backward()
            opts[0].step()
            syncs[0].step()
        done: dict[int, bool] = {}
        peer = threading.Thread(target=lambda: done.setdefault(1, syncs[1].finish(30)))
        peer.start()
        assert syncs[0].finish(30) is False
        peer.join(60)
        assert done[1]  # it applied the first one's: it did train with it
        assert syncs[0].stats["applied"] == 0
        said = capfd.readouterr()  # structlog prints, or hands to logging (per setup)
        assert "no_peer_update_applied" in said.out + said.err + caplog.text
        for s in syncs:
            s.close()
    finally:
        for d in daemons:
            d.stop()
