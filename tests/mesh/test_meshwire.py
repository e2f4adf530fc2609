"""Mesh messages: every kind round-trips; no byte sequence does anything but decode or
raise MeshDecodeError; every number is range-checked; signatures cover what they
should and nothing else verifies."""

from __future__ import annotations

import contextlib
import dataclasses
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ciuic_p2p.core.mesh.messages import (
    MAX_ID_BYTES,
    MAX_INCARNATION,
    MAX_PLAN_NODES,
    MAX_RATE_KBPS,
    MAX_ROUTE,
    MIN_PLANNED_PAYLOAD_BYTES,
    Ack,
    Alive,
    Chunk,
    Coordinate,
    Credential,
    Dead,
    Gossip,
    Heads,
    Left,
    LinkEntry,
    Links,
    MeshDecodeError,
    MeshKind,
    Message,
    Nack,
    Ping,
    PingReq,
    Suspect,
    Sync,
    Want,
    decode_message,
    encode_message,
    encode_update,
    signed_bytes,
)
from tests.mesh.signing import identities, signed

ids = st.text(min_size=1, max_size=30)
u64 = st.integers(0, 2**64 - 1)
incarnations = st.integers(0, MAX_INCARNATION)
u32 = st.integers(0, 2**32 - 1)
sigs = st.binary(min_size=64, max_size=64)
coords = st.builds(
    Coordinate,
    st.tuples(*[st.floats(-1e3, 1e3, width=32)] * 8),
    st.floats(0, 1e3, width=32),
    st.floats(0, 1.5, width=32),
)
names = st.text(st.characters(min_codepoint=32, max_codepoint=126), min_size=1, max_size=16)
updates = st.one_of(
    st.builds(Alive, ids, incarnations, ids, ids, sigs),
    st.builds(Alive, ids, incarnations, ids, ids, sigs, names),
    st.builds(Suspect, ids, incarnations, ids),
    st.builds(Dead, ids, incarnations, ids),
    st.builds(Left, ids, incarnations, sigs),
    st.builds(
        Links,
        ids,
        u32,
        st.lists(st.builds(LinkEntry, ids, u32, st.integers(0, 1000)), max_size=5).map(tuple),
        sigs,
    ),
    st.builds(  # RATED_LINKS: any entry with a rate
        Links,
        ids,
        u32,
        st.lists(
            st.builds(LinkEntry, ids, u32, st.integers(0, 1000), st.integers(1, MAX_RATE_KBPS)),
            min_size=1,
            max_size=5,
        ).map(tuple),
        sigs,
    ),
    st.builds(Credential, ids, st.binary(max_size=400)),
)
ups = st.lists(updates, max_size=6).map(tuple)


@st.composite
def planned_chunks(draw: st.DrawFn) -> Chunk:
    """PLANNED_CHUNK: a chunk carrying its origin's tree (each parent earlier)."""
    origin = draw(ids)
    nodes = draw(st.lists(ids.filter(lambda n: n != origin), min_size=1, max_size=6, unique=True))
    plan = tuple((n, draw(st.integers(0, i))) for i, n in enumerate(nodes))
    return Chunk(
        origin,
        draw(u64),
        draw(st.integers(0, 255)),
        bytes(draw(st.integers(MIN_PLANNED_PAYLOAD_BYTES, MIN_PLANNED_PAYLOAD_BYTES + 300))),
        draw(sigs),
        draw(st.integers(0, MAX_ROUTE)),
        plan,
    )


bodies = st.one_of(
    st.builds(Ping, u32, ids, coords, u32, ups),
    st.builds(Ack, u32, coords, u32, ups),
    st.builds(PingReq, u32, ids, ids),
    st.builds(Nack, u32),
    st.builds(Gossip, ups),
    st.builds(Sync, st.booleans(), ups),
    st.builds(Chunk, ids, u64, st.integers(0, 255), st.binary(max_size=300), sigs),
    st.builds(  # ROUTED_CHUNK: a chunk that names its strategy
        Chunk,
        ids,
        u64,
        st.integers(0, 255),
        st.binary(max_size=300),
        sigs,
        st.integers(1, MAX_ROUTE),
    ),
    planned_chunks(),
    st.builds(Heads, st.lists(st.tuples(ids, u64), max_size=5).map(tuple)),
    st.builds(Want, ids, st.lists(u64, max_size=5).map(tuple)),
)


