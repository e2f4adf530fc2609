"""The LANES frame and the pure choices about lanes (core.link.lanes)."""

from __future__ import annotations

import random

import pytest

from ciuic_p2p.core.link.frames import MAX_PAYLOAD, FrameType
from ciuic_p2p.core.link.lanes import (
    MAX_LANES,
    LanesError,
    decode_lane_ports,
    dials_lanes,
    encode_lane_ports,
    pick_lane,
)


def test_ports_round_trip_within_the_frame_limit() -> None:
    for ports in ((1,), (7300, 7301), tuple(range(60000, 60000 + MAX_LANES))):
        payload = encode_lane_ports(ports)
        assert decode_lane_ports(payload) == ports
        assert len(payload) <= MAX_PAYLOAD[FrameType.LANES]


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\x01",
        b"\x02\x01\x1c\x84",  # a version this node does not read
        b"\x01\x00",  # no lanes
        b"\x01\x11" + b"\x1c\x84" * 17,  # more than MAX_LANES
        b"\x01\x02\x1c\x84",  # fewer ports than announced
        b"\x01\x01\x1c\x84\x00",  # trailing bytes
        b"\x01\x01\x00\x00",  # port 0
    ],
)
def test_every_malformed_announcement_is_a_typed_error(payload: bytes) -> None:
    with pytest.raises(LanesError):
        decode_lane_ports(payload)


def test_random_bytes_decode_or_fail_typed() -> None:
    rng = random.Random(7)
    good = encode_lane_ports((7300, 7301, 7302))
    for _ in range(20_000):
        if rng.random() < 0.5:
            data = bytes(rng.randrange(256) for _ in range(rng.randrange(40)))
        else:
            buf = bytearray(good)
            buf[rng.randrange(len(buf))] = rng.randrange(256)
            data = bytes(buf[: rng.randrange(len(buf) + 1)])
        try:
            ports = decode_lane_ports(data)
        except LanesError:
            continue
        assert 1 <= len(ports) <= MAX_LANES and all(0 < p < 65536 for p in ports)


def test_encoding_refuses_what_it_could_not_say() -> None:
    for ports in ((), (0,), (65536,), tuple(range(1, MAX_LANES + 2))):
        with pytest.raises(ValueError):
            encode_lane_ports(ports)


def test_exactly_one_side_of_a_link_dials_its_lanes() -> None:
    a, b = bytes(32), b"\x01" * 32
    assert dials_lanes(a, b) != dials_lanes(b, a)


def test_a_burst_goes_to_the_least_loaded_lane_that_is_up() -> None:
    assert pick_lane([5, 0, 3], [0, 2]) == 2
    assert pick_lane([0, 0, 0], [1, 2]) == 1
    with pytest.raises(ValueError):
        pick_lane([0], [])
