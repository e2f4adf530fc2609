"""A bare aioquic client for hostile-peer tests: it completes the QUIC handshake and
then does exactly what the test says (send a given AUTH, open a stream first, send
raw bytes), nothing more."""

from __future__ import annotations

import asyncio
import ssl
import time
from typing import Any

from aioquic.quic import events as qe
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection

from ciuic_p2p.transport.quic import ALPN


class RawClient(asyncio.DatagramProtocol):
    def __init__(self, max_stream_data: int | None = None) -> None:
        conf = QuicConfiguration(is_client=True, alpn_protocols=[ALPN], verify_mode=ssl.CERT_NONE)
        conf.max_datagram_size = 1452
        if max_stream_data is not None:  # how much the server may send per stream
            conf.max_stream_data = max_stream_data
        self.quic = QuicConnection(configuration=conf)
        self.udp: asyncio.DatagramTransport | None = None
        self.handshake = asyncio.get_running_loop().create_future()
        self.terminated = asyncio.get_running_loop().create_future()
        self.received: dict[int, bytes] = {}
        self.timer: asyncio.TimerHandle | None = None

    @classmethod
    async def connect(
        cls,
        addr: tuple[str, int],
        local_host: str = "127.0.0.1",
        timeout_s: float = 5.0,
        max_stream_data: int | None = None,
    ) -> RawClient:
        """Complete a QUIC handshake (following a Retry, as any QUIC stack does) from
        ``local_host`` (any address of 127.0.0.0/8 on Linux's loopback)."""
        loop = asyncio.get_running_loop()
        client = cls(max_stream_data)
        await loop.create_datagram_endpoint(lambda: client, local_addr=(local_host, 0))
        client.quic.connect(addr, now=time.monotonic())
        client.flush()
        try:
            await asyncio.wait_for(asyncio.shield(client.handshake), timeout_s)
        except TimeoutError:
            client.close()
            raise
        return client

    def connection_made(self, transport: Any) -> None:
        self.udp = transport

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self.quic.receive_datagram(data, (addr[0], addr[1]), now=time.monotonic())
        self.flush()

    def flush(self) -> None:
        while (event := self.quic.next_event()) is not None:
            if isinstance(event, qe.HandshakeCompleted) and not self.handshake.done():
                self.handshake.set_result(True)
            elif isinstance(event, qe.StreamDataReceived):
                self.received[event.stream_id] = (
                    self.received.get(event.stream_id, b"") + event.data
                )
            elif isinstance(event, qe.ConnectionTerminated) and not self.terminated.done():
                self.terminated.set_result(event.reason_phrase)
        assert self.udp is not None
        for data, addr in self.quic.datagrams_to_send(now=time.monotonic()):
            self.udp.sendto(data, addr)
        if self.timer:
            self.timer.cancel()
        at = self.quic.get_timer()
        if at is not None:
            self.timer = asyncio.get_running_loop().call_at(at, self.on_timer)

    def on_timer(self) -> None:
        self.quic.handle_timer(now=time.monotonic())
        self.flush()

    def server_cid(self) -> bytes:
        return self.quic._peer_cid.cid

    def send(self, stream_id: int, data: bytes) -> None:
        self.quic.send_stream_data(stream_id, data)
        self.flush()

    async def wait_closed(self, timeout: float = 5.0) -> str:
        return await asyncio.wait_for(asyncio.shield(self.terminated), timeout)

    def close(self) -> None:
        if self.timer:
            self.timer.cancel()
        if self.udp is not None:
            self.udp.close()
