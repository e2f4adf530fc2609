"""The shared store's state machines (core.store.fetch) and wire format (core.store.messages),
on virtual time: every message goes through the wire codec."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ciuic_p2p.config import StoreSection
from ciuic_p2p.core.store import messages as storewire
from ciuic_p2p.core.store.fetch import Fetch, FetchState
from ciuic_p2p.core.store.holder import Holder
from ciuic_p2p.core.store.messages import (
    Get,
    Manifest,
    NoneHeld,
    Offer,
    Piece,
    Query,
    Ref,
    StoreKind,
    StoreWireError,
    decode,
    encode,
)

S = StoreSection(piece_bytes=4096, window_pieces=4, query_timeout_s=1.0, piece_timeout_s=2.0)


class Net:
    """Holders answering one fetch, with one-way latency per peer (virtual time)."""

    def __init__(self, holders: dict[str, Holder], latency_s: dict[str, float]) -> None:
        self.holders = holders
        self.latency_s = latency_s
        self.now = 0.0
        self.dead: set[str] = set()
        self.corrupt_next: dict[str, int] = {}
        self.events: list[tuple[float, int, str, object]] = []
        self.seq = 0
        self.kill_after_pieces: tuple[str, int] | None = None
        self.served: dict[str, int] = {}
        self.answer_delay_s: dict[str, float] = {}
        """Extra time a holder takes to answer a query (its trainer snapshots first)."""
        self.in_flight = 0
        self.max_in_flight = 0
        """Pieces asked for and not yet received (the most at any time)."""

    def send(self, fetch: Fetch) -> None:
        for peer, sent in fetch.take_messages():
            msg = decode(encode(sent))  # every message crosses the wire codec
            if peer in self.dead:
                continue
            h = self.holders[peer]
            replies: list[object]
            if isinstance(msg, Query):
                replies = [h.on_query(msg, self.now)]
            elif isinstance(msg, Get):
                self.in_flight += len(msg.indices)
                self.max_in_flight = max(self.max_in_flight, self.in_flight)
                got = h.on_get("fetcher", msg, self.now)
                replies = list(got) if isinstance(got, list) else [got]
            else:
                raise AssertionError(msg)
            for i, r in enumerate(replies):
                wire = decode(encode(r))  # type: ignore[arg-type]
                if isinstance(wire, Piece) and self.corrupt_next.get(peer, 0) > 0:
                    self.corrupt_next[peer] -= 1
                    data = bytearray(wire.data)
                    data[0] ^= 0xFF
                    wire = dataclasses.replace(wire, data=bytes(data))
                at = self.now + 2 * self.latency_s[peer] + 0.001 * i
                if isinstance(msg, Query):
                    at += self.answer_delay_s.get(peer, 0.0)
                self.seq += 1
                self.events.append((at, self.seq, peer, wire))

    def run(self, fetch: Fetch, limit_s: float = 300.0) -> None:
        self.send(fetch)
        for _ in range(100_000):  # bounded: a fetch that stops progressing fails here
            if fetch.done or self.now >= limit_s:
                return
            self.events.sort(key=lambda e: (e[0], e[1]))
            timer = fetch.get_timer()
            if self.events and (timer is None or self.events[0][0] <= timer):
                at, _, peer, msg = self.events.pop(0)
                self.now = max(self.now, at)
                if peer in self.dead:
                    continue
                if isinstance(msg, Offer):
                    fetch.on_offer(peer, msg, self.now)
                elif isinstance(msg, NoneHeld):
                    fetch.on_none(peer, msg, self.now)
                elif isinstance(msg, Piece):
                    self.in_flight -= 1
                    self.served[peer] = self.served.get(peer, 0) + 1
                    fetch.on_piece(peer, msg, self.now)
                    kill = self.kill_after_pieces
                    if kill and kill[0] == peer and self.served[peer] >= kill[1]:
                        self.dead.add(peer)
                elif isinstance(msg, Ref) and msg.kind is StoreKind.BUSY:
                    fetch.on_busy(peer, self.now)
                elif isinstance(msg, Ref) and msg.kind is StoreKind.GONE:
                    fetch.on_gone(peer, self.now)
            else:
                assert timer is not None
                self.now = max(self.now, timer)
                fetch.handle_timer(self.now)
            self.send(fetch)
        raise AssertionError("the fetch loops without progress")


def make(peers: dict[str, float], data: dict[str, bytes], version: dict[str, int] | None = None,
         compat: bytes | None = None, slots: int = 1) -> tuple[Net, dict[str, Holder]]:  # fmt: skip
    holders = {}
    for p in peers:
        h = Holder(dataclasses.replace(S, upload_slots=slots))
        if p in data:
            h.put("obj", (version or {}).get(p, 5), data[p], compat)
        holders[p] = h
    return Net(holders, peers), holders


def fetch_for(net: Net, **kw: object) -> Fetch:
    args: dict[str, object] = {"settings": S, "rtt_s": lambda p: 2 * net.latency_s[p]}
    args.update(kw)
    min_version = int(args.pop("min_version", 0))  # type: ignore[call-overload]
    return Fetch("obj", min_version, list(net.holders), 0.0, **args)  # type: ignore[arg-type]


def test_fetches_from_the_nearest_and_stripes_over_exact_copies() -> None:
    data = os.urandom(40_000)
    net, _ = make({"a": 0.05, "b": 0.01, "c": 0.02, "d": 0.03}, {"a": data, "b": data, "c": data})
    f = fetch_for(net)
    net.run(f)
    assert f.state is FetchState.DONE and bytes(f.result or b"") == data
    # Every holder of the same content served; the nearest was chosen first.
    assert set(f.stats.pieces_by_donor) == {"a", "b", "c"}
    assert f.stats.pieces_by_donor["b"] >= f.stats.pieces_by_donor["a"]


@pytest.mark.parametrize("cap_pieces", [1, 3, 6, 100])
def test_pieces_in_flight_stay_under_the_cap_shared_over_the_donors(cap_pieces: int) -> None:
    """Whatever is in flight lands in the fetcher's receive buffer when its loop falls
    behind: at most ``max_inflight_bytes`` of pieces, an equal share per donor (at
    least one each), never more than ``window_pieces`` per donor."""
    data = os.urandom(200_000)
    net, _ = make({"a": 0.05, "b": 0.01, "c": 0.02}, {"a": data, "b": data, "c": data})
    f = fetch_for(net, settings=dataclasses.replace(S, max_inflight_bytes=cap_pieces * 4096))
    net.run(f)
    assert f.state is FetchState.DONE and bytes(f.result or b"") == data
    assert set(f.stats.pieces_by_donor) == {"a", "b", "c"}  # still striped
    share = -(-cap_pieces // 3)
    assert net.max_in_flight <= 3 * min(S.window_pieces, share)
    assert net.max_in_flight == 3 * min(S.window_pieces, share)  # and the cap is used


def test_a_corrupted_piece_is_detected_and_fetched_again() -> None:
    data = os.urandom(20_000)
    net, _ = make({"a": 0.01, "b": 0.02}, {"a": data})
    net.corrupt_next["a"] = 2
    f = fetch_for(net)
    net.run(f)
    assert f.state is FetchState.DONE and bytes(f.result or b"") == data
    assert f.stats.corrupt == 2


def test_a_donor_that_keeps_sending_bad_pieces_is_dropped_for_another() -> None:
    data = os.urandom(20_000)
    net, _ = make({"a": 0.01, "b": 0.02}, {"a": data, "b": data})
    net.corrupt_next["a"] = 10**6
    f = fetch_for(net, settings=dataclasses.replace(S, max_donors=1))
    net.run(f)
    assert f.state is FetchState.DONE and bytes(f.result or b"") == data
    assert f.stats.corrupt == S.max_corrupt_per_donor
    assert f.stats.pieces_by_donor["b"] == 5 and "a" not in f.stats.pieces_by_donor


def test_a_donor_killed_mid_transfer_is_replaced_without_starting_over() -> None:
    """Two replicas' states (different bytes, same layout: same compat): the joiner
    keeps what it verified from the first and takes the rest from the second."""
    layout = b"L" * 32
    a, b = os.urandom(64_000), os.urandom(64_000)
    net, _ = make({"a": 0.01, "b": 0.03}, {"a": a, "b": b}, compat=layout)
    net.kill_after_pieces = ("a", 6)
    f = fetch_for(net)
    net.run(f)
    assert f.state is FetchState.DONE
    assert f.stats.pieces_by_donor["a"] == 6 and f.stats.pieces_by_donor["b"] == 16 - 6
    assert f.stats.restarts == 0 and f.stats.donor_timeouts == 1
    got = bytes(f.result or b"")
    for i in range(16):
        span = slice(i * 4096, (i + 1) * 4096)
        assert got[span] in (a[span], b[span])
    assert sum(got[i * 4096 : (i + 1) * 4096] == a[i * 4096 : (i + 1) * 4096]
               for i in range(16)) == 6  # fmt: skip
    # A content that is not compatible is never mixed in: it starts over instead.
    net2, _ = make({"a": 0.01, "b": 0.03}, {"a": a, "b": b})
    net2.kill_after_pieces = ("a", 6)
    f2 = fetch_for(net2)
    net2.run(f2)
    assert f2.state is FetchState.DONE and bytes(f2.result or b"") == b
    assert f2.stats.restarts == 1


def test_mesh_death_notice_replaces_the_donor_at_once() -> None:
    data = os.urandom(64_000)
    net, _ = make({"a": 0.01, "b": 0.03}, {"a": data, "b": data})
    f = fetch_for(net, settings=dataclasses.replace(S, max_donors=1))
    net.send(f)
    net.run(f, limit_s=0.05)  # the offers and a few pieces
    assert f.donors == ["a"]
    net.dead.add("a")
    f.peer_gone("a", net.now)
    assert f.donors == ["b"]
    net.run(f)
    assert f.state is FetchState.DONE and bytes(f.result or b"") == data
    assert f.stats.donor_timeouts == 0


def test_two_fetchers_at_once_spread_over_two_donors() -> None:
    data = os.urandom(64_000)
    net, holders = make({"a": 0.01, "b": 0.02, "c": 0.04}, {"a": data, "b": data, "c": data})
    s1 = dataclasses.replace(S, max_donors=1)
    f1 = fetch_for(net, settings=s1)
    net.send(f1)
    net.run(f1, limit_s=0.1)  # f1 holds a's upload slot
    assert f1.donors == ["a"]
    # The second fetcher runs against the same holders (named differently).
    f2 = Fetch("obj", 0, list(holders), net.now, settings=s1, rtt_s=lambda p: 0.01, token=7)
    for peer, msg in f2.take_messages():
        assert isinstance(msg, Query)
        f2.on_offer(peer, holders[peer].on_query(msg, net.now), net.now)  # type: ignore[arg-type]
    # Offers carry load: a is busy, so the second goes to the next best.
    assert f2.donors == ["b"]


def test_busy_donor_is_left_for_the_next_and_retried() -> None:
    data = os.urandom(20_000)
    net, holders = make({"a": 0.01, "b": 0.02}, {"a": data, "b": data})
    held = holders["a"].newest("obj")
    assert held is not None  # another fetcher takes a's only upload slot
    holders["a"].on_get("someone", Get("obj", 5, held.root, (0,)), 0.0)
    f = fetch_for(net, settings=dataclasses.replace(S, max_donors=1))
    net.run(f)
    assert f.state is FetchState.DONE and f.stats.pieces_by_donor["b"] == 5


def test_newest_version_is_taken_and_min_version_respected() -> None:
    old, new = os.urandom(9000), os.urandom(9000)
    net, _ = make({"a": 0.01, "b": 0.05}, {"a": old, "b": new}, version={"a": 3, "b": 9})
    f = fetch_for(net)
    net.run(f)
    assert bytes(f.result or b"") == new and f.version == 9
    # With slack, the nearer holder of a slightly older version is good enough.
    net, _ = make({"a": 0.01, "b": 0.05}, {"a": old, "b": new}, version={"a": 8, "b": 9},
                  compat=b"x" * 32)  # fmt: skip
    f = fetch_for(net, version_slack=2)
    net.run(f)
    assert bytes(f.result or b"") == old and f.version == 8
    net, _ = make({"a": 0.01}, {"a": old}, version={"a": 3})
    f = fetch_for(net, min_version=4, settings=dataclasses.replace(S, fetch_timeout_s=5.0))
    net.run(f)
    assert f.state is FetchState.FAILED and "fetch timeout" in f.error


def test_nobody_holds_it_fails_after_the_deadline_and_retries_until_then() -> None:
    net, _ = make({"a": 0.01, "b": 0.01}, {})
    f = fetch_for(net, settings=dataclasses.replace(S, fetch_timeout_s=3.0))
    net.run(f)
    assert f.state is FetchState.FAILED
    assert f.stats.queries >= 3


def test_holder_keeps_an_old_version_while_an_upload_reads_it() -> None:
    h = Holder(S)
    m1 = h.put("x", 1, os.urandom(10_000))
    got = h.on_get("p", Get("x", 1, m1.root, (0,)), 0.0)
    assert isinstance(got, list) and len(got) == 1
    h.put("x", 2, os.urandom(10_000))
    assert h.find("x", 1, m1.root) is not None  # p still reads version 1
    assert isinstance(h.on_get("q", Get("x", 1, m1.root, (1,)), 0.1), Ref)  # one slot
    h.finished("p")
    # A version that was just offered stays a while for the fetcher that asked.
    offer = h.on_query(Query("x", 0, 1), 5.0)
    assert isinstance(offer, Offer) and offer.manifest.version == 2
    h.put("x", 3, os.urandom(10_000), now=6.0)
    assert [v.manifest.version for v in h.objects["x"]] == [3, 2]
    h.put("x", 4, os.urandom(10_000), now=60.0)
    assert [v.manifest.version for v in h.objects["x"]] == [4]
    h.put("x", 3, os.urandom(10_000))
    assert h.find("x", 1, m1.root) is None
    assert [v.manifest.version for v in h.objects["x"]] == [4]
    assert h.load(100.0) == 0


# -- wire format ----------------------------------------------------------------------------


def test_every_message_round_trips() -> None:
    m = Manifest.build("run/state", 7, os.urandom(10_000), 4096)
    messages: list[storewire.Message] = [
        Query("n", 3, 9),
        NoneHeld("n", 9),
        Offer(9, 2, m),
        Get("n", 3, m.root, (0, 5, 7)),
        Piece("n", 3, m.root, 2, b"abc"),
        Ref(StoreKind.HOLD, "n", 3, m.root),
    ]
    for msg in messages:
        back = decode(encode(msg))
        if isinstance(msg, Piece):
            assert isinstance(back, Piece) and bytes(back.data) == b"abc"
        else:
            assert back == msg


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600))
def test_garbage_gets_a_typed_error(data: bytes) -> None:
    with contextlib.suppress(StoreWireError):
        decode(data)


def test_mutated_messages_get_a_typed_error_or_decode() -> None:
    rng = random.Random(3)
    m = Manifest.build("n", 1, os.urandom(9000), 4096)
    samples = [encode(x) for x in (Offer(1, 0, m), Get("n", 1, m.root, (1, 2)), Query("n", 1, 2))]
    for _ in range(3000):
        raw = bytearray(rng.choice(samples))
        for _ in range(rng.randint(1, 4)):
            op = rng.random()
            pos = rng.randrange(len(raw))
            if op < 0.5:
                raw[pos] = rng.randrange(256)
            elif op < 0.8:
                del raw[pos:]
                if not raw:
                    raw = bytearray(b"C")
            else:
                raw[pos:pos] = os.urandom(rng.randint(1, 8))
        with contextlib.suppress(StoreWireError):
            decode(bytes(raw))


def test_limits_are_enforced() -> None:
    with pytest.raises(StoreWireError):
        decode(b"CS\x01" + bytes([StoreKind.PIECE]) + b"\x01n" + bytes(8 + 32 + 4) + bytes(2 << 20))
    with pytest.raises(ValueError):
        Manifest("n", 1, 10, 4096, b"x" * 32, ())
    with pytest.raises(ValueError):
        encode(Get("n", 1, b"r" * 32, tuple(range(storewire.MAX_GET_PIECES + 1))))


def test_a_replica_state_is_striped_over_compatible_donors() -> None:
    """Replicas' states differ in their bytes but share a layout (compat): a fetch
    takes pieces from several at once, each checked against its own donor's digest."""
    states = {p: os.urandom(64_000) for p in "abc"}
    net, _ = make({"a": 0.01, "b": 0.02, "c": 0.03}, states, compat=b"L" * 32)
    f = fetch_for(net)
    net.run(f)
    assert f.state is FetchState.DONE and set(f.stats.pieces_by_donor) == {"a", "b", "c"}
    got = bytes(f.result or b"")
    for i in range(16):
        span = slice(i * 4096, (i + 1) * 4096)
        assert got[span] in {s[span] for s in states.values()}


