"""The status page as an operator keeps it open: at 2, 4 and 8 nodes on a 1280x800
screen, in a real headless Chromium, with the runs and their trainers (live, ended,
another run's), step, loss and rate, the reason behind a degraded health, edge labels
that do not overlap and the table in view. Screenshots go to docs/guides/img/, where
docs/guides/service.md shows them.

The nodes are assembled as ``ciuic-node run`` assembles them, on the in-memory
transport (tests/daemon/memorymesh.py) and the real clock (the browser's polls are
real); stand-in trainers publish chunks the daemons receive as from a real trainer."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from ciuic_p2p.config import Config, WebSection
from ciuic_p2p.core.replica.messages import encode_done, run_id_of
from ciuic_p2p.core.replica.trainersocket import TrainerFrame, frame_header
from ciuic_p2p.daemon.trainer import TrainerServer
from ciuic_p2p.daemon.web import WebServer
from tests.daemon.memorymesh import MemoryMesh, until
from tests.daemon.standin import RUN, StandInTrainer
from tests.daemon.test_web import cancel, chromium_or_skip

HOSTS = ["tokyo-1", "frankfurt-1", "virginia-1", "sydney-1", "london-1", "mumbai-1",
         "oregon-1", "saopaulo-1"]  # fmt: skip
OTHER_RUN = "llama-sweep"
OTHER_STEP0 = 5000
"""The other run's trainer counts from here: its steps cannot pass for ours."""
LOSS = 0.4321
WIDTH_PX, HEIGHT_PX = 1280, 800
"""A laptop's screen: all of it in view without scrolling."""
IMG = Path(__file__).resolve().parents[2] / "docs" / "guides" / "img"
WEB = WebSection(port=0, refresh_s=0.25)
STALL_LATENCY_S = 1.5
"""A network stall: every message this late, until probes have failed enough that the
page's node is degraded (for seconds after it), and the page says why."""


class Trainer(StandInTrainer):
    """A stand-in trainer that can also finish its run (DONE, then it detaches)."""

    async def finish(self, step: int) -> None:
        payload = encode_done(run_id_of(self.run), step, step)
        writer = self._writer
        assert writer is not None
        writer.write(frame_header(TrainerFrame.PUBLISH, len(payload)) + payload)
        await writer.drain()
        await self.close()


class Stepping:
    """The trainers publish their next step at a trainer's pace (the other run's from
    ``OTHER_STEP0``) while not ``paused``; one removed from ``trainers`` stops."""

    def __init__(self, trainers: list[Trainer]) -> None:
        self.trainers = trainers
        self.paused = False

    async def run(self, interval_s: float = 0.1) -> None:
        step = 0
        while True:
            if not self.paused:
                step += 1
                for t in self.trainers:
                    t.publish(step + (OTHER_STEP0 if t.run == OTHER_RUN else 0))
            await asyncio.sleep(interval_s)


def seen_step(server: TrainerServer, peer: str) -> int:
    """The newest step of ``peer``'s trainer that ``server``'s node has seen (0: none)."""
    rate = server.progress.origins.get(peer)
    return 0 if rate is None or rate.step is None else rate.step


def server_of(mesh: MemoryMesh, name: str) -> TrainerServer:
    server = mesh.nodes[name].trainers
    assert server is not None
    return server


@contextlib.asynccontextmanager
async def page_mesh(root: Path, n: int) -> AsyncIterator[tuple[MemoryMesh, WebServer, Stepping]]:
    """``n`` nodes stepping (the last of 4 or more finished its run; at 8 one trains
    another run), the first's page served, and its trainer's loss reported."""
    names = HOSTS[:n]
    mesh = MemoryMesh(root, names, Config.local())
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(mesh.close)
        await mesh.form()
        trainers = {
            name: Trainer(server_of(mesh, name), OTHER_RUN if n == 8 and i == 6 else RUN)
            for i, name in enumerate(names)
        }
        for t in trainers.values():
            await t.attach()
            stack.push_async_callback(t.close)
        stepping = Stepping(list(trainers.values()))
        task = asyncio.get_running_loop().create_task(stepping.run())
        stack.push_async_callback(cancel, task)
        own = server_of(mesh, names[0])
        if n >= 4:
            ender = trainers[names[-1]]
            await until(lambda: seen_step(own, ender.welcome["peer"]) >= 3, 10)
            stepping.trainers.remove(ender)
            await ender.finish(3)
        trainers[names[0]].report({"loss": LOSS})
        await until(lambda: own.progress.loss == LOSS, 10)
        web = WebServer(mesh.daemons[names[0]], WEB, trainer=own)
        await web.start()
        stack.push_async_callback(web.close)
        yield mesh, web, stepping


