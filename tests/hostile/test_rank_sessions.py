"""A sharded trainer's other ranks on the trainer socket (daemon.rankwriters): each
attaches under the first rank's incarnation and gets every delivery of the run, also
those that came before it attached; a session that claims to be a rank it is not, or
that speaks for the replica, is refused and changes nothing."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from ciuic_p2p.core.mesh.broadcast import Delivery
from ciuic_p2p.core.replica.messages import (
    PayloadKind,
    encode_done,
    encode_presence,
    run_id_of,
)
from ciuic_p2p.core.replica.trainersocket import (
    TrainerFrame,
    TrainerFrameReader,
    frame_header,
    json_frame,
    parse_json,
)
from ciuic_p2p.daemon.trainer import TrainerServer
from tests.hostile.harness import HonestMesh, fast_config, until

pytestmark = pytest.mark.network

RUN = "ranks-test"


class Session:
    """A trainer's end of one connection to the daemon's trainer socket."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.frames = TrainerFrameReader()
        self.got: list[tuple[TrainerFrame, bytes]] = []

    async def next(self, ftype: TrainerFrame) -> bytes:
        """The next frame of that type (others kept in ``got``)."""
        while True:
            for t, body in list(self.got):
                if t is ftype:
                    self.got.remove((t, body))
                    return body
            data = await asyncio.wait_for(self.reader.read(1 << 16), 10)
            if not data:
                raise ConnectionError("closed")
            self.got += [(t, bytes(b)) for t, b in self.frames.feed(data)]

    async def hello(self, **fields: Any) -> dict[str, Any]:
        self.writer.write(json_frame(TrainerFrame.HELLO, {"run": RUN, **fields}))
        return parse_json(memoryview(await self.next(TrainerFrame.WELCOME)))


_OPEN: list[Session] = []


@contextlib.asynccontextmanager
async def daemon(tmp_path: Path) -> AsyncIterator[tuple[HonestMesh, TrainerServer]]:
    mesh = HonestMesh(tmp_path, ["a"], fast_config())
    await mesh.form()
    server = mesh.nodes["a"].trainers
    assert server is not None
    try:
        yield mesh, server
    finally:
        for session in _OPEN:
            session.writer.close()
            with contextlib.suppress(Exception):
                await session.writer.wait_closed()
        _OPEN.clear()
        await server.close()
        await mesh.close()


async def connect(server: TrainerServer) -> Session:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    await server.serve_socket(theirs)
    reader, writer = await asyncio.open_unix_connection(sock=ours)
    _OPEN.append(Session(reader, writer))
    return _OPEN[-1]


def join_of(peer: str) -> Delivery:
    return Delivery(peer, 1, encode_presence(PayloadKind.JOIN, run_id_of(RUN), 5), 0.0, 1)


async def test_a_rank_gets_every_delivery_from_its_first_ranks_hello_on(tmp_path: Path) -> None:
    async with daemon(tmp_path) as (_mesh, server):
        first = await connect(server)
        welcome = await first.hello(ranks=2)
        other = "ciuic" + "b" * 32
        server.deliver(join_of(other))  # before the second rank attached: held for it
        await first.next(TrainerFrame.DELIVER)
        second = await connect(server)
        theirs = await second.hello(rank=1, incarnation=welcome["incarnation"])
        assert theirs["incarnation"] == welcome["incarnation"]
        assert theirs["peer"] == welcome["peer"] and theirs["checkpoint_dir"] is None
        assert other.encode() in await second.next(TrainerFrame.DELIVER)
        server.deliver(join_of(other))  # after: to both
        await first.next(TrainerFrame.DELIVER)
        await second.next(TrainerFrame.DELIVER)