@given(ids, bodies)
def test_every_message_round_trips(sender: str, body: object) -> None:
    msg = Message(sender, body)  # type: ignore[arg-type]
    assert decode_message(encode_message(msg)) == msg


@given(ids, bodies, st.data())
def test_every_truncation_and_extension_is_a_typed_error(
    sender: str, body: object, data: st.DataObject
) -> None:
    raw = encode_message(Message(sender, body))  # type: ignore[arg-type]
    cut = data.draw(st.integers(0, len(raw) - 1))
    with pytest.raises(MeshDecodeError):
        decode_message(raw[:cut])
    with pytest.raises(MeshDecodeError):
        decode_message(raw + b"\x00")


def test_random_bytes_and_mutations_only_raise_typed_errors() -> None:
    rng = random.Random(7)
    sig = bytes(range(64))
    samples = [
        encode_message(
            Message("a", Ping(1, "b", Coordinate(), 7, (Alive("c", 2, "h:1", "", sig),)))
        ),
        encode_message(Message("a", Sync(True, (Links("a", 3, (LinkEntry("b", 5000, 1),), sig),)))),
        encode_message(Message("a", Gossip((Credential("c", b"d" * 300), Left("c", 4, sig))))),
        encode_message(Message("a", Chunk("o", 9, 1, b"x" * 50, sig))),
    ]
    for i in range(20_000):
        if i % 2:
            data = bytes(rng.randrange(256) for _ in range(rng.randrange(64)))
        else:
            mutated = bytearray(rng.choice(samples))
            for _ in range(rng.randrange(1, 4)):
                mutated[rng.randrange(len(mutated))] = rng.randrange(256)
            data = bytes(mutated)
        with contextlib.suppress(MeshDecodeError):
            decode_message(data)


def test_a_route_out_of_range_is_refused_both_ways() -> None:
    good = encode_message(Message("a", Chunk("o", 9, 1, b"x", bytes(64), route=MAX_ROUTE)))
    assert good[1] == MeshKind.ROUTED_CHUNK
    at = good.index(b"\x01" + bytes([MAX_ROUTE]), 4)  # hops 1, then the route
    for bad in (0, MAX_ROUTE + 1, 255):
        mutated = good[: at + 1] + bytes([bad]) + good[at + 2 :]
        with pytest.raises(MeshDecodeError, match="route"):
            decode_message(mutated)
        with pytest.raises(ValueError, match="route"):
            encode_message(Message("a", Chunk("o", 9, 1, b"x", bytes(64), route=bad or -1)))


def _planned(plan: tuple[tuple[str, int], ...]) -> bytes:
    """A PLANNED_CHUNK from origin "o" with this plan, encoded as it stands."""
    w = bytearray([2, MeshKind.PLANNED_CHUNK, 1]) + b"a" + bytes([1]) + b"o"
    w += (9).to_bytes(8, "little") + bytes([1, 0, len(plan)])
    for node, parent in plan:
        w += bytes([len(node.encode())]) + node.encode() + bytes([parent])
    n = MIN_PLANNED_PAYLOAD_BYTES
    return bytes(w + n.to_bytes(4, "little") + bytes(n) + bytes(64))


def test_a_plan_with_a_cycle_a_repeat_its_origin_or_no_node_is_refused() -> None:
    assert decode_message(_planned((("a", 0), ("b", 1)))).body.plan == (("a", 0), ("b", 1))  # type: ignore[union-attr]
    for bad, why in (
        ((("a", 1),), "parent"),  # its own parent
        ((("a", 0), ("b", 3)), "parent"),  # a parent that comes later
        ((("a", 0), ("a", 1)), "twice"),
        ((("o", 0),), "twice"),  # the origin is the root, not a planned node
        ((), "1 to"),
        (tuple((f"n{i}", 0) for i in range(MAX_PLAN_NODES + 1)), "1 to"),
        (tuple((f"{i:02d}" + "x" * 100, 0) for i in range(40)), "bytes"),
    ):
        with pytest.raises(MeshDecodeError, match=why):
            decode_message(_planned(bad))
    large = bytes(MIN_PLANNED_PAYLOAD_BYTES)
    with pytest.raises(ValueError, match="parent"):
        encode_message(Message("a", Chunk("o", 9, 1, large, bytes(64), plan=(("a", 1),))))
    with pytest.raises(ValueError, match="route"):
        encode_message(Message("a", Chunk("o", 9, 1, large, bytes(64), MAX_ROUTE + 1, (("a", 0),))))


