"""A daemon restarted under its trainer (``systemctl restart``: SIGTERM, then start):
the trainer never exits, keeps stepping while its daemon is away, keeps what it
publishes meanwhile, reconnects when a daemon serves its socket again, and the others
take its updates, and it takes theirs of the gap: its daemon resumes each origin
where it stopped and repairs what came meanwhile (separate processes, real QUIC on
loopback). Before, the trainer died with ``ChannelError: the daemon closed the
trainer socket``; then a third of the others' updates never reached it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ciuic_p2p.core.replica.messages import run_id_of
from ciuic_p2p.core.replica.rule import consensus_distance
from ciuic_p2p.lab.cluster import LocalCluster
from tests.train.test_recovery import Watch, _all

pytestmark = pytest.mark.processes

CONFIG = """
[codec]
density = 0.05
[train]
consensus_interval_steps = 16
"""

WITHOUT_BOUNDS = """
[codec]
density = 0.05
[train]
consensus_interval_steps = 0
influence_clip_ratio = 100.0
influence_disagreement = 0.0
update_norm_max_ratio = 1000000.0
"""
"""The member bounds and the consensus mix off: what is left of the distance between
replicas is then what the restart itself leaves (with the bounds on, both runs end
0.016 to 0.03 apart from honest updates clipped and down-weighted, run to run)."""

STEPS = 6000
"""The schedule's length: both runs stop long before it, at the same step."""


