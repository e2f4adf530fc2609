"""The daemon's HTTP endpoint (daemon.web, daemon.metrics): Prometheus metrics of a
real 3-node mesh with per-peer labels, the status JSON, the loopback Host check, and
the live page in a real headless Chromium that shows the mesh and a node leaving.

Daemons run in this process (lab.daemons) on the emulated WAN; trainers are
stand-ins that speak the trainer socket's frames and publish tiny dense chunks."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ciuic_p2p import __version__
from ciuic_p2p.admission import ClusterCA, Trust
from ciuic_p2p.config import Config, WebSection
from ciuic_p2p.core.mesh.members import State
from ciuic_p2p.daemon.assembly import bare_daemon
from ciuic_p2p.daemon.metrics import RouteWatch, StepRate, TrainingProgress
from ciuic_p2p.daemon.trainer import TrainerServer
from ciuic_p2p.daemon.web import WebServer
from ciuic_p2p.data import scenario_path
from ciuic_p2p.emulator.scenarios import load_scenario
from ciuic_p2p.identity import NodeKey
from ciuic_p2p.lab.daemons import DaemonMesh
from tests.daemon.fleet import NOW
from tests.daemon.standin import RUN, StandInTrainer

pytestmark = pytest.mark.network

NAMES = ["azure:westeurope", "gcp:us-east1-b", "azure:japaneast"]
WEB = WebSection(port=0, refresh_s=0.2)
TRAFFIC = [
    "peer_sent_bytes",
    "peer_received_bytes",
    "peer_sent_chunks",
    "peer_received_chunks",
    "peer_relayed_chunks",
]
PER_PEER = [
    *TRAFFIC,
    "peer_rtt_seconds",
    "link_rtt_seconds",
    "outbox_frames",
    "outbox_bytes",
    "trainer_step",
    "trainer_steps_per_second",
    "staleness_steps",
]
NODE_WIDE = [
    "bulk_backlog_bytes",
    "membership_events",
    "members",
    "route_changes",
    "chunk_sign_seconds",
    "chunk_verify_seconds",
    "health_score",
    "daemon_events",
    "dissemination_chunks",
    "origins_restarted",
    "strategy_info",
    "strategy_switches",
]


@contextlib.asynccontextmanager
async def running_mesh(config: Config) -> AsyncIterator[DaemonMesh]:
    # 50 Mbit/s links: the shipped 1 Mbit/s would queue what this test is not about.
    scenario = load_scenario(scenario_path("multicloud8"), rate_scale=0.05)
    async with DaemonMesh(scenario, NAMES, config) as mesh:
        await mesh.form()
        yield mesh


def trainer_of(mesh: DaemonMesh, name: str) -> TrainerServer:
    server = mesh.nodes[name].trainers
    assert server is not None
    return server


async def scrape(
    port: int, path: str, host: str | None = None, token: str | None = None
) -> tuple[int, str]:
    headers = {"Host": host} if host else {}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{port}{path}", headers=headers) as response,
    ):
        return response.status, await response.text()


async def test_metrics_of_a_running_mesh_carry_every_family_with_per_peer_labels() -> None:
    # Gossip dissemination: each node forwards others' chunks, so relaying is counted.
    config = Config.wan()
    config = dataclasses.replace(
        config, mesh=dataclasses.replace(config.mesh, dissemination="gossip")
    )
    async with running_mesh(config) as mesh:
        daemons = [mesh.daemons[n] for n in NAMES]
        servers = [trainer_of(mesh, n) for n in NAMES]
        trainers = [StandInTrainer(s) for s in servers[:2]]
        web = WebServer(daemons[0], WEB, trainer=servers[0])
        port = await web.start()
        try:
            for t in trainers:
                await t.attach()
            a, others = daemons[0], {d.peer_id for d in daemons[1:]}
            ids = [d.peer_id for d in daemons]

            def steps_seen() -> dict[str, int | None]:
                return {o: r.step for o, r in servers[0].progress.origins.items()}

            def settled() -> bool:
                """Both steps 5 seen at the scraped node, chunks relayed, every RTT known,
                and a probe answered by it (every RTT can be known from its own probes
                and others' published links before anyone has probed it: CI once)."""
                return (
                    steps_seen() == {ids[0]: 5, ids[1]: 5}
                    and sum(t.chunks_relayed for t in a.traffic.values()) > 0
                    and all(a.mesh.rttmap.rtt_s(x, y) for x in ids for y in ids if x < y)
                    and a.mesh_bytes_sent["ACK"] > 0
                )

            for step in range(1, 6):
                for t in trainers:
                    t.publish(step)
                await mesh.until(lambda s=step: steps_seen().get(ids[1]) == s, 15)
            await mesh.until(settled, 15)
            trainers[0].report(
                {
                    "step": 5,
                    "encode_s": 1.5,
                    "decode_s": 0.25,
                    "hook_s": 2.0,
                    "clipped": 7,
                    "weight_raised": 3,
                    # One origin set aside; two entries a trainer should not send.
                    "set_aside": {ids[1]: 1005, "x" * 100: 9, "y": -1},
                }
            )
            await mesh.until(lambda: "encode_s" in servers[0].progress.trainer, 15)
            assert servers[0].progress.set_aside == {ids[1]: 1005}

            status, text = await scrape(port, "/metrics")
            assert status == 200
            families = {f.name: f for f in text_string_to_metric_families(text)}
            for name in PER_PEER + NODE_WIDE:
                assert "ciuic_" + name in families, name
            for name in [*TRAFFIC, "peer_rtt_seconds"]:
                peers = {s.labels["peer"] for s in families["ciuic_" + name].samples}
                assert peers == others, name
            sent = {s.labels["peer"]: s.value for s in families["ciuic_peer_sent_chunks"].samples}
            assert all(v > 0 for v in sent.values())
            relayed = [s.value for s in families["ciuic_peer_relayed_chunks"].samples]
            assert sum(relayed) > 0
            kinds = {s.labels["kind"]: s.value for s in families["ciuic_mesh_sent_bytes"].samples}
            assert kinds["CHUNK"] > 0 and kinds["PING"] > 0 and kinds["ACK"] > 0
            assert kinds == a.mesh_bytes_sent or all(  # counted between scrape and now
                a.mesh_bytes_sent[k] >= v for k, v in kinds.items()
            )
            trained = {s.labels["peer"]: s.value for s in families["ciuic_trainer_step"].samples}
            assert trained == {a.peer_id: 5, daemons[1].peer_id: 5}
            assert {
                s.labels["peer"] for s in families["ciuic_trainer_steps_per_second"].samples
            } == {
                a.peer_id,
                daemons[1].peer_id,
            }
            for name, value in (("encode", 1.5), ("decode", 0.25), ("hook", 2.0)):
                (sample,) = families[f"ciuic_trainer_{name}_seconds"].samples
                assert sample.value == value
            assert not families["ciuic_trainer_wait_seconds"].samples  # not reported
            (clipped,) = families["ciuic_trainer_chunks_clipped"].samples
            assert clipped.value == 7
            (raised,) = families["ciuic_trainer_chunks_weight_raised"].samples
            assert raised.value == 3
            (aside,) = families["ciuic_trainer_origins_set_aside"].samples
            assert aside.value == 1
            signed = {s.name: s.value for s in families["ciuic_chunk_sign_seconds"].samples}
            assert signed["ciuic_chunk_sign_seconds_count"] == 5
            assert families["ciuic_chunk_sign_seconds"].type == "histogram"
            buckets = [
                s
                for s in families["ciuic_chunk_sign_seconds"].samples
                if s.name.endswith("_bucket")
            ]
            assert buckets[-1].labels["le"] == "+Inf" and buckets[-1].value == 5
            assert all(s.labels["run"] == RUN for s in buckets)  # the trainer's run
            assert families["ciuic_trainer_encode_seconds"].samples[0].labels["run"] == RUN
            (build,) = families["ciuic_build_info"].samples
            assert build.labels["version"] == __version__ and build.labels["quic"]
            assert families["ciuic_start_time_seconds"].samples[0].value > 1.7e9
            for name in ("process_cpu_seconds", "process_resident_memory_bytes", "python_info"):
                assert name in families, name
            named = {s.labels["peer"] for s in families["ciuic_peer_info"].samples}
            assert named == others
            chunks = {s.labels["event"] for s in families["ciuic_dissemination_chunks"].samples}
            assert chunks == {"duplicate", "repaired", "lost", "stale", "unknown_origin"}
            alive = {s.labels["state"]: s.value for s in families["ciuic_members"].samples}
            assert alive["alive"] == 2
            events = {
                s.labels["state"]: s.value for s in families["ciuic_membership_events"].samples
            }
            assert events["alive"] >= 2

            status, body = await scrape(port, "/api/status", token=web.token)
            page_data = json.loads(body)
            assert status == 200
            assert {m["peer"] for m in page_data["members"]} == others
            assert len(page_data["links"]) == 3  # every pair of a 3-node mesh
            assert set(page_data["traffic"]) == others
            assert page_data["training"][daemons[1].peer_id]["step"] == 5
            assert page_data["training"][daemons[1].peer_id]["set_aside_until"] == 1005
            assert page_data["training"][a.peer_id]["set_aside_until"] is None
            # A member that left has no per-peer series any more.
            gone = daemons[2]
            await gone.leave()
            del mesh.daemons[NAMES[2]], mesh.nodes[NAMES[2]]
            await mesh.until(lambda: a.mesh.state_of(gone.peer_id) is State.LEFT, 15)
            _, text = await scrape(port, "/metrics")
            after = {f.name: f for f in text_string_to_metric_families(text)}
            for name in [*TRAFFIC, "peer_rtt_seconds", "peer_info"]:
                peers = {s.labels["peer"] for s in after["ciuic_" + name].samples}
                assert gone.peer_id not in peers, name
        finally:
            await web.close()
            for t in trainers:
                await t.close()


async def test_endpoint_on_loopback_refuses_requests_for_another_host_name(tmp_path: Path) -> None:
    config = Config.lan()
    config = dataclasses.replace(config, node=dataclasses.replace(config.node, listen_port=0))
    ca = ClusterCA.create("web", NOW)
    key = NodeKey.generate()
    daemon = bare_daemon(
        config, key, ca.issue(key.public_key, NOW), Trust(ca.certificate), state_dir=tmp_path
    )
    await daemon.start()
    web = WebServer(daemon, WEB)
    port = await web.start()
    try:
        # DNS rebinding: a page of evil.example resolved to 127.0.0.1 sends its own name.
        assert (await scrape(port, "/api/status", host="evil.example", token=web.token))[0] == 403
        assert (await scrape(port, "/metrics", host=f"evil.example:{port}"))[0] == 403
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}"):
            assert (await scrape(port, "/api/status", host=host, token=web.token))[0] == 200
        status, page = await scrape(port, "/")
        assert status == 200 and 'id="mesh"' in page
    finally:
        await web.close()
        await daemon.close()


