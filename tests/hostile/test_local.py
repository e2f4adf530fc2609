"""Local users and the remaining edges (finding 11 of the hardening issue): the HTTP
endpoint, checkpoints, CREDIT frames, and refusals that vary their source port."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import json
import socket
import stat
import struct
from pathlib import Path

import aiohttp
import pytest

from ciuic_p2p.config import LogSection, WebSection
from ciuic_p2p.core.link.frames import FrameType, encode_frame
from ciuic_p2p.daemon.auditlog import AuditLog
from ciuic_p2p.daemon.web import WebServer
from ciuic_p2p.identity import NodeKey
from ciuic_p2p.logsetup import configure_logging
from ciuic_p2p.train.checkpoint import write_checkpoint
from ciuic_p2p.transport.quic import CONTROL_STREAM
from tests.hostile.harness import HonestMesh, until
from tests.transport.conftest import FAST, Cluster, NodeFactory
from tests.transport.rawclient import RawClient
from tests.transport.test_hostile import authenticated_raw

pytestmark = pytest.mark.network

ROOT = Path(__file__).resolve().parents[2]


async def get(port: int, path: str, token: str | None = None) -> int:
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{port}{path}", headers=headers) as response,
    ):
        await response.read()
        return response.status


async def test_half_open_requests_are_closed_and_capped(tmp_path: Path) -> None:
    """1,100 half-open requests were kept forever (no header timeout) and took the
    operators' `status` and the trainers' socket with them (no LimitNOFILE)."""
    async with HonestMesh(tmp_path, ["a"]) as mesh:
        await mesh.form()
        settings = WebSection(port=0, header_timeout_s=0.5, max_connections=8)
        web = WebServer(mesh.daemons["a"], settings, token_path=tmp_path / "run" / "web.token")
        port = await web.start()
        conns = []
        try:
            for _ in range(20):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(b"GET /api/status HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # never ends
                conns.append((reader, writer))
            await until(lambda: web.connections_refused >= 12, 5, "past the cap, closed")
            results = await asyncio.gather(
                *(asyncio.wait_for(r.read(), 5) for r, _ in conns), return_exceptions=True
            )
            assert all(res == b"" for res in results), results  # every one closed in time
            assert await get(port, "/api/status", web.token) == 200  # the page still works
        finally:
            for _, w in conns:
                w.close()
            await web.close()
        assert "LimitNOFILE=65536" in (ROOT / "systemd" / "ciuic-node.service").read_text()


async def test_api_status_answers_only_the_holders_of_the_token(tmp_path: Path) -> None:
    """/api/status showed any local user what the 0600 control socket shows."""
    async with HonestMesh(tmp_path, ["a"]) as mesh:
        await mesh.form()
        token_path = tmp_path / "run" / "web.token"
        web = WebServer(mesh.daemons["a"], WebSection(port=0), token_path=token_path)
        port = await web.start()
        try:
            assert await get(port, "/api/status") == 401
            assert await get(port, "/api/status", "not-the-token") == 401
            assert token_path.read_text().strip() == web.token
            assert stat.S_IMODE(token_path.stat().st_mode) == 0o640
            assert await get(port, "/api/status", web.token) == 200
            assert await get(port, "/") == 200  # the page holds no data of its own
        finally:
            await web.close()
        assert not token_path.exists()


def test_checkpoints_are_the_owners_only(tmp_path: Path) -> None:
    """Checkpoints were written 0644."""
    path = tmp_path / "ckpt" / "run.ckpt"
    write_checkpoint(path, 3, b"state" * 100, bytes(32))
    write_checkpoint(path, 4, b"state" * 100, bytes(32))  # the first becomes .prev
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    for p in (path, path.with_name(path.name + ".prev")):
        assert stat.S_IMODE(p.stat().st_mode) == 0o600


async def test_a_credit_frame_past_the_bound_closes_the_link(
    make_node: NodeFactory, cluster: Cluster
) -> None:
    """CREDIT frames of any size were accepted (a peer granting 2^63 bytes)."""
    server = await make_node()
    hostile = await authenticated_raw(server, cluster)
    try:
        await until(server.peers, 5, "the member is admitted")
        hostile.send(CONTROL_STREAM, encode_frame(FrameType.CREDIT, struct.pack("<Q", 1 << 63)))
        assert "CREDIT" in await hostile.wait_closed()
    finally:
        hostile.close()


async def test_refusals_from_many_ports_are_one_line_and_one_entry(
    make_node: NodeFactory, tmp_path: Path
) -> None:
    """Refusal log lines and audit entries could be flooded by varying the source
    port (the limiter keyed by host:port; the audit log wrote one entry each)."""
    out = io.StringIO()
    configure_logging(LogSection(format="json", rate_limit_burst=5), stream=out)
    settings = dataclasses.replace(FAST, handshakes_per_s=1000)
    server = await make_node(settings=settings)
    key = NodeKey.generate()
    audit = AuditLog(
        tmp_path / "audit", key, peer_id=key.peer_id, interval_s=3600, rotate_bytes=1 << 20
    )
    server.on_admission = lambda peer, address, reason: audit.refused(address, reason)
    clients = []
    for _ in range(40):  # each from its own port of 127.0.0.1
        client = await RawClient.connect((server.host, server.port))
        client.send(CONTROL_STREAM, encode_frame(FrameType.AUTH, b"\x01\x00\x00" + bytes(64)))
        clients.append(client)
    await until(lambda: server.refused >= 40, 10, "every one refused")
    for c in clients:
        c.close()
    audit.close()
    lines = [json.loads(x) for x in out.getvalue().splitlines() if x.startswith("{")]
    refused_lines = [x for x in lines if x.get("event") == "peer_refused"]
    assert len(refused_lines) <= 5
    entries = [
        json.loads(x) for x in (tmp_path / "audit" / "audit-000001.jsonl").read_text().splitlines()
    ]
    refusals = [e for e in entries if e["kind"] == "refusals"]
    assert len(refusals) == 1
    data = refusals[0]["data"]
    # 40 refused proofs (and a late datagram of a closed connection now and then).
    assert max(data["reasons"].values()) == 40 and data["total"] >= 40
    assert list(data["networks"]) == ["127.0.0.0/24"]


async def test_answers_left_unread_free_their_connection(tmp_path: Path) -> None:
    """Review: pipelined requests on connections that never read held every slot
    (the header timeout ends with a whole request; the answer then waited forever)."""
    async with HonestMesh(tmp_path, ["a"]) as mesh:
        await mesh.form()
        settings = WebSection(port=0, header_timeout_s=0.5, max_connections=8)
        web = WebServer(mesh.daemons["a"], settings, token_path=tmp_path / "run" / "web.token")
        port = await web.start()
        socks = []
        try:
            for _ in range(8):
                s = socket.socket()
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
                s.connect(("127.0.0.1", port))
                s.setblocking(False)
                with contextlib.suppress(BlockingIOError):
                    s.send(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n" * 200)
                socks.append(s)
            server = web._runner.server if web._runner is not None else None
            assert server is not None
            await until(lambda: not server.connections, 10, "the unread connections go")
            assert await get(port, "/metrics") == 200
        finally:
            for s in socks:
                s.close()
            await web.close()
