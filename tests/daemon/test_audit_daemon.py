"""The daemon's audit log, end to end: admissions and refusals, chunk traffic per
interval, state served to a member, the stop; `ciuic-node audit verify` on the files
and on an edited copy."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ciuic_p2p.admission import load_certificate, write_pem
from ciuic_p2p.daemon.control import request
from ciuic_p2p.train.channel import DaemonChannel
from tests.daemon.fleet import NOW, Fleet, free_port_block

pytestmark = pytest.mark.processes


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ciuic_p2p.cli", *args],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def entries(directory: Path) -> list[dict[str, Any]]:
    return [
        json.loads(line)
        for f in sorted(directory.glob("audit-*.jsonl"))
        for line in f.read_text().splitlines()
    ]


def test_audit_log_records_admissions_traffic_state_and_verifies(
    fleet: Fleet, tmp_path: Path
) -> None:
    base = free_port_block(3)
    env = {"CIUIC_AUDIT_INTERVAL_S": "0.5"}
    # A node whose certificate a's revocation list names (it does not know: it starts).
    rogue = load_certificate(fleet.state_dir("rogue") / "node.pem")
    write_pem(
        fleet.state_dir("a") / "revoked.pem", fleet.ca.revocation_list([rogue.serial_number], NOW)
    )
    fleet.start("a", "--listen", f"127.0.0.1:{base}", env=env)
    fleet.wait(lambda: fleet.status("a") is not None, 60, "a up")
    fleet.start("b", "--listen", f"127.0.0.1:{base + 1}", "--join", f"127.0.0.1:{base}", env=env)
    fleet.wait(lambda: (s := fleet.status("a")) is not None and s["alive"] == 2, 60, "b in")
    # Chunks from b to a, and an object a holds that b fetches.
    for _ in range(3):
        assert request(fleet.control("b"), {"cmd": "broadcast", "size": 5000})["ok"]
    blob = tmp_path / "blob.bin"
    blob.write_bytes(b"x" * 300_000)
    put = cli(
        "store", "put", "shared/blob", str(blob), "--local", "--state-dir", str(tmp_path / "a")
    )
    assert put.returncode == 0, put.stderr
    got = cli("store", "get", "shared/blob", str(tmp_path / "got.bin"), "--state-dir",
              str(tmp_path / "b"))  # fmt: skip
    assert got.returncode == 0, got.stderr
    # a's trainer reports a checkpoint it wrote.
    channel = DaemonChannel.connect(tmp_path / "a" / "trainer.sock")
    try:
        channel.hello("audit-test")
        channel.checkpoint_written(tmp_path / "run.ckpt", 42, "ab" * 32)
        fleet.wait(
            lambda: (
                (s := fleet.status("a")) is not None
                and s["counters"].get("trainer_checkpoints") == 1
            ),
            30,
            "the checkpoint reported",
        )
    finally:
        channel.close()
    # The revoked node is refused and recorded.
    fleet.start("rogue", "--listen", f"127.0.0.1:{base + 2}", "--join", f"127.0.0.1:{base}")
    assert fleet.procs["rogue"].wait(60) == 1
    fleet.wait(
        lambda: any(e["kind"] == "traffic" for e in entries(tmp_path / "a" / "audit")),
        30,
        "a's traffic entry",
    )
    for name in ("a", "b"):
        fleet.procs[name].send_signal(signal.SIGTERM)
        assert fleet.procs[name].wait(10) == 0

    log_a = entries(tmp_path / "a" / "audit")
    kinds = [e["kind"] for e in log_a]
    assert kinds[0] == "started" and kinds[-1] == "stopped"
    assert "admitted" in kinds and "refusals" in kinds and "served_state" in kinds
    refusals = [e["data"] for e in log_a if e["kind"] == "refusals"]
    assert sum(r["total"] for r in refusals) >= 1 and "127.0.0.0/24" in refusals[0]["networks"]
    served = next(e for e in log_a if e["kind"] == "served_state")
    ckpt = next(e for e in log_a if e["kind"] == "checkpoint")
    assert ckpt["data"] == {"path": str(tmp_path / "run.ckpt"), "step": 42, "digest": "ab" * 32}
    assert served["data"]["name"] == "shared/blob" and served["data"]["bytes"] == 300_000
    received = [e for e in log_a if e["kind"] == "traffic"]
    assert sum(v["chunks"] for e in received for v in e["data"]["received"].values()) >= 3

    verify = cli("audit", "verify", str(tmp_path / "a" / "audit"), "--key",
                 str(tmp_path / "a" / "node.pem"))  # fmt: skip
    assert verify.returncode == 0 and verify.stdout.startswith("ok"), verify.stdout + verify.stderr
    # An edited copy: the verdict names the file and line.
    edited = tmp_path / "edited"
    shutil.copytree(tmp_path / "a" / "audit", edited)
    first = sorted(edited.glob("audit-*.jsonl"))[0]
    lines = first.read_text().splitlines()
    lines[2] = lines[2].replace('"kind":"', '"kind":"x', 1)
    first.write_text("\n".join(lines) + "\n")
    broken = cli("audit", "verify", str(edited), "--key", str(tmp_path / "a" / "node.pem"))
    assert broken.returncode == 1 and f"{first.name}:3" in broken.stdout + broken.stderr