def test_step_rate_follows_a_session_and_decays_when_it_stops() -> None:
    rate = StepRate()
    for i in range(11):
        rate.observe(incarnation=1, step=10 * i, now_s=float(i))
    rate.observe(incarnation=1, step=50, now_s=10.5)  # a late chunk of an old step
    assert rate.step == 100
    assert rate.per_s(10.0) == pytest.approx(10.0)
    assert rate.per_s(20.0) == pytest.approx(5.0)  # nothing new for 10 s
    assert rate.per_s(100.0) == 0.0  # nothing in the window at all
    rate.observe(incarnation=2, step=1, now_s=101.0)  # a restarted trainer counts from 1
    assert rate.step == 1 and rate.per_s(102.0) is None


def test_route_watch_counts_moved_added_and_removed_routes() -> None:
    watch = RouteWatch()
    watch.sample({"b": ("a", "b"), "c": ("a", "c")})
    watch.sample({"b": ("a", "c", "b"), "c": ("a", "c")})
    watch.sample({"b": ("a", "c", "b")})
    assert dict(watch.changes) == {"added": 2, "changed": 1, "removed": 1}


# -- the page in a real browser --------------------------------------------------------------


def chromium_or_skip() -> str:
    """Debian's Chromium (the test set-up installs it); skipped where it is missing,
    except on CI, where a missing browser is a broken set-up."""
    path = os.environ.get("CIUIC_CHROMIUM") or shutil.which("chromium")
    reason = ""
    if path is None:
        reason = "no chromium on PATH (Debian: apt-get install chromium; or set CIUIC_CHROMIUM)"
    else:
        try:
            import playwright.async_api  # noqa: F401, PLC0415
        except ImportError:
            reason = "playwright is not installed (pip install -e '.[dev]')"
    if reason:
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    assert path is not None
    return path