def test_a_donor_that_answers_after_the_query_round_joins_the_stripe_at_once() -> None:
    """Donors answer a state query once their trainer has taken a fresh snapshot, which
    can outlast the query round: the fetch starts with those that answered, and a late
    donor takes a share as soon as its offer arrives."""
    states = {p: os.urandom(2_000_000) for p in "abc"}  # 489 pieces of 4 KiB
    net, _ = make({"a": 0.01, "b": 0.02, "c": 0.015}, states, compat=b"L" * 32)
    net.answer_delay_s["c"] = 1.5  # past the 1 s query timeout
    f = fetch_for(net, settings=dataclasses.replace(S, piece_timeout_s=30.0))
    net.run(f)
    assert f.state is FetchState.DONE
    assert set(f.stats.pieces_by_donor) == {"a", "b", "c"}
    # Without the late donor it would have taken a and b about 2.8 s.
    assert net.now < 2.5
    # The query round ended at its timeout (c had not answered): pieces went out then.
    assert f.stats.first_donor_s == pytest.approx(S.query_timeout_s)


def test_a_version_the_donor_dropped_is_asked_for_again_not_waited_on() -> None:
    """A donor replaced the snapshot it offered (its trainer took a newer one): it
    answers GONE, and the fetcher asks again and keeps what it verified."""
    layout = b"L" * 32
    old, new = os.urandom(64_000), os.urandom(64_000)
    net, holders = make({"a": 0.01}, {"a": old}, compat=layout)
    f = fetch_for(net, settings=dataclasses.replace(S, max_donors=1))
    net.run(f, limit_s=0.05)  # offered, a few pieces in
    got_before = f.received_pieces
    assert 0 < got_before < 16
    h = holders["a"]
    h.objects["obj"] = []  # the offered version is gone; a newer one is held
    h.put("obj", 6, new, layout)
    net.run(f)
    assert f.state is FetchState.DONE and f.stats.gone == 1 and f.stats.restarts == 0
    assert f.stats.pieces_by_donor["a"] == 16