OVERLAPS_JS = """() => {
    // Every label drawn in the graph, as the browser laid it out: edge labels and
    // node names and their step lines; no two may overlap.
    const boxes = [...document.querySelectorAll('#mesh text')]
        .filter(t => t.dataset.hidden !== 'true' && t.textContent)
        .map(t => ({text: t.textContent, r: t.getBoundingClientRect()}));
    const clash = [];
    for (let i = 0; i < boxes.length; i++) for (let j = i + 1; j < boxes.length; j++) {
        const a = boxes[i].r, b = boxes[j].r;
        if (a.left < b.right - 0.5 && b.left < a.right - 0.5 && a.top < b.bottom - 0.5
            && b.top < a.bottom - 0.5) clash.push([boxes[i].text, boxes[j].text]);
    }
    const recorded = window.edgeLabelBoxes || [];
    for (let i = 0; i < recorded.length; i++) for (let j = i + 1; j < recorded.length; j++) {
        const a = recorded[i], b = recorded[j];
        if (a.x < b.x + b.w && b.x < a.x + a.w && a.y < b.y + b.h && b.y < a.y + a.h)
            clash.push(['recorded', i, j]);
    }
    return {clash, labels: boxes.length,
            edges: document.querySelectorAll('g.link').length,
            hidden: document.querySelectorAll('g.link text[data-hidden="true"]').length};
}"""


