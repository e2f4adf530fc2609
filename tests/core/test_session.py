"""The link session (core.link.session) on its own: two sessions wired back to back
on virtual time, no transport, no event loop."""

from __future__ import annotations

import dataclasses
import datetime as dt

import pytest
from cryptography.hazmat.primitives import serialization
from hypothesis import given, settings
from hypothesis import strategies as st

from ciuic_p2p.admission import ClusterCA, Trust
from ciuic_p2p.config import TransportSection
from ciuic_p2p.core.link.auth import build_auth
from ciuic_p2p.core.link.frames import (
    BULK_TYPES,
    FRAME_HEADER,
    MAX_BULK_FRAME,
    MAX_PAYLOAD,
    FrameType,
    encode_frame,
)
from ciuic_p2p.core.link.session import (
    PING,
    Authenticated,
    Closed,
    CreditGranted,
    FrameArrived,
    Lane,
    LinkClaim,
    LinkSession,
    LocalIdentity,
    SessionEvent,
    SessionStateError,
    keep_new_link,
)
from ciuic_p2p.identity import NodeKey

UTC = dt.datetime(2026, 12, 1, tzinfo=dt.UTC)
CA = ClusterCA.create("alpha", UTC - dt.timedelta(days=1))
TRUST = Trust(CA.certificate)
SETTINGS = TransportSection(receive_window_bytes=2 * MAX_BULK_FRAME, ping_interval_s=1.0)
SERVER_CID, ODCID = b"server-1", b"client-1"
BIGGEST = max(BULK_TYPES, key=MAX_PAYLOAD.__getitem__)
"""The bulk type whose largest frame is MAX_BULK_FRAME (a window holds two)."""


def identity(ca: ClusterCA = CA) -> tuple[NodeKey, LocalIdentity]:
    key = NodeKey.generate()
    cert = ca.issue(key.public_key, UTC - dt.timedelta(days=1))
    return key, LocalIdentity(key, cert.public_bytes(serialization.Encoding.DER))


def session(dialed: bool, me: LocalIdentity, now: float = 0.0, **changes: object) -> LinkSession:
    s = dataclasses.replace(SETTINGS, **changes)  # type: ignore[arg-type]
    return LinkSession(dialed=dialed, identity=me, trust=TRUST, settings=s, now=now)


def events(s: LinkSession) -> list[SessionEvent]:
    out = []
    while (e := s.next_event()) is not None:
        out.append(e)
    return out


def pump(a: LinkSession, b: LinkSession, now: float = 0.0) -> None:
    """Hand each side's bytes to the other until both are quiet."""
    for _ in range(20):
        moved = False
        for src, dst in ((a, b), (b, a)):
            for lane, data in src.data_to_send():
                dst.receive(lane, data, now, UTC)
                moved = True
        if not moved:
            return
    raise AssertionError("the sessions never went quiet")


def linked(now: float = 0.0) -> tuple[LinkSession, LinkSession, NodeKey, NodeKey]:
    client_key, client_id = identity()
    server_key, server_id = identity()
    client, server = session(True, client_id, now), session(False, server_id, now)
    server.bind_server(SERVER_CID, ODCID)
    client.server_hello(_cert_of(server_key), SERVER_CID, ODCID, UTC)
    pump(client, server, now)
    return client, server, client_key, server_key


def _cert_of(key: NodeKey):  # type: ignore[no-untyped-def]
    return CA.issue(key.public_key, UTC - dt.timedelta(days=1))


def test_both_sides_authenticate_and_grant_their_windows() -> None:
    client, server, client_key, server_key = linked()
    (c_auth, c_credit) = events(client)
    (s_auth, s_credit) = events(server)
    assert isinstance(c_auth, Authenticated) and c_auth.peer == server_key.public_key
    assert isinstance(s_auth, Authenticated) and s_auth.peer == client_key.public_key
    assert isinstance(c_credit, CreditGranted)
    assert c_credit.available == SETTINGS.receive_window_bytes
    assert isinstance(s_credit, CreditGranted)
    assert client.authenticated and server.authenticated
    assert client.peer_window == server.peer_window == SETTINGS.receive_window_bytes


