"""What the status page is given, without a browser: the reasons behind a degraded
health, each peer's trainer of its own run (live or ended), the token's message, the
URL printed at start and a node's default name."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import aiohttp
import pytest

from ciuic_p2p.admission import ClusterCA, Trust
from ciuic_p2p.config import Config, NodeSection, WebSection
from ciuic_p2p.config.rules import validate
from ciuic_p2p.core.mesh.suspicion import NACKS_MISSING, PROBE_UNANSWERED, SUSPECTED, Awareness
from ciuic_p2p.daemon.assembly import bare_daemon
from ciuic_p2p.daemon.metrics import TrainingProgress
from ciuic_p2p.daemon.nodestatus import health_reasons
from ciuic_p2p.daemon.web import WebServer, page_announcement, trainers_by_peer
from ciuic_p2p.identity import NodeKey
from tests.daemon.fleet import NOW
from tests.daemon.memorymesh import MemoryMesh, until
from tests.virtualtime import run_virtual

OURS, THEIRS = b"o" * 16, b"t" * 16


def test_awareness_keeps_what_raised_its_score_until_it_is_back_to_0() -> None:
    health = Awareness(8)
    health.apply(1, PROBE_UNANSWERED)
    health.apply(2, NACKS_MISSING)
    health.apply(1, SUSPECTED)
    health.apply(-1)  # a probe answered: the causes stay while the score is above 0
    assert health.score == 3
    assert health.reasons == {PROBE_UNANSWERED: 1, NACKS_MISSING: 2, SUSPECTED: 1}
    texts = [r["text"] for r in health_reasons(health.reasons)]
    assert texts[0].startswith("2 helper(s) silent")  # the largest share first
    assert any("suspected by members 1 time(s)" in t for t in texts)
    health.apply(-3)
    assert health.score == 0 and health.reasons == {}
    health.apply(0, NACKS_MISSING)  # every helper nacked: not a cause
    assert health.reasons == {}


def test_status_says_why_health_is_degraded_after_a_network_stall(tmp_path: Path) -> None:
    async def main() -> None:
        mesh = MemoryMesh(tmp_path, ["a", "b", "c"])
        try:
            await mesh.form()
            a = mesh.nodes["a"].daemon
            assert a.status()["health_score"] == 0 and a.status()["health_reasons"] == []
            mesh.network.latency_s = 1.5  # every message late: probes fail
            await until(lambda: a.mesh.health_score >= 2, 60)
            mesh.network.latency_s = 0.01
            reasons = a.status()["health_reasons"]
            assert {r["reason"] for r in reasons} <= {NACKS_MISSING, PROBE_UNANSWERED, SUSPECTED}
            assert reasons and all(r["count"] > 0 and r["text"] for r in reasons)
            await until(lambda: a.mesh.health_score == 0, 120)
            assert a.status()["health_reasons"] == []
        finally:
            await mesh.close()

    run_virtual(main())


def test_an_ended_trainer_shows_the_step_its_done_said() -> None:
    """A run's last update is stamped past the trainer's last step (it covers the
    steps its residual held): the row shows the step DONE said, not the stamp."""
    progress = TrainingProgress()
    progress.trainer_attached("resnet", OURS, "me")
    for step in (29, 30, 46):  # 46: the last update's stamp
        progress.observe("peer", 1, step, step / 10, run_id=OURS)
    assert progress.rows("me", 5.0)["peer"]["step"] == 46
    progress.ended("peer", OURS, "done", 30)
    assert progress.rows("me", 5.0)["peer"]["step"] == 30
    progress.observe("peer", 2, 1, 6.0, run_id=OURS)  # a new session counts afresh
    assert progress.rows("me", 6.0)["peer"]["step"] == 1


def test_each_peer_shows_its_own_runs_step_and_an_ended_trainer_no_rate() -> None:
    progress = TrainingProgress()
    progress.trainer_attached("resnet", OURS, "me")
    for i in range(5):  # two steps a second
        progress.observe("me", 1, 10 + i, i / 2, run_id=OURS)
        progress.observe("peer", 1, 10 + i, i / 2, run_id=OURS)
        progress.observe("other", 1, 900 + i, i / 2, run_id=THEIRS)
        progress.observe("ended", 1, 10 + i, i / 2, run_id=OURS)
        progress.observe("away", 1, 10 + i, i / 2, run_id=OURS)
    progress.observe("peer", 7, 5000, 2.0, run_id=THEIRS)  # a chunk of another run
    progress.ended("ended", OURS, "done")
    progress.report({"loss": 0.5})
    assert set(progress.rows("me", 2.0)) == {"me", "peer", "ended", "away"}  # our run only
    assert progress.rows("me", 2.0)["peer"]["step"] == 14

    runs = progress.runs_status("me", 2.0)
    assert [(r["run_id"], r["name"], r["own"]) for r in runs] == [
        (OURS.hex(), "resnet", True),
        (THEIRS.hex(), "", False),
    ]
    rows = trainers_by_peer(runs, live={"me", "peer", "other", "ended"})
    assert rows["me"]["run"] == "resnet" and rows["me"]["loss"] == 0.5
    assert rows["me"]["state"] == "live" and rows["me"]["steps_per_s"] == pytest.approx(2.0)
    assert rows["peer"]["step"] == 14 and rows["peer"]["run"] == "resnet"  # not 5000
    assert rows["other"]["step"] == 904 and rows["other"]["run"] == THEIRS.hex()
    assert rows["other"]["loss"] is None  # only our own trainer's loss reaches us
    assert rows["ended"]["state"] == "done" and rows["ended"]["steps_per_s"] is None
    assert rows["away"]["state"] == "left" and rows["away"]["steps_per_s"] is None

    progress.observe("ended", 2, 1, 3.0, run_id=OURS)  # a new session: live again
    assert progress.rows("me", 3.0)["ended"]["state"] == "live"


@pytest.mark.network
async def test_status_without_the_token_is_refused_with_where_to_find_it(tmp_path: Path) -> None:
    page = (Path(__file__).parents[2] / "ciuic_p2p" / "daemon" / "status.html").read_text()
    # The page tells a refusal from an endpoint that is gone.
    assert "response.status === 401 || response.status === 403" in page
    assert '"needs the token"' in page and "`ciuic-node status`" in page
    config = Config.lan()
    config = dataclasses.replace(config, node=dataclasses.replace(config.node, listen_port=0))
    ca = ClusterCA.create("page", NOW)
    key = NodeKey.generate()
    daemon = bare_daemon(
        config, key, ca.issue(key.public_key, NOW), Trust(ca.certificate), state_dir=tmp_path
    )
    await daemon.start()
    web = WebServer(daemon, WebSection(port=0))
    port = await web.start()
    try:
        async with aiohttp.ClientSession() as session:
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                url = f"http://127.0.0.1:{port}/api/status"
                async with session.get(url, headers=headers) as response:
                    assert response.status == 401
                    assert "web.token" in await response.text()
    finally:
        await web.close()
        await daemon.close()


def test_the_url_printed_at_start_carries_the_token_in_a_terminal_only() -> None:
    path = Path("/run/ciuic/web.token")
    text, fields = page_announcement("http://127.0.0.1:7947/", "s3cret", path)
    assert "http://127.0.0.1:7947/#token=s3cret" in text and str(path) in text
    # The JSON event goes to journald and log shippers: the URL, and where the token is.
    assert not any("s3cret" in v for v in fields.values())
    assert fields["url"] == "http://127.0.0.1:7947/" and fields["token_file"] == str(path)
    assert "ciuic-node status" in fields["hint"]


@pytest.mark.parametrize(
    ("host", "name"),
    [
        ("tokyo-1", "tokyo-1"),
        ("gpu-7.example.net", "gpu-7.example.net"),
        ("", "node"),
        ("münchen-1", "mnchen-1"),
        ("x" * 100, "x" * 64),
    ],
)
def test_a_nodes_name_defaults_to_its_host_name_kept_valid(
    monkeypatch: pytest.MonkeyPatch, host: str, name: str
) -> None:
    monkeypatch.setattr("socket.gethostname", lambda: host)
    assert NodeSection().name == name
    config = Config.wan()
    assert config.node.name == name
    validate(config)  # a default that the name rules refuse would stop every start