def test_a_chunks_plan_and_route_are_signed_with_it() -> None:
    ids_ = identities("a", "o")
    base = Chunk("o", 9, 1, b"x", plan=(("a", 0), ("b", 1)))
    good = signed(base)
    assert ids_.verify_chunk(good)
    for changed in (
        dataclasses.replace(good, plan=(("a", 0), ("b", 0))),
        dataclasses.replace(good, plan=()),
        dataclasses.replace(good, route=1),
    ):
        assert not ids_.verify_chunk(changed)
    assert ids_.verify_chunk(dataclasses.replace(good, hops=7))  # relays count hops


def test_limits_are_enforced_both_ways() -> None:
    with pytest.raises(ValueError):
        encode_message(Message("x" * (MAX_ID_BYTES + 1), Nack(1)))
    sig = b"s" * 64
    huge = Message("a", Gossip(tuple(Alive("n" * 100, 1, "a" * 100, "", sig) for _ in range(400))))
    with pytest.raises(ValueError):
        encode_message(huge)
    with pytest.raises(ValueError, match="signature"):
        encode_message(Message("a", Gossip((Alive("n", 1, "a"),))))  # unsigned
    # A length field claiming more than is there is refused before any allocation.
    forged = (
        bytes([2, 7, 1, 97, 1, 111])
        + (5).to_bytes(8, "little")
        + bytes([0])
        + (2**31).to_bytes(4, "little")
    )
    with pytest.raises(MeshDecodeError, match=r"exceeds|truncated"):
        decode_message(forged)
    bad_coord = bytearray(encode_message(Message("a", Ack(1, Coordinate()))))
    bad_coord[8:12] = b"\x00\x00\xc0\x7f"  # NaN in the first component
    with pytest.raises(MeshDecodeError, match=r"coordinate"):
        decode_message(bytes(bad_coord))


def test_an_incarnation_past_the_bound_or_a_version_1_message_is_refused() -> None:
    """Suspect(x, 2^64 - 1) once made x refute into 2^64, which no encoder takes: now
    the decoder refuses any incarnation past MAX_INCARNATION, in every update."""
    for update in (
        Suspect("x", MAX_INCARNATION + 1, "liar"),
        Dead("x", 2**64 - 1, "liar"),
        Alive("x", 2**64 - 1, "h:1", "", b"s" * 64),
        Left("x", MAX_INCARNATION + 1, b"s" * 64),
    ):
        raw = bytes([2, 5, 1, 97]) + (1).to_bytes(2, "little") + encode_update(update)
        with pytest.raises(MeshDecodeError, match="incarnation"):
            decode_message(raw)
    at_bound = Message("a", Gossip((Suspect("x", MAX_INCARNATION, "b"),)))
    assert decode_message(encode_message(at_bound)) == at_bound
    v1 = bytearray(encode_message(Message("a", Nack(3))))
    v1[0] = 1
    with pytest.raises(MeshDecodeError, match="version 1"):
        decode_message(bytes(v1))