def test_the_accepting_side_says_nothing_until_the_proof_checks() -> None:
    _, server_id = identity()
    server = session(False, server_id)
    server.bind_server(SERVER_CID, ODCID)
    key, me = identity()
    proof = build_auth(key, me.certificate_der, "alpha", b"x" * 32, SERVER_CID, ODCID)  # wrong
    server.receive(Lane.CONTROL, encode_frame(FrameType.AUTH, proof), 0.0, UTC)
    (closed,) = events(server)
    assert isinstance(closed, Closed) and not closed.authenticated and not closed.by_peer
    assert "does not verify" in closed.reason and closed.lane is Lane.CONTROL
    assert server.data_to_send() == [] and server.closed


@pytest.mark.parametrize(
    ("lane", "data", "reason"),
    [
        (Lane.CONTROL, encode_frame(FrameType.GOSSIP, b"hi"), "before authentication"),
        (Lane.CONTROL, encode_frame(FrameType.PING, b"x" * 16), "before authentication"),
        (Lane.BULK, encode_frame(FrameType.CHUNK, b"c"), "bulk bytes before authentication"),
        (Lane.CONTROL, b"\xff\x00\x00\x00\x00", "unknown frame type"),
        (Lane.CONTROL, FRAME_HEADER.pack(FrameType.AUTH, 1 << 20), "exceeds its limit"),
    ],
)
def test_anything_but_a_proof_first_ends_the_session_silently(
    lane: Lane, data: bytes, reason: str
) -> None:
    _, server_id = identity()
    server = session(False, server_id)
    server.bind_server(SERVER_CID, ODCID)
    server.receive(lane, data, 0.0, UTC)
    (closed,) = events(server)
    assert isinstance(closed, Closed) and reason in closed.reason and not closed.authenticated
    assert server.data_to_send() == []


def test_a_member_of_another_cluster_is_refused_by_either_side() -> None:
    other = ClusterCA.create("beta", UTC - dt.timedelta(days=1))
    _, client_id = identity()
    client = session(True, client_id)
    stranger = NodeKey.generate()
    client.server_hello(other.issue(stranger.public_key, UTC), SERVER_CID, ODCID, UTC)
    (closed,) = events(client)
    assert isinstance(closed, Closed) and "not by this cluster's CA" in closed.reason
    assert client.data_to_send() == []  # no proof to a server we do not trust


def test_an_accepted_link_not_authenticated_in_time_ends() -> None:
    _, server_id = identity()
    server = session(False, server_id, now=10.0)
    server.bind_server(SERVER_CID, ODCID)
    assert server.get_timer() == 10.0 + SETTINGS.auth_timeout_s
    server.handle_timer(10.0 + SETTINGS.auth_timeout_s - 0.001)
    assert not server.closed
    server.handle_timer(10.0 + SETTINGS.auth_timeout_s)
    (closed,) = events(server)
    assert isinstance(closed, Closed) and "not authenticated in time" in closed.reason


def test_bulk_frames_spend_credit_that_consumption_returns() -> None:
    client, server, _, _ = linked()
    events(client), events(server)
    payload = b"c" * MAX_PAYLOAD[BIGGEST]
    assert client.send(BIGGEST, payload) and client.send(BIGGEST, payload)
    assert not client.send(BIGGEST, payload)  # the window is spent
    assert client.send(FrameType.GOSSIP, b"g")  # control spends none
    pump(client, server)
    arrived = [e for e in events(server) if isinstance(e, FrameArrived)]
    assert [e.type for e in arrived] == [BIGGEST, BIGGEST, FrameType.GOSSIP]
    for e in arrived:
        server.consumed(e.type, len(e.payload))
    pump(client, server)
    granted = events(client)  # one grant per half window consumed
    assert granted and all(isinstance(g, CreditGranted) for g in granted)
    assert client.credit_out.available == SETTINGS.receive_window_bytes
    assert client.send(BIGGEST, payload)