def artifact_path(name: str) -> Path:
    root = os.environ.get("CIUIC_TEST_ARTIFACTS")
    folder = Path(root) if root else Path(__file__).resolve().parents[1] / "artifacts"
    folder.mkdir(parents=True, exist_ok=True)
    return folder / name


async def keep_stepping(trainers: list[StandInTrainer], interval_s: float = 0.1) -> None:
    """Every trainer in the list publishes its next step, at a trainer's pace."""
    step = 0
    while True:
        step += 1
        for t in trainers:
            t.publish(step)
        await asyncio.sleep(interval_s)


async def cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


@pytest.mark.browser
@pytest.mark.timeout(120)
async def test_status_page_in_a_browser_shows_the_mesh_and_a_node_that_leaves() -> None:
    chromium = chromium_or_skip()
    from playwright.async_api import ConsoleMessage, async_playwright  # noqa: PLC0415

    errors: list[str] = []

    def on_console(message: ConsoleMessage) -> None:
        if message.type == "error":  # a script refused by the CSP, a failed request
            errors.append(message.text)

    shot = artifact_path("status-page.png")
    shot.unlink(missing_ok=True)
    async with running_mesh(Config.wan()) as mesh, contextlib.AsyncExitStack() as stack:
        trainers = {n: StandInTrainer(trainer_of(mesh, n)) for n in NAMES}
        for t in trainers.values():
            stack.push_async_callback(t.close)
            await t.attach()
        stepping = list(trainers.values())
        task = asyncio.get_running_loop().create_task(keep_stepping(stepping))
        stack.push_async_callback(cancel, task)
        web = WebServer(mesh.daemons[NAMES[0]], WEB, trainer=trainers[NAMES[0]].server)
        port = await web.start()
        stack.push_async_callback(web.close)
        playwright = await stack.enter_async_context(async_playwright())
        browser = await playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        stack.push_async_callback(browser.close)
        page = await browser.new_page(viewport={"width": 1700, "height": 720})
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.on("console", on_console)

        await page.goto(f"http://127.0.0.1:{port}/#token={web.token}")
        await page.wait_for_function(
            """() => {
                const nodes = [...document.querySelectorAll('g.node[data-state="alive"]')];
                return nodes.length === 3 && nodes.every(g => Number(g.dataset.step) >= 3)
                    && document.querySelectorAll('g.link').length === 3;
            }""",
            timeout=30_000,
        )
        assert await page.locator("#member-rows tr").count() == 3
        # The stand-in trainers' rounds went by the strategy auto chose, its predictions
        # shown beside how long the rounds took to gather here.
        await page.wait_for_function(
            """() => {
                const t = document.getElementById('strategy').textContent;
                return t.includes('(auto) [tree ') && t.includes('; measured ');
            }""",
            timeout=30_000,
        )

        leaving = trainers[NAMES[2]]  # as `ciuic-node leave` does: trainer first, then the mesh
        stepping.remove(leaving)
        await leaving.close()
        leaver = mesh.daemons.pop(NAMES[2])
        await leaver.leave()
        gone = ["left", "dead", "gone"]
        await page.wait_for_function(
            f"states => states.includes(document.getElementById('node-{leaver.peer_id}')"
            "?.dataset.state)",
            arg=gone,
            timeout=30_000,
        )
        assert await page.locator(f"#row-{leaver.peer_id}").get_attribute("data-state") in gone
        assert await page.locator('g.node[data-state="alive"]').count() == 2
        await page.screenshot(path=str(shot), full_page=True)
    assert not errors, errors
    data = shot.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 1000


def test_a_trainers_reported_loss_is_range_checked_and_shown_on_its_own_row() -> None:
    """The trainer's report is a member's local process's word: only a finite number
    is taken as its loss (a string, a bool, inf or NaN leave the last one)."""
    progress = TrainingProgress()
    progress.observe("me", 1, 5, 0.0)
    progress.observe("other", 1, 5, 0.0)
    for bad in ("1.0", True, float("inf"), float("nan"), None):
        progress.report({"loss": bad})
        assert progress.loss is None, bad
    progress.report({"loss": 0.25})
    progress.report({"loss": float("nan")})
    rows = progress.rows("me", 1.0)
    assert rows["me"]["loss"] == 0.25 and rows["other"]["loss"] is None