@pytest.mark.parametrize("bounds", ["on", "off"])
def test_a_trainer_outlives_its_daemons_restart(tmp_path: Path, bounds: str) -> None:
    names = ["n0", "n1", "n2"]
    out = tmp_path / "out"
    stop = tmp_path / "stop"
    config = CONFIG if bounds == "on" else WITHOUT_BOUNDS
    with LocalCluster(None, names, tmp_path / "c", config) as cluster:
        cluster.start()
        watch = Watch()
        args = ["--task", "digits", "--steps", str(STEPS), "--world", "3", "--step-s", "0.02",
                "--run", "restart", "--evals", "1", "--stop-file", str(stop)]  # fmt: skip
        for rank, name in enumerate(names):
            watch.lines.add(name, cluster.spawn_trainer(name, rank, args, out))
        victim = names[2]
        watch.until(lambda: min(watch.step(n) for n in names) >= 100, 240, "step 100")
        code = cluster.stop_daemon(victim)
        stopped_at = watch.step(victim)
        # Its trainer goes on stepping while its daemon is away.
        watch.until(lambda: watch.step(victim) >= stopped_at + 50, 60, "steps while away")
        cluster.restart(victim)
        # Its trainer reconnects on its own (polling the socket), and is back once its
        # daemon sees another member: 100 steps of the others (2 s) after the restart
        # were not always enough for that, and the run ended without it.
        victim_log = out / "trainer-2.log"
        watch.until(lambda: "daemon_back" in victim_log.read_text(), 60, "its trainer back")
        back_at = watch.step(victim)
        watch.until(
            lambda: min(watch.step(n) for n in names) >= back_at + 100, 120, "after the restart"
        )
        stop.touch()
        watch.until(lambda: all(watch.last(n, "done") is not None for n in names), 300, "the end")
        watch.lines.close()
        logs = {n: (cluster.state_dir(n) / "daemon.log").read_text() for n in names}
    assert code == 0
    assert len(_all(watch, victim, "attached")) == 1  # one trainer life: it never exited
    results = [json.loads((out / f"result-{r}.json").read_text()) for r in range(3)]
    keys = ("peer", "step", "replicas", "chunks_sent", "applied_from", "sent_by_origin",
            "refused", "clipped", "staleness_p99", "excused")  # fmt: skip
    brief = [{k: r["sync"].get(k) for k in keys} for r in results]
    print(json.dumps(brief))
    mine = results[2]["sync"]
    for theirs in results[:2]:
        # What it sent before, while and after its daemon was away reached the others:
        # kept by its channel from its daemon's STOPPING on, sent once the daemon was
        # back, and expected from its new session's start (before: up to a third lost).
        assert theirs["sync"]["sent_by_origin"][mine["peer"]] == mine["chunks_sent"]
        # Applied, every one. After its return the restarted replica's updates grow
        # for a while (its optimizer meets the others' progress of the gap at once):
        # held against a receiver's own RMS alone, 0 to 7 of its chunks a run passed
        # 50 times it and were refused; against the replicas' median at 50 times, 1 to
        # 5 a run in 1 run of 3 (its loss still higher, its SGD steps 52 to 66 times
        # the others'); at 200 (the default now), none: clipped, not refused.
        assert theirs["sync"]["refused"] == {}, theirs["sync"]["refused"]
        assert theirs["sync"]["applied_from"][mine["peer"]] == mine["chunks_sent"]
        # What the others sent while its daemon was down reached it after the restart
        # (its daemon resumed each origin where it stopped, and the gap was repaired
        # from the origins, which keep their chunks): before, a third of theirs never did.
        assert mine["sent_by_origin"][theirs["sync"]["peer"]] == theirs["sync"]["chunks_sent"]
        assert mine["applied_from"][theirs["sync"]["peer"]] == theirs["sync"]["chunks_sent"]
    # finish() returned True everywhere, the restarted replica included: what an origin
    # sent while its new daemon did not list it alive yet is in its account (before, 1
    # run in 4 of the full suite returned False there, every chunk applied).
    assert all(r["finished_in_sync"] for r in results)
    trainer_logs = [(out / f"trainer-{r}.log").read_text() for r in range(3)]
    assert not any("duplicate" in text for text in [*trainer_logs, *logs.values()])
    assert "daemon_away" in trainer_logs[2] and "daemon_back" in trainer_logs[2]
    assert "stopping_with_trainer" in logs[victim]
    # It asked its trainer for a checkpoint and waited for it, where it named (a
    # default attach); the trainer keeps it there to the end.
    assert "trainer_ready_to_stop" in logs[victim] and "trainer_checkpoint_late" not in logs[victim]
    named = (cluster.state_dir(victim) / "checkpoints").resolve()
    assert mine["checkpoint_path"] == str(named / f"{run_id_of('restart').hex()}.ckpt")
    assert Path(mine["checkpoint_path"]).exists()
    params = [torch.load(out / f"params-{r}.pt") for r in range(3)]
    distance = consensus_distance(params)
    steps = max(r["sync"]["step"] for r in results)
    clean = _clean_twin(tmp_path / "clean", steps, config)
    print(f"consensus distance after the restart: {distance:.2e}; the same run without it "
          f"({steps} steps): {clean:.2e}")  # fmt: skip
    # finish()'s last round averages the same copies on every replica: both runs end
    # as one model, up to fp32 rounding (before it, with the bounds on, the restart
    # left 0.021 to 0.031 against twins of 0.017 to 0.025: the bounds clip and
    # down-weight the restarted replica's grown updates more).
    assert distance <= 1e-4 and distance <= clean + 1e-5, (distance, clean)


def _clean_twin(root: Path, steps: int, config: str) -> float:
    """The same run without the restart, stopped at ``steps`` of the same schedule:
    its replicas' final distance. (A twin whose schedule ended there annealed its
    learning rate to zero and drained its residual: 0.000, an unfair mark.)"""
    names = ["n0", "n1", "n2"]
    out = root / "out"
    with LocalCluster(None, names, root / "c", config) as cluster:
        cluster.start()
        watch = Watch()
        args = ["--task", "digits", "--steps", str(STEPS), "--stop-at", str(steps),
                "--world", "3", "--step-s", "0.02", "--run", "restart", "--evals", "1"]  # fmt: skip
        for rank, name in enumerate(names):
            watch.lines.add(name, cluster.spawn_trainer(name, rank, args, out))
        watch.until(lambda: all(watch.last(n, "done") is not None for n in names), 300, "the end")
        watch.lines.close()
    return consensus_distance([torch.load(out / f"params-{r}.pt") for r in range(3)])
