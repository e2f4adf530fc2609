"""Large pieces carry their origin's tree: every relay of one piece follows one plan,
whatever trees its own published state gives it; a member's plan moves only its own
chunks, through at most one child more than a relay's own tree gives it."""

from __future__ import annotations

import dataclasses

import pytest

from ciuic_p2p.config import MeshSection
from ciuic_p2p.core.mesh.broadcast import Disseminator
from ciuic_p2p.core.mesh.carriedplan import plan_children, plan_from_tree
from ciuic_p2p.core.mesh.chunkstore import ENTRY_OVERHEAD_BYTES, held_size
from ciuic_p2p.core.mesh.messages import (
    MAX_PLAN_NODES,
    MIN_PLANNED_PAYLOAD_BYTES,
    Chunk,
    MeshDecodeError,
    MeshKind,
    Message,
    Want,
    decode_message,
    encode_message,
)
from ciuic_p2p.core.mesh.planners import LARGE_PIECE_BYTES
from tests.mesh.signing import identities, signed

PIECE = bytes(LARGE_PIECE_BYTES + 1)
TREE = {"o": ["a", "b"], "a": ["c", "d"], "b": [], "c": ["e"], "d": [], "e": []}
EVERYONE = set(TREE)


def test_a_plan_is_the_origins_tree_and_each_node_reads_its_children_back() -> None:
    plan = plan_from_tree(TREE, "o")
    assert [n for n, _ in plan] == ["a", "b", "c", "d", "e"]  # breadth first
    for node, kids in TREE.items():
        assert plan_children(plan, "o", node, EVERYONE) == kids


def test_a_dead_relays_children_are_sent_to_by_its_parent() -> None:
    plan = plan_from_tree(TREE, "o")
    assert plan_children(plan, "o", "o", EVERYONE - {"a"}) == ["c", "d", "b"]
    assert plan_children(plan, "o", "o", EVERYONE - {"a", "c"}) == ["e", "d", "b"]


def test_a_node_the_plan_does_not_name_forwards_nothing() -> None:
    assert plan_children(plan_from_tree(TREE, "o"), "o", "late-joiner", EVERYONE) is None


def test_a_view_too_large_for_a_plan_carries_none() -> None:
    star = {"o": [f"n{i}" for i in range(MAX_PLAN_NODES + 1)]}
    assert plan_from_tree(star, "o") == ()
    assert len(plan_from_tree({"o": star["o"][:MAX_PLAN_NODES]}, "o")) == MAX_PLAN_NODES
    long_names = {"o": ["x" * 120 + f"{i:02d}" for i in range(40)]}  # over MAX_PLAN_BYTES
    assert plan_from_tree(long_names, "o") == ()


def _relay(own_children: list[str], settings: MeshSection | None = None) -> Disseminator:
    """Node ``a``, whose own trees give it ``own_children`` for every origin."""
    return Disseminator(
        "a",
        settings or MeshSection(),
        children=lambda origin, route, size: list(own_children),
        live=lambda: sorted(EVERYONE - {"a"}),
        identities=identities("a", "o"),
    )


def _sent(d: Disseminator) -> list[str]:
    return sorted(peer for peer, m in d.messages_to_send() if isinstance(m.body, Chunk))


def test_a_relay_forwards_by_the_plan_not_by_its_own_trees() -> None:
    """Its own state would send the piece to ``b`` (who has it from the origin) and not
    to ``c`` and ``d``: the plan's copies go where the origin planned them."""
    d = _relay(own_children=["b"])
    piece = signed(Chunk("o", 1, 1, PIECE, plan=plan_from_tree(TREE, "o")))
    d.handle(Message("o", piece), now=0.0)
    assert _sent(d) == ["c", "d"]
    assert d.kept("o", 1) is not None and d.kept("o", 1)[4] == piece.plan  # type: ignore[index]


def test_a_plan_a_relay_changed_is_refused_by_the_signature() -> None:
    d = _relay(own_children=["b"])
    piece = signed(Chunk("o", 1, 1, PIECE, plan=plan_from_tree(TREE, "o")))
    rerouted = dataclasses.replace(piece, plan=(("a", 0), ("b", 1), ("c", 1), ("d", 1)))
    d.handle(Message("b", rerouted), now=0.0)
    assert d.bad_signatures == 1 and _sent(d) == [] and d.kept("o", 1) is None