def test_a_peer_that_sends_beyond_its_credit_is_dropped_with_a_close() -> None:
    client, server, _, _ = linked()
    events(server)
    payload = b"c" * MAX_PAYLOAD[BIGGEST]
    for _ in range(3):  # a sender that ignores its credit: raw frames
        server.receive(Lane.BULK, encode_frame(BIGGEST, payload), 0.0, UTC)
    closed = [e for e in events(server) if isinstance(e, Closed)]
    assert closed and "credit" in closed[0].reason and closed[0].authenticated
    assert closed[0].lane is Lane.BULK
    pump(client, server)
    (peer_closed,) = [e for e in events(client) if isinstance(e, Closed)]
    assert peer_closed.by_peer and "credit" in peer_closed.reason


def test_credit_beyond_the_outstanding_bound_breaks_the_rules() -> None:
    client, _server, _, _ = linked()
    events(client)
    raw = encode_frame(FrameType.CREDIT, (SETTINGS.max_credit_bytes).to_bytes(8, "little"))
    client.receive(Lane.CONTROL, raw, 0.0, UTC)
    (closed,) = events(client)
    assert isinstance(closed, Closed) and "outstanding credit would pass" in closed.reason


def test_frames_on_the_wrong_lane_break_the_rules() -> None:
    _client, server, _, _ = linked()
    events(server)
    server.receive(Lane.CONTROL, encode_frame(FrameType.CHUNK, b"c"), 0.0, UTC)
    (closed,) = events(server)
    assert isinstance(closed, Closed) and "CHUNK on the control lane" in closed.reason


def test_pings_measure_the_round_trip_on_virtual_time() -> None:
    client, server, _, _ = linked(now=5.0)
    assert client.get_timer() == 5.0  # the first sample at once
    client.handle_timer(5.0)
    ((lane, ping),) = [x for x in client.data_to_send() if x[1][0] == FrameType.PING]
    server.receive(lane, ping, 5.04, UTC)
    for lane, data in server.data_to_send():
        client.receive(lane, data, 5.08, UTC)
    assert client.rtt.samples == 1 and client.rtt.min_s == pytest.approx(0.08)
    assert client.get_timer() == 5.0 + SETTINGS.ping_interval_s
    assert PING.size == 16


def test_close_sends_a_reason_the_peer_reports() -> None:
    client, server, _, _ = linked()
    events(client), events(server)
    client.close("bye")
    assert client.closed and client.next_event() is None
    pump(client, server)
    (closed,) = events(server)
    assert isinstance(closed, Closed) and closed.by_peer and closed.reason == "peer closed: bye"
    with pytest.raises(SessionStateError):
        client.send(FrameType.GOSSIP, b"late")


def test_a_quiet_close_and_a_stranger_close_send_nothing() -> None:
    client, _server, _, _ = linked()
    client.close("duplicate link", quiet=True)
    assert client.data_to_send() == []
    _, server_id = identity()
    pending = session(False, server_id)
    pending.close("node shutting down")
    assert pending.data_to_send() == []


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(list(Lane)), st.binary(max_size=300)), max_size=8))
def test_no_bytes_make_a_session_raise(chunks: list[tuple[Lane, bytes]]) -> None:
    """What a peer sends ends in events, never an exception, before or after auth."""
    _, server_id = identity_cached()
    fresh = session(False, server_id)
    fresh.bind_server(SERVER_CID, ODCID)
    _client, server, _, _ = linked_cached()
    for lane, data in chunks:
        fresh.receive(lane, data, 0.0, UTC)
        server.receive(lane, data, 0.0, UTC)
    for s in (fresh, server):
        for e in events(s):
            assert isinstance(e, Authenticated | FrameArrived | CreditGranted | Closed)


_IDENTITY = identity()


def identity_cached() -> tuple[NodeKey, LocalIdentity]:
    return _IDENTITY


def linked_cached() -> tuple[LinkSession, LinkSession, NodeKey, NodeKey]:
    client, server, ck, sk = linked()
    events(client), events(server)
    return client, server, ck, sk


