"""``attach()`` with no socket and no config finds its daemon as the CLI does
(config.locate), says how many replicas joined while it waits, and fails in one line;
its logs are the project's (JSON lines when stderr is not a terminal)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.daemon.fleet import Fleet, free_port_block

pytestmark = pytest.mark.processes

TRAINER = r"""
import json, sys, torch
import ciuic_p2p
from ciuic_p2p.train.channel import ChannelError

torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
try:
    sync = ciuic_p2p.attach(model, opt, run="found", min_replicas=int(sys.argv[1]),
                            join_timeout_s=float(sys.argv[2]))
except ChannelError as exc:
    print(json.dumps({"error": str(exc)}), flush=True)
    sys.exit(3)
for _ in range(5):
    loss = model(torch.randn(8, 4)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step(); sync.step()
print(json.dumps({"steps": sync.replica.step, "finished": sync.finish(30)}), flush=True)
sync.close()
"""


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Path]:
    """One running daemon; its state directory (trainer.sock and control.sock in it)."""
    fleet = Fleet(tmp_path / "fleet")
    fleet.start("a", "--listen", f"127.0.0.1:{free_port_block(1)}")
    try:
        fleet.wait(lambda: fleet.status("a") is not None, 60, "daemon up")
        yield fleet.root / "a"
    finally:
        fleet.stop_all()


def train(tmp_path: Path, env: dict[str, str], replicas: int = 1, timeout_s: float = 60) -> Any:
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    repo = Path(__file__).resolve().parents[2]
    clean = {k: v for k, v in os.environ.items() if not k.startswith("CIUIC_")}
    done = subprocess.run(
        [sys.executable, str(script), str(replicas), str(timeout_s)],
        check=False,
        capture_output=True,
        text=True,
        env={**clean, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1", **env},
        timeout=180,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines, done.stderr[-3000:]
    return done.returncode, json.loads(lines[-1]), done.stderr


def test_attach_finds_the_daemon_from_ciuic_config(tmp_path: Path, daemon: Path) -> None:
    config = tmp_path / "node.toml"
    config.write_text(f'[node]\nstate_dir = "{daemon}"\n')
    code, out, err = train(tmp_path, {"CIUIC_CONFIG": str(config)})
    assert code == 0 and out == {"steps": 5, "finished": True}, err[-2000:]


def test_attach_finds_the_daemon_from_a_ciuic_variable(tmp_path: Path, daemon: Path) -> None:
    code, out, err = train(tmp_path, {"CIUIC_TRAIN_SOCKET_PATH": str(daemon / "trainer.sock")})
    assert code == 0 and out == {"steps": 5, "finished": True}, err[-2000:]


def test_attach_reports_while_it_waits_then_fails_in_one_line(tmp_path: Path, daemon: Path) -> None:
    env = {"CIUIC_NODE_STATE_DIR": str(daemon)}
    code, out, err = train(tmp_path, env, replicas=2, timeout_s=7)
    assert code == 3
    assert out["error"] == "only 1 of 2 replicas of this run joined within 7 s"
    events = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    waiting = [e for e in events if e.get("event") == "waiting_for_replicas"]
    assert waiting and waiting[0]["joined"] == 1 and waiting[0]["of"] == 2, err[-2000:]
    assert 0 < waiting[0]["left_s"] < 7


def test_attach_without_a_daemon_says_where_it_looked(tmp_path: Path) -> None:
    env = {"CIUIC_NODE_STATE_DIR": str(tmp_path / "nothing")}
    code, out, _ = train(tmp_path, env)
    assert code == 3
    assert out["error"].startswith("no daemon serving trainers found (looked at ")
    assert str(tmp_path / "nothing" / "trainer.sock") in out["error"]
    assert "CIUIC_TRAIN_SOCKET_PATH" in out["error"]