def test_a_signature_covers_its_fields_and_is_valid_for_nothing_else() -> None:
    ids = identities("observer", "x")
    alive = signed(Alive("x", 3, "10.0.0.1:7946", "eu"))
    assert ids.verify("x", alive)
    for changed in (
        Alive("x", 4, "10.0.0.1:7946", "eu", alive.signature),  # incarnation
        Alive("x", 3, "10.6.6.6:7946", "eu", alive.signature),  # address (a hijack)
        Alive("x", 3, "10.0.0.1:7946", "us", alive.signature),  # region
    ):
        assert not ids.verify("x", changed)
    assert not ids.verify("x", signed(Alive("x", 3, "10.6.6.6:7946"), by="observer"))
    left = Left("x", 3, alive.signature)  # the same fields, another kind of message
    assert signed_bytes(left) != signed_bytes(alive) and not ids.verify("x", left)
    chunk = signed(Chunk("x", 9, 0, b"payload"))
    relayed = Chunk("x", 9, 7, b"payload", chunk.signature)  # hops are not signed
    assert ids.verify_chunk(chunk) and ids.verify_chunk(relayed)
    assert not ids.verify_chunk(Chunk("x", 10, 0, b"payload", chunk.signature))
    assert not ids.verify_chunk(Chunk("x", 9, 0, b"payloaD", chunk.signature))
    routed = signed(Chunk("x", 9, 0, b"payload", route=1))
    assert ids.verify_chunk(routed) and signed_bytes(routed) != signed_bytes(chunk)
    for rerouted in (  # a relay cannot send it down another strategy's trees
        dataclasses.replace(routed, route=2),
        dataclasses.replace(routed, route=0),
        dataclasses.replace(chunk, route=1),
    ):
        assert not ids.verify_chunk(rerouted)
    assert not ids.verify("stranger", alive)  # no credential, no key
    named = signed(Alive("x", 3, "10.0.0.1:7946", "eu", name="tokyo-1"))
    assert ids.verify("x", named)
    renamed = Alive("x", 3, "10.0.0.1:7946", "eu", named.signature, "tokyo-2")
    unnamed = Alive("x", 3, "10.0.0.1:7946", "eu", named.signature)
    assert not ids.verify("x", renamed) and not ids.verify("x", unnamed)
    assert not ids.verify("x", Alive("x", 3, "10.0.0.1:7946", "eu", alive.signature, "n"))


@pytest.mark.parametrize("name", ["bad\x1b[31mred", "tab\there", "x" * 65, "\u3164", "caf\u00e9"])
def test_a_name_that_would_garble_a_terminal_or_is_too_long_is_refused(name: str) -> None:
    good = encode_message(Message("a", Gossip((Alive("n", 1, "h:1", "", b"s" * 64, "ok"),))))
    raw = good.replace(b"\x02ok", bytes([len(name.encode())]) + name.encode())
    assert raw != good
    with pytest.raises(MeshDecodeError, match="name"):
        decode_message(raw)
    with pytest.raises(ValueError):
        encode_update(Alive("n", 1, "h:1", "", b"s" * 64, "x" * 65))


def test_rated_link_state_is_its_own_signed_form_and_its_rates_are_range_checked() -> None:
    """A link state with measured rates travels as RATED_LINKS (appended: a LINKS
    without rates keeps its bytes); its signature covers the rates, is valid for
    neither the unrated form nor another rate, and a rate past 1 Tbit/s is refused."""
    ids = identities("observer", "x")
    plain = Links("x", 3, (LinkEntry("y", 5000, 1),))
    rated = Links("x", 3, (LinkEntry("y", 5000, 1, 20_000),))
    signed_rated = signed(rated)
    assert encode_update(signed(plain))[0] == 5 and encode_update(signed_rated)[0] == 8
    assert ids.verify("x", signed_rated)
    for changed in (
        Links("x", 3, (LinkEntry("y", 5000, 1, 40_000),), signed_rated.signature),
        Links("x", 3, (LinkEntry("y", 5000, 1),), signed_rated.signature),
    ):
        assert not ids.verify("x", changed)
    raw = encode_message(Message("a", Gossip((signed_rated,))))
    assert decode_message(raw) == Message("a", Gossip((signed_rated,)))
    too_fast = raw.replace(
        (20_000).to_bytes(4, "little"), (MAX_RATE_KBPS + 1).to_bytes(4, "little")
    )
    with pytest.raises(MeshDecodeError, match="rate"):
        decode_message(too_fast)
    no_rate = raw.replace((20_000).to_bytes(4, "little"), bytes(4))
    with pytest.raises(MeshDecodeError, match="without a rate"):
        decode_message(no_rate)