def _signed_holders(states: dict[str, bytes], latency_s: dict[str, float]) -> Net:
    """Holders that sign what they write, each a writer of its own."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import (  # noqa: PLC0415
        Ed25519PrivateKey,
    )
    from cryptography.hazmat.primitives.serialization import (  # noqa: PLC0415
        Encoding,
        PublicFormat,
    )

    holders = {}
    for p, data in states.items():
        key = Ed25519PrivateKey.generate()
        public = key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        holders[p] = Holder(S, public, key.sign)
        holders[p].put("obj", 5, data, b"L" * 32)
    return Net(holders, latency_s)


def test_spans_fetch_only_the_pieces_that_cover_them() -> None:
    """A sample (issue 44, point 3): the bytes at a few spans, from the pieces that
    cover them, each verified; not the object."""
    data = os.urandom(200_000)  # 49 pieces of 4 KiB
    net, _ = make({"a": 0.01, "b": 0.02}, {"a": data, "b": data})
    spans = ((0, 10), (4090, 20), (150_000, 8192), (199_990, 10))
    f = fetch_for(net, spans=spans)
    net.run(f)
    assert f.state is FetchState.DONE
    assert f.result == b"".join(data[at : at + n] for at, n in spans)
    # Pieces 0, 1 (the span across the boundary), 36-38, 48: six, not 49.
    assert sum(f.stats.pieces_by_donor.values()) == 6
    # A span past the end fails, typed; bounds are checked before anything is sent.
    g = fetch_for(net, spans=((199_995, 10),))
    net.run(g)
    assert g.state is FetchState.FAILED and "shorter" in g.error
    with pytest.raises(ValueError):
        fetch_for(net, spans=((0, 0),))
    with pytest.raises(ValueError):
        fetch_for(net, spans=((-1, 10),))


def test_one_writer_fetch_takes_no_piece_of_another_writers_state() -> None:
    """Striping mixes replicas' compatible states piece by piece: a member's forged
    state, laid out like the run's, would land in an honest joiner's state. With
    ``one_writer`` every piece is of the first donor's writer."""
    states = {p: os.urandom(64_000) for p in "abc"}
    mixed = fetch_for(net := _signed_holders(states, {"a": 0.01, "b": 0.02, "c": 0.03}))
    net.run(mixed)
    assert mixed.state is FetchState.DONE and len(set(mixed.writers_used.values())) == 3
    one = fetch_for(net := _signed_holders(states, {"a": 0.01, "b": 0.02, "c": 0.03}),
                    one_writer=True)  # fmt: skip
    net.run(one)
    assert one.state is FetchState.DONE and set(one.stats.pieces_by_donor) == {"a"}
    assert one.result == states["a"]