def test_one_link_per_peer_both_ends_agree() -> None:
    small, big = b"\x01" * 32, b"\x02" * 32
    # Seen from the small key: its own dial (dialed=True) beats the peer's.
    ours, theirs = LinkClaim(dialed=True, established_at=1.0), LinkClaim(False, 1.0)
    assert keep_new_link(small, big, ours, theirs, 2.0)
    assert not keep_new_link(small, big, theirs, ours, 2.0)
    # Seen from the big key, the same two links: the small key's dial stays too.
    assert keep_new_link(big, small, LinkClaim(False, 1.0), LinkClaim(True, 1.0), 2.0)
    # A link older than the bound is a restarted peer's previous life: replaced.
    assert keep_new_link(small, big, theirs, LinkClaim(True, -5.0), 2.0)


def _ping_round(client: LinkSession, server: LinkSession, at: float, rtt_s: float) -> None:
    client.handle_timer(at)
    for lane, data in client.data_to_send():  # the PING, and any CREDIT queued before it
        server.receive(lane, data, at + rtt_s / 2, UTC)
    for lane, data in server.data_to_send():
        client.receive(lane, data, at + rtt_s, UTC)


def test_the_receive_window_grows_to_the_path_and_no_further() -> None:
    """Twice the smallest RTT times ``path_rate_bps``, within the bound; the peer is
    granted the difference and may send that much more. A round trip made long by
    queueing widens nothing."""
    client, server, _, _ = linked(now=5.0)
    events(client), events(server)
    base = SETTINGS.receive_window_bytes
    _ping_round(client, server, 5.0, 0.02)  # 2 x 20 ms x 125 MB/s = 5 MB
    want = int(2 * 0.02 * SETTINGS.path_rate_bps / 8)
    assert abs(client.quota.window - want) <= 1 and want > base
    pump(client, server, 5.1)
    granted = [e for e in events(server) if isinstance(e, CreditGranted)]
    assert granted and granted[-1].available == client.quota.window
    # Queueing: a slow round trip after a fast one does not widen the window.
    _ping_round(client, server, 5.5, 0.4)
    assert abs(client.quota.window - want) <= 1
    # A long path (a fresh link whose every round trip is long): bounded.
    client, server, _, _ = linked(now=5.0)
    at = 6.0
    for _ in range(30):
        _ping_round(client, server, at, 0.5)
        at += SETTINGS.ping_interval_s
    assert client.quota.window == SETTINGS.receive_window_max_bytes
    pump(client, server, at)
    assert server.credit_out.available == SETTINGS.receive_window_max_bytes


def test_a_forged_pong_is_no_rtt_sample_and_grows_nothing() -> None:
    client, _server, _, _ = linked(now=5.0)
    window = client.quota.window
    for sent_at in (-1e9, 1e9):  # a peer echoing a time we never sent
        forged = encode_frame(FrameType.PONG, PING.pack(1, sent_at))
        client.receive(Lane.CONTROL, forged, 6.0, UTC)
    assert client.rtt.samples == 0 and client.quota.window == window


def test_the_bulk_lane_measures_the_pace_of_the_peers_frames() -> None:
    """A session paces each large bulk frame as its bytes arrive (core.link.throughput):
    cut into datagram-sized pieces at 8 Mbit/s on virtual time, with idle time between
    frames, the receiver's estimate is that rate; control frames are not measured."""
    client, server, _, _ = linked()
    events(client), events(server)
    now = 10.0
    for _ in range(3):
        assert client.send(BIGGEST, b"p" * (MAX_PAYLOAD[BIGGEST] // 4))
        assert client.send(FrameType.GOSSIP, b"g" * 60_000)
        for lane, data in client.data_to_send():
            for at in range(0, len(data), 1200):
                piece = data[at : at + 1200]
                now += len(piece) * 8 / 8e6
                server.receive(lane, piece, now, UTC)
        for e in events(server):
            if isinstance(e, FrameArrived):
                server.consumed(e.type, len(e.payload))
        pump(client, server, now)
        events(client)
        now += 5.0  # idle
    assert server.receive_rate.samples_taken == 3
    rate = server.receive_rate.rate_bps
    assert rate is not None and abs(rate - 8e6) / 8e6 < 0.01
    assert client.receive_rate.rate_bps is None  # it received nothing large
