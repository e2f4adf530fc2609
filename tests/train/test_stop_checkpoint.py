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


@pytest.mark.processes
def test_a_stopping_daemon_waits_for_its_trainers_checkpoint_where_it_named(
    tmp_path: Path,
) -> None:
    fleet = Fleet(tmp_path / "fleet")
    fleet.start("a", "--listen", f"127.0.0.1:{free_port_block(1)}")
    named = (fleet.root / "a" / "checkpoints").resolve()
    expected = named / f"{run_id_of('ck-default').hex()}.ckpt"
    try:
        fleet.wait(lambda: fleet.status("a") is not None, 60, "daemon up")
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sync = attach(
            model,
            opt,
            run="ck-default",
            socket_path=fleet.root / "a" / "trainer.sock",
            config=load_layered(None, {}),  # store.checkpoint_dir at its default
            handle_sigterm=False,
        )
        try:
            assert sync.stats["checkpoint_path"] == str(expected)
            assert named.stat().st_mode & 0o7777 == 0o700  # nobody else's to replace

            def train(steps: int) -> None:
                for _ in range(steps):
                    loss = model(torch.randn(8, 4)).pow(2).mean()
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    sync.step()

            train(20)
            assert not expected.exists()  # none due yet (every 300 s)
            fleet.procs["a"].send_signal(signal.SIGTERM)
            # The trainer answers at its next step; the daemon waits for it (10 s).
            deadline = time.monotonic() + 30
            while fleet.procs["a"].poll() is None and time.monotonic() < deadline:
                train(1)
                time.sleep(0.01)
            assert fleet.procs["a"].poll() == 0
            assert read_checkpoint(expected).step >= 20
            log = fleet.logs["a"].read_text()
            assert "stopping_with_trainer" in log and "trainer_ready_to_stop" in log
            assert str(expected) in log and "trainer_checkpoint_late" not in log
            train(5)  # the daemon is away: training goes on
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
    fleet = Fleet(tmp_path / "fleet")
    fleet.start("a", "--listen", f"127.0.0.1:{free_port_block(1)}")
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    try:
        fleet.wait(lambda: fleet.status("a") is not None, 60, "daemon up")
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sync = attach(
            model,
            opt,
            run="ck-refused",
            socket_path=fleet.root / "a" / "trainer.sock",
            config=load_layered(None, {}),
            checkpoint_dir=blocked / "under-a-file",
            handle_sigterm=False,
        )
        try:
            fleet.procs["a"].send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 30
            while fleet.procs["a"].poll() is None and time.monotonic() < deadline:
                loss = model(torch.randn(8, 4)).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                sync.step()
                time.sleep(0.01)
            assert fleet.procs["a"].poll() == 0
            log = fleet.logs["a"].read_text()
            assert "trainer_ready_to_stop" in log and "trainer_checkpoint_late" not in log
            assert sync.checkpoint() is None  # refused again, and still no exception
            assert sync.state.checkpoints_failed >= 2
        finally:
            sync.close()
    finally:
        fleet.stop_all()
