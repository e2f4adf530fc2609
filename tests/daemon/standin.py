"""A stand-in trainer: the trainer's end of a daemon's trainer socket, enough to
publish update chunks of given steps and to read what the daemon delivers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import struct
from typing import Any

from ciuic_p2p.core.codec.chunk import ChunkHeader, Codec, IndexCode, build_chunk
from ciuic_p2p.core.replica.messages import PayloadKind, decode_payload, envelope
from ciuic_p2p.core.replica.messages import run_id_of as trainwire_run_id
from ciuic_p2p.core.replica.trainersocket import (
    TrainerFrame,
    TrainerFrameReader,
    frame_header,
    json_frame,
    split_peer,
)
from ciuic_p2p.daemon.trainer import TrainerServer

RUN = "web-test"


class StandInTrainer:
    """The trainer's end of the socket, enough to publish chunks of given steps."""

    def __init__(self, server: TrainerServer, run: str = RUN) -> None:
        self.server = server
        self.run = run
        self.delivered: list[tuple[str, PayloadKind, bytes]] = []
        """(origin peer, payload kind, payload) of each DELIVER, in order."""
        self.welcome: dict[str, Any] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._drain: asyncio.Task[None] | None = None
        self._closed = False

    async def attach(self) -> None:
        ours, theirs = socket.socketpair()
        await self.server.serve_socket(theirs)
        reader, self._writer = await asyncio.open_unix_connection(sock=ours)
        self._writer.write(json_frame(TrainerFrame.HELLO, {"run": self.run}))
        length, ftype = struct.unpack("<IB", await reader.readexactly(5))
        assert ftype == TrainerFrame.WELCOME
        self.welcome = json.loads(await reader.readexactly(length - 1))
        self._drain = asyncio.get_running_loop().create_task(self._read_all(reader))

    async def _read_all(self, reader: asyncio.StreamReader) -> None:
        frames = TrainerFrameReader()
        while data := await reader.read(1 << 16):
            for ftype, body in frames.feed(data):
                if ftype is TrainerFrame.DELIVER:
                    peer, payload = split_peer(body)
                    kind = decode_payload(payload).kind
                    self.delivered.append((peer, kind, bytes(payload)))

    def publish(self, step: int) -> None:
        header = ChunkHeader(
            codec=Codec.DENSE_FP32,
            index_code=IndexCode.NONE,
            rice_bits=0,
            block_size=0,
            run_id=trainwire_run_id(self.run),
            origin=bytes.fromhex(self.welcome["public_key"]),
            incarnation=self.welcome["incarnation"],
            step=step,
            layout_id=1,
            bucket=0,
            range_start=0,
            range_len=4,
            count=4,
        )
        payload = envelope(PayloadKind.UPDATE) + build_chunk(header, [bytes(16)])
        assert self._writer is not None
        self._writer.write(frame_header(TrainerFrame.PUBLISH, len(payload)) + payload)

    def report(self, figures: dict[str, object]) -> None:
        """What the hook sends with each stats request (its own timings)."""
        assert self._writer is not None
        self._writer.write(json_frame(TrainerFrame.STATS_REQUEST, figures))

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._drain is not None:
            self._drain.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._drain
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(ConnectionError):
                await self._writer.wait_closed()
        await self.server.close()