@pytest.mark.parametrize(
    ("ranks", "hello", "sends"),
    [
        (1, {"rank": 1}, None),  # the first rank said it has no others
        (2, {"rank": 2}, None),  # not one of its ranks
        (2, {"rank": 1, "incarnation": -5}, None),  # another incarnation's
        (2, {"rank": "1"}, None),
        (2, {"rank": 1}, PayloadKind.JOIN),  # only the first rank speaks for the replica
        (2, {"rank": 1}, PayloadKind.DONE),
    ],
    ids=["unsharded", "rank-past", "incarnation", "rank-text", "join", "done"],
)
async def test_a_session_claiming_a_rank_it_is_not_is_refused(
    tmp_path: Path, ranks: int, hello: dict[str, Any], sends: PayloadKind | None
) -> None:
    async with daemon(tmp_path) as (mesh, server):
        a = mesh.daemons["a"]
        first = await connect(server)
        welcome = await first.hello(ranks=ranks)
        impostor = await connect(server)
        fields = {"incarnation": welcome["incarnation"], **hello}
        if sends is None:
            refused = await impostor.hello(**fields)
            assert "error" in refused, refused
        else:
            assert "error" not in await impostor.hello(**fields)
            body = (
                encode_done(run_id_of(RUN), 10, 20)
                if sends is PayloadKind.DONE
                else encode_presence(sends, run_id_of(RUN))
            )
            impostor.writer.write(frame_header(TrainerFrame.PUBLISH, len(body)) + body)
        await until(lambda: a.counters["trainer_protocol_errors"] == 1, 10, "refused")
        # The first rank's session goes on, its own deliveries unchanged.
        server.deliver(join_of("ciuic" + "c" * 32))
        await first.next(TrainerFrame.DELIVER)
        assert server._attached()


async def test_a_rank_before_its_first_rank_and_a_second_trainer_are_refused(
    tmp_path: Path,
) -> None:
    async with daemon(tmp_path) as (_mesh, server):
        early = await connect(server)
        assert "error" in await early.hello(rank=1, incarnation=0)
        first = await connect(server)
        assert "error" not in await first.hello()
        second = await connect(server)
        assert "a trainer is attached" in (await second.hello())["error"]
        assert "error" in await (await connect(server)).hello(ranks=2_000_000)


STATE = "state/" + run_id_of(RUN).hex()


@pytest.mark.parametrize(
    ("request_body", "refused"),
    [
        ({"name": "model/weights", "spans": [[0, 16]]}, True),  # not its run's state
        ({"name": STATE}, True),  # the whole state: the first rank's to fetch
        ({"name": STATE, "spans": [[0, 16]] * 5000}, False),  # too many: answered no
        ({"name": STATE, "spans": [["0", 16]]}, False),
        ({"name": STATE, "spans": [[0, 1 << 60]]}, False),  # past any object's size
    ],
    ids=["other-name", "whole", "spans-many", "span-text", "span-huge"],
)
async def test_a_rank_fetches_only_ranges_of_its_runs_state(
    tmp_path: Path, request_body: dict[str, Any], refused: bool
) -> None:
    """Another rank may fetch ranges of its run's state (its rows, train.shardfetch),
    nothing else; spans out of range are answered with an error, and the session and
    its first rank's go on."""
    async with daemon(tmp_path) as (mesh, server):
        a = mesh.daemons["a"]
        first = await connect(server)
        welcome = await first.hello(ranks=2)
        rank = await connect(server)
        assert "error" not in await rank.hello(rank=1, incarnation=welcome["incarnation"])
        rank.writer.write(json_frame(TrainerFrame.GET_REQUEST, {"id": 7, **request_body}))
        if refused:
            await until(lambda: a.counters["trainer_protocol_errors"] == 1, 10, "refused")
        else:
            result = parse_json(memoryview(await rank.next(TrainerFrame.STORE_RESULT)))
            assert result["id"] == 7 and not result["ok"] and "span" in result["error"], result
            assert a.counters["trainer_protocol_errors"] == 0
        server.deliver(join_of("ciuic" + "c" * 32))
        await first.next(TrainerFrame.DELIVER)
        assert server._attached()