@pytest.mark.browser
@pytest.mark.timeout(180)
@pytest.mark.parametrize("n", [2, 4, 8])
async def test_status_page_at_n_nodes_shows_runs_trainers_and_health_on_one_screen(
    tmp_path: Path, n: int
) -> None:
    chromium = chromium_or_skip()
    from playwright.async_api import ConsoleMessage, async_playwright  # noqa: PLC0415

    errors: list[str] = []

    def on_console(message: ConsoleMessage) -> None:
        # The page asked without its token on purpose first: that 401 is expected.
        if message.type == "error" and "401" not in message.text:
            errors.append(message.text)

    shot = IMG / f"status-{n}-nodes.png"
    async with page_mesh(tmp_path, n) as (mesh, web, stepping), contextlib.AsyncExitStack() as s:
        playwright = await s.enter_async_context(async_playwright())
        browser = await playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        s.push_async_callback(browser.close)
        page = await browser.new_page(viewport={"width": WIDTH_PX, "height": HEIGHT_PX})
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.on("console", on_console)
        url = f"http://127.0.0.1:{web.port}/"

        # Without the token the page says that it needs it, not that the daemon is gone.
        await page.goto(url)
        await page.wait_for_function(
            "() => document.getElementById('updated').dataset.why === 'token'", timeout=10_000
        )
        assert await page.locator("#updated").inner_text() == "needs the token"
        assert "needs the token" in await page.locator("#notice").inner_text()

        await page.goto(url + "#token=" + web.token)
        await page.reload()  # a new fragment alone does not load the page again
        names = HOSTS[:n]
        peers = {name: mesh.nodes[name].peer_id for name in names}
        await page.wait_for_function(
            """n => {
                const rows = [...document.querySelectorAll('#member-rows tr')];
                return rows.length === n
                    && rows.every(r => r.dataset.state === 'alive'
                                       && Number(r.querySelector('td.step').textContent) >= 3)
                    && document.querySelectorAll('g.link').length === n * (n - 1) / 2;
            }""",
            arg=n,
            timeout=30_000,
        )

        # A network stall (the trainers wait for it: their chunks would answer for
        # the probes): probes fail; once it is over every member is alive again and the
        # page's node, still degraded (its timeouts stretched), says why.
        stepping.paused = True
        latency_s, mesh.network.latency_s = mesh.network.latency_s, STALL_LATENCY_S
        await until(lambda: mesh.daemons[names[0]].mesh.health_score >= 2, 30)
        mesh.network.latency_s = latency_s
        stepping.paused = False
        await page.wait_for_function(
            """n => {
                const rows = [...document.querySelectorAll('#member-rows tr')];
                return rows.length === n && rows.every(r => r.dataset.state === 'alive')
                    && document.getElementById('health-score').dataset.degraded === 'true'
                    && document.getElementById('health-reasons').textContent.length > 0;
            }""",
            arg=n,
            timeout=30_000,
        )
        # The reason read before and after the screenshot: the screenshot shows it too.
        text = await page.locator("body").inner_text()
        reasons = await page.locator("#health-reasons").inner_text()
        await page.screenshot(path=str(shot))
        assert await page.locator("#health-reasons").inner_text(), "healthy again too soon"

        # The run, its trainers, step, rate and loss.
        assert "degraded" in text and reasons in text
        assert any(cause in reasons for cause in ("probe", "helper", "suspected")), reasons
        assert f"{RUN} (this node's trainer)" in text
        assert f"loss {LOSS:.4f}" in await page.locator("#run-list").inner_text()
        own_row = page.locator(f"#row-{peers[names[0]]}")
        assert await own_row.locator("td.loss").inner_text() == f"{LOSS:.4f}"
        assert await own_row.locator("td.run").inner_text() == RUN
        assert await own_row.locator("td.trainer").inner_text() == "live"
        assert float(await own_row.locator("td.rate").inner_text()) > 0
        if n >= 4:  # the trainer that finished: ended, with no rate
            ended = page.locator(f"#row-{peers[names[-1]]}")
            assert await ended.locator("td.trainer").inner_text() == "done"
            assert await ended.locator("td.rate").inner_text() == ""
            sub = await page.locator(f"#node-{peers[names[-1]]} text.sub").text_content() or ""
            assert sub.endswith("· done") and "/s" not in sub, sub
            assert "1 ended" in text
        if n == 8:  # another run's trainer: its own run's step, never ours
            other = page.locator(f"#row-{peers[names[6]]}")
            assert int(await other.locator("td.step").inner_text()) > OTHER_STEP0
            assert await other.locator("td.run").inner_text() != RUN
            assert await page.locator("#run-list li.run").count() == 2
            for name in names[:6]:
                step = await page.locator(f"#row-{peers[name]} td.step").inner_text()
                assert 3 <= int(step) < OTHER_STEP0, (name, step)

        # The graph's labels do not overlap, and every edge kept its label (once every
        # link is drawn again: the stall may have dropped one for a moment).
        await page.wait_for_function(
            "n => document.querySelectorAll('g.link').length === n * (n - 1) / 2",
            arg=n,
            timeout=30_000,
        )
        laid = await page.evaluate(OVERLAPS_JS)
        assert not laid["clash"], laid
        assert laid["edges"] == n * (n - 1) // 2 and laid["hidden"] == 0, laid

        # On one 1280x800 screen: the table beside the graph, in view, nothing scrolled.
        table = await page.locator("#members").bounding_box()
        graph = await page.locator("#mesh").bounding_box()
        assert table is not None and graph is not None
        assert table["y"] + table["height"] <= HEIGHT_PX, table
        assert graph["y"] + graph["height"] <= HEIGHT_PX, graph
        assert table["x"] >= graph["x"] + graph["width"], (table, graph)
        width = await page.evaluate("() => document.documentElement.scrollWidth")
        assert width <= WIDTH_PX
        wrap = page.locator(".table-wrap")
        widths = await wrap.evaluate("w => [w.scrollWidth, w.clientWidth]")
        assert widths[0] <= widths[1], widths  # every column shown, none scrolled away
    assert not errors, errors
    data = shot.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000
