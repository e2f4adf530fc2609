"""Checkpoints by default: a trainer attached with no checkpoint directory writes its
checkpoints where its daemon names (``checkpoints`` in the daemon's state directory),
and a daemon stopping under its trainer asks it for one and waits for it before it
leaves. Before, a default ``attach`` wrote none and a stopping daemon only logged that
a trainer was attached: its progress was lost with the process."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
import torch

from ciuic_p2p.config import load_layered
from ciuic_p2p.core.replica.messages import run_id_of
from ciuic_p2p.train.attach import attach
from ciuic_p2p.train.checkpoint import (
    DAEMON_NAMED,
    checkpoint_choice,
    daemon_named_dir,
    fallback_dir,
    read_checkpoint,
)
from tests.daemon.fleet import Fleet, free_port_block


def test_where_attach_checkpoints() -> None:
    assert checkpoint_choice(None, "") == DAEMON_NAMED  # the default: the daemon's
    assert checkpoint_choice(None, "off") is None
    assert checkpoint_choice(None, "/srv/ck") == Path("/srv/ck")
    assert checkpoint_choice("", "/srv/ck") is None  # attach's own "" turns them off
    assert checkpoint_choice("/x", "") == Path("/x")


def test_a_trainer_that_cannot_use_the_daemons_directory_falls_back(tmp_path: Path) -> None:
    env = {"XDG_STATE_HOME": str(tmp_path / "xdg")}
    fallback = tmp_path / "xdg" / "ciuic-p2p" / "checkpoints"
    assert fallback_dir(env) == fallback
    assert daemon_named_dir(str(tmp_path), env) == (tmp_path, "named by the daemon")
    a_file = tmp_path / "file"
    a_file.write_text("")
    for named in (None, "", "relative/dir", str(a_file), str(tmp_path / "missing"), 7):
        path, why = daemon_named_dir(named, env)
        assert path == fallback, named
        assert why
    # No home to fall back to either (a container's): no checkpoints, and it trains.
    path, why = daemon_named_dir(None, {"XDG_STATE_HOME": str(a_file)})
    assert path is None and "no checkpoints" in why


class Tiny:
    """A tiny model's trainer on daemon ``a`` of ``fleet`` (``checkpoint_dir``: None,
    the default, where the daemon names)."""

    def __init__(self, fleet: Fleet, run: str, checkpoint_dir: Path | None = None) -> None:
        self.model = torch.nn.Linear(4, 1)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.sync = attach(
            self.model,
            self.opt,
            run=run,
            socket_path=fleet.root / "a" / "trainer.sock",
            config=load_layered(None, {}),  # store.checkpoint_dir at its default
            checkpoint_dir=checkpoint_dir,
            handle_sigterm=False,
        )

    def train(self, steps: int) -> None:
        for _ in range(steps):
            loss = self.model(torch.randn(8, 4)).pow(2).mean()
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            self.sync.step()

    def train_while_it_stops(self, fleet: Fleet) -> None:
        """SIGTERM the daemon and step on: the trainer answers at its next step, and
        the daemon waits for it (10 s)."""
        fleet.procs["a"].send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while fleet.procs["a"].poll() is None and time.monotonic() < deadline:
            self.train(1)
            time.sleep(0.01)
        assert fleet.procs["a"].poll() == 0


def _daemon(tmp_path: Path) -> Fleet:
    fleet = Fleet(tmp_path / "fleet")
    fleet.start("a", "--listen", f"127.0.0.1:{free_port_block(1)}")
    fleet.wait(lambda: fleet.status("a") is not None, 60, "daemon up")
    return fleet


@pytest.mark.processes
def test_a_stopping_daemon_waits_for_its_trainers_checkpoint_where_it_named(
    tmp_path: Path,
) -> None:
    fleet = _daemon(tmp_path)
    named = (fleet.root / "a" / "checkpoints").resolve()
    expected = named / f"{run_id_of('ck-default').hex()}.ckpt"
    try:
        trainer = Tiny(fleet, "ck-default")
        sync = trainer.sync
        try:
            assert sync.stats["checkpoint_path"] == str(expected)
            assert named.stat().st_mode & 0o7777 == 0o700  # nobody else's to replace
            trainer.train(20)
            assert not expected.exists()  # none due yet (every 300 s)
            trainer.train_while_it_stops(fleet)
            assert read_checkpoint(expected).step >= 20
            log = fleet.logs["a"].read_text()
            assert "stopping_with_trainer" in log and "trainer_ready_to_stop" in log
            assert str(expected) in log and "trainer_checkpoint_late" not in log
            trainer.train(5)  # the daemon is away: training goes on
            assert sync.stats["step"] == sync.replica.step >= 26
            assert str(expected) in sync.summary()
        finally:
            sync.close()
    finally:
        fleet.stop_all()


@pytest.mark.processes
def test_a_disk_that_refuses_the_checkpoint_stops_no_trainer(tmp_path: Path) -> None:
    """Checkpoints are on by default, so a full or unwritable disk is common: the
    trainer logs it and trains on; the stopping daemon hears that none was written."""
    fleet = _daemon(tmp_path)
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    try:
        trainer = Tiny(fleet, "ck-refused", checkpoint_dir=blocked / "under-a-file")
        sync = trainer.sync
        try:
            trainer.train_while_it_stops(fleet)
            log = fleet.logs["a"].read_text()
            assert "trainer_ready_to_stop" in log and "trainer_checkpoint_late" not in log
            assert sync.checkpoint() is None  # refused again, and still no exception
            assert sync.state.checkpoints_failed >= 2
        finally:
            sync.close()
    finally:
        fleet.stop_all()