def test_a_members_plan_cannot_make_a_relay_fan_out_wider_than_routing_would() -> None:
    """Node ``o`` names ``a`` the parent of everyone else: ``a`` would send each of
    ``o``'s pieces to seven members for the one ``o`` sent. ``a`` keeps to its own tree
    (one child); a plan one child wider than that is what differing views give."""
    others = [f"n{i}" for i in range(7)]
    d = Disseminator(
        "a",
        MeshSection(),
        children=lambda origin, route, size: ["n0"],
        live=lambda: sorted(["o", *others]),
        identities=identities("a", "o"),
    )
    for seq, kids in enumerate((others, others[:3], others[1:3], others[4:6]), 1):
        plan = (("a", 0), *((n, 1) for n in kids))
        d.handle(Message("o", signed(Chunk("o", seq, 1, PIECE, plan=plan))), now=float(seq))
        assert _sent(d) == (["n0"] if len(kids) > 2 else kids), kids
    assert d.plans_refused == 2


def test_a_plan_on_a_small_chunk_is_refused_on_the_wire() -> None:
    assert MIN_PLANNED_PAYLOAD_BYTES == LARGE_PIECE_BYTES + 1
    small = signed(Chunk("o", 1, 1, bytes(LARGE_PIECE_BYTES), plan=(("a", 0),)))
    with pytest.raises(ValueError, match="plan"):
        encode_message(Message("o", small))
    data = encode_message(Message("o", dataclasses.replace(small, payload=PIECE)))
    at = data.index(len(PIECE).to_bytes(4, "little"))
    shrunk = data[:at] + len(small.payload).to_bytes(4, "little") + data[at + 4 : -65] + data[-64:]
    with pytest.raises(MeshDecodeError, match="planned chunk's payload"):
        decode_message(shrunk)


def test_held_chunks_count_their_plans_and_an_empty_chunk_counts_too() -> None:
    d = _relay(own_children=[], settings=MeshSection(chunk_retain_bytes=200_000))
    d.handle(Message("o", signed(Chunk("o", 1, 1, PIECE, plan=plan_from_tree(TREE, "o")))), 0.0)
    assert d.chunks.held_bytes == held_size(PIECE, plan_from_tree(TREE, "o"))
    assert held_size(PIECE, plan_from_tree(TREE, "o")) > len(PIECE) + 5 * 3
    for seq in range(2, 2000):
        d.handle(Message("o", signed(Chunk("o", seq, 1, b""))), float(seq) / 1000)
    assert d.chunks.held_bytes <= 200_000
    assert len(d.chunks.others) <= 200_000 // ENTRY_OVERHEAD_BYTES


def test_an_origin_sends_its_large_pieces_down_its_plan_and_repairs_them_with_it() -> None:
    d = Disseminator(
        "o",
        MeshSection(),
        children=lambda origin, route, size: ["b"],
        live=lambda: sorted(EVERYONE - {"o"}),
        identities=identities("o", "a"),
        plan_for=lambda route, size: plan_from_tree(TREE, "o") if size > LARGE_PIECE_BYTES else (),
    )

    def wire() -> list[tuple[str, MeshKind, Chunk]]:
        out = []
        for peer, m in d.messages_to_send():
            decoded = decode_message(encode_message(m))
            assert decoded == m and isinstance(decoded.body, Chunk)
            out.append((peer, decoded.kind, decoded.body))
        return sorted(out, key=lambda x: x[0])

    large = d.publish(bytes(LARGE_PIECE_BYTES + 1), now=0.0)
    sent = wire()
    planned = MeshKind.PLANNED_CHUNK
    assert [(p, k) for p, k, _ in sent] == [("a", planned), ("b", planned)]
    assert sent[0][2].plan == plan_from_tree(TREE, "o")
    d.publish(bytes(1000), now=1.0)
    assert [(p, k) for p, k, _ in wire()] == [("b", MeshKind.CHUNK)]
    d.handle(Message("e", Want("o", (large,))), now=2.0)
    ((peer, kind, answer),) = wire()
    assert (peer, kind, answer.plan, answer.hops) == ("e", planned, sent[0][2].plan, 255)
