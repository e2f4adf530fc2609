"""UDP GSO: how a transmit's datagrams are grouped, and that a group sent in one call
arrives as the same datagrams, in order (loopback)."""

from __future__ import annotations

import asyncio
import errno
import os
import socket
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ciuic_p2p.transport.gso import (
    MAX_BATCH_BYTES,
    MAX_SEGMENTS,
    SegmentedSender,
    batches,
    gso_supported,
)

sizes = st.lists(st.sampled_from([1452, 1452, 1452, 1200, 700, 41]), max_size=200)


@given(sizes)
def test_batches_keep_every_datagram_in_order_within_the_kernels_limits(lengths: list[int]) -> None:
    datagrams = [bytes([i % 251]) * n for i, n in enumerate(lengths)]
    out = batches(datagrams)
    assert [d for b in out for d in b.datagrams] == datagrams
    for b in out:
        assert 1 <= len(b.datagrams) <= MAX_SEGMENTS
        assert sum(map(len, b.datagrams)) <= MAX_BATCH_BYTES
        assert all(len(d) == b.segment for d in b.datagrams[:-1])
        assert len(b.datagrams[-1]) <= b.segment


def test_a_full_transmit_becomes_few_batches() -> None:
    out = batches([b"x" * 1452] * 100 + [b"y" * 300])
    assert [len(b.datagrams) for b in out] == [44, 44, 13]


@pytest.fixture
def pair() -> Any:
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx.bind(("127.0.0.1", 0))
    rx.settimeout(5)
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    tx.bind(("127.0.0.1", 0))
    yield tx, rx
    tx.close()
    rx.close()


def test_grouped_datagrams_arrive_as_sent(pair: Any) -> None:
    tx, rx = pair
    fallback: list[bytes] = []
    sender = SegmentedSender(tx.fileno(), lambda d, a: fallback.append(d), lambda: 0)
    datagrams = [bytes([i]) * 1452 for i in range(50)] + [b"end" * 10]
    sender.send(datagrams, rx.getsockname())
    for d in fallback:  # whatever did not go in groups goes by plain sendto
        tx.sendto(d, rx.getsockname())
    received = [rx.recv(65536) for _ in datagrams]
    assert received == datagrams
    if gso_supported():  # Linux 4.18 or later: loopback takes GSO
        assert sender.active and sender.sends == 2 and sender.datagrams == 51, fallback
        assert not fallback
    sender.close()


def test_datagrams_go_by_the_loop_while_it_holds_queued_ones(pair: Any) -> None:
    tx, rx = pair
    fallback: list[bytes] = []
    sender = SegmentedSender(tx.fileno(), lambda d, a: fallback.append(d), lambda: 1)
    datagrams = [b"q" * 1452] * 5
    sender.send(datagrams, rx.getsockname())
    assert fallback == datagrams and sender.sends == 0
    sender.close()


class _Refusing:
    """A socket whose sendmsg fails with one errno (the kernel's answers)."""

    def __init__(self, code: int) -> None:
        self.code = code

    def sendmsg(self, *args: Any) -> int:
        raise OSError(self.code, os.strerror(self.code))

    def close(self) -> None:
        pass


@pytest.mark.parametrize(("code", "stays_on"), [(errno.EIO, False), (errno.ENOBUFS, True)])
def test_a_refused_group_goes_one_by_one_and_only_incapacity_turns_gso_off(
    pair: Any, code: int, stays_on: bool
) -> None:
    tx, rx = pair
    fallback: list[bytes] = []
    sender = SegmentedSender(tx.fileno(), lambda d, a: fallback.append(d), lambda: 0)
    real = sender._sock
    sender._sock = _Refusing(code)  # type: ignore[assignment]
    datagrams = [b"r" * 1452] * 3
    sender.send(datagrams, rx.getsockname())
    assert fallback == datagrams and sender.active == stays_on
    if real is not None:
        real.close()


@pytest.mark.network
async def test_a_bulk_send_between_nodes_goes_in_groups(make_node: Any) -> None:
    from ciuic_p2p.core.link.frames import FrameType  # noqa: PLC0415
    from ciuic_p2p.transport.base import FrameReceived  # noqa: PLC0415

    a, b = await make_node(), await make_node()
    peer = await a.connect((b.host, b.port))
    payload = bytes(range(256)) * 4096  # 1 MiB
    for _ in range(3):
        await a.send(peer, FrameType.CHUNK, payload)
    got = 0
    while got < 3:
        event = await asyncio.wait_for(b.next_event(), 10)
        if isinstance(event, FrameReceived) and event.type is FrameType.CHUNK:
            assert event.payload == payload
            got += 1
    if gso_supported():
        assert a.segmented_datagrams > 0.5 * a.udp_bytes_sent / 1452
