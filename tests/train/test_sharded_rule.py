"""Sharded replicas in the update rule (core.replica.rule with core.codec.pieces),
without any network: a node whose two ranks each hold half of every tensor's rows
(as FSDP2's ``fully_shard`` splits them) trains one run with an unsharded node. The
chunks name the model's own coordinates, so each side applies exactly what falls on
what it holds, whoever sent it and however that node sharded."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from ciuic_p2p.config import CodecSection
from ciuic_p2p.core.codec.bucket import ChunkSource
from ciuic_p2p.core.codec.chunk import parse_chunk
from ciuic_p2p.core.codec.layout import BucketLayout, canonical_name
from ciuic_p2p.core.codec.pieces import PieceMap
from ciuic_p2p.core.replica.messages import (
    PayloadKind,
    decode_payload,
    encode_done,
    encode_presence,
    run_id_of,
)
from ciuic_p2p.core.replica.rule import Replica, consensus_distance
from ciuic_p2p.core.store.statefile import StateFormatError, pack_state, read_header
from ciuic_p2p.train.hook import flatten_parameters
from ciuic_p2p.train.shardfetch import rank_ranges
from tests.train.test_replica import TRAIN, model

CODEC = CodecSection(density=0.05, dense_below_numel=100)
"""Biases dense, weights sparse: both kinds of chunk are split."""
WIDTH = 65
"""Odd, as FSDP2 splits it: 33 rows on the first rank, 32 on the second."""


def _layout() -> tuple[torch.nn.Module, BucketLayout]:
    m = model(WIDTH)
    return m, BucketLayout.for_module(m, dense_below_numel=CODEC.dense_below_numel)


def _rows(layout: BucketLayout, rank: int, ranks: int) -> dict[str, tuple[int, int]]:
    """FSDP2's ``Shard(0)``: each tensor's rows split in ceil-sized parts."""
    out = {}
    for slot in layout.slots:
        dim0 = slot.shape[0]
        size = -(-dim0 // ranks)
        first = min(dim0, rank * size)
        out[slot.name] = (first, min(dim0, first + size) - first)
    return out


def _plain(name: str, seed: int) -> Replica:
    m, layout = _layout()
    source = ChunkSource(run_id_of("run"), name.encode().ljust(32, b"."), 0, layout.layout_id)
    return Replica(layout, flatten_parameters(m, layout), source, name, CODEC, TRAIN, seed=seed)


def _rank(name: str, rank: int, ranks: int) -> Replica:
    """One rank of a sharded node: its pieces' tensors hold those elements of the same
    initial model (what its FSDP2 shard holds), nothing else."""
    m, layout = _layout()
    whole = flatten_parameters(m, layout)
    pieces = PieceMap.of_rows(layout, _rows(layout, rank, ranks))
    held = [whole[p.bucket][p.start : p.end].clone() for p in pieces.pieces]
    source = ChunkSource(run_id_of("run"), name.encode().ljust(32, b"."), 0, layout.layout_id)
    return Replica(layout, held, source, name, CODEC, TRAIN, seed=10 + rank, pieces=pieces)


def _gather(ranks: list[Replica]) -> list[torch.Tensor]:
    """A sharded node's whole model, as a test gathers it (the library never does)."""
    layout = ranks[0].layout
    out = [torch.full((b.numel,), float("nan")) for b in layout.buckets]
    for r in ranks:
        assert r.pieces is not None
        for piece, t in zip(r.pieces.pieces, r.buckets, strict=True):
            out[piece.bucket][piece.start : piece.end] = t
    return out


def _introduce(replicas: list[Replica]) -> None:
    names = sorted({r.peer for r in replicas})
    for r in replicas:
        r.set_alive(names)
        for other in names:
            if other != r.peer:
                r.receive(other, encode_presence(PayloadKind.JOIN, run_id_of("run")))


def _step(r: Replica, gen: torch.Generator, scale: float) -> list[bytes]:
    """Move what ``r`` holds as an optimizer would; the payloads of a due send."""
    with torch.no_grad():
        for b in r.buckets:
            b.add_(torch.randn(b.shape, generator=gen) * scale)
    return r.encode_update(r.take_update(), r.step) if r.local_step() else []


def test_a_peers_chunks_fall_on_each_rank_exactly_as_on_an_unsharded_replica() -> None:
    """The same chunks of a peer, applied by the two ranks of a sharded node and by an
    unsharded replica of the same model: what each rank holds afterwards is, element
    for element, what the unsharded replica holds there; every chunk is counted
    applied on both ranks, those that miss a rank's rows too."""
    peer = _plain("peer", 0)
    plain = _plain("node", 1)
    ranks = [_rank("node", r, 2) for r in range(2)]
    _introduce([peer, plain, *ranks])
    gen = torch.Generator().manual_seed(3)
    sent = []
    for _ in range(12):
        sent += _step(peer, gen, 0.01)
    sent += peer.encode_update(peer.take_final(), dense=True)  # dense INT8 chunks too
    for payload in sent:
        for r in [plain, *ranks]:
            r.receive("peer", payload)
    for r in [plain, *ranks]:
        r.flush(wait=True)
        assert r.stats.applied_from["peer"] == len(sent) and not r.stats.refused
    gathered = _gather(ranks)
    for whole, mine in zip(plain.buckets, gathered, strict=True):
        assert torch.equal(whole, mine)
    # And the bases (what the encoders will read the next update against) alike.
    for r in [plain, *ranks]:
        r.parameters.settle_base()
    for b, base in enumerate(plain.base):
        for r in ranks:
            assert r.pieces is not None
            for piece, held in zip(r.pieces.pieces, r.base, strict=True):
                if piece.bucket == b:
                    assert torch.equal(base[piece.start : piece.end], held)


def test_a_ranks_chunks_name_the_models_coordinates_within_its_rows() -> None:
    rank = _rank("node", 1, 2)
    _introduce([rank, _plain("peer", 0)])
    assert rank.pieces is not None
    gen = torch.Generator().manual_seed(4)
    payloads = []
    for _ in range(3):
        payloads += _step(rank, gen, 0.01)
    assert payloads
    held = {(p.bucket, p.start, p.end) for p in rank.pieces.pieces}
    for payload in payloads:
        h, _ = parse_chunk(decode_payload(payload).body)
        assert h.layout_id == rank.layout.layout_id
        assert any(
            b == h.bucket and s <= h.range_start and h.range_start + h.range_len <= e
            for b, s, e in held
        ), (h.bucket, h.range_start, h.range_len)


@pytest.mark.parametrize("rank_count", [2, 3])
def test_a_sharded_node_and_a_plain_one_train_one_run_and_end_as_one_model(
    rank_count: int,
) -> None:
    """A sharded node (its ranks publish as one origin) and an unsharded one train 40
    steps, every chunk delivered, then finish: each counts every chunk of the other,
    settles its own, and after the last round the node's gathered model and the plain
    replica's are one model (fp16 copies: within rounding)."""
    plain = _plain("plain", 0)
    ranks = [_rank("node", r, rank_count) for r in range(rank_count)]
    everyone = [plain, *ranks]
    _introduce(everyone)
    gen = torch.Generator().manual_seed(5)
    for _ in range(40):
        for p in _step(plain, gen, 0.001):
            for r in ranks:
                r.receive("plain", p)
        for r in ranks:
            for p in _step(r, gen, 0.001):
                plain.receive("node", p)
    node_sent = sum(r.stats.chunks_sent for r in ranks)
    assert plain.stats.applied_from["node"] == node_sent
    assert all(r.stats.applied_from["plain"] == plain.stats.chunks_sent for r in ranks)
    for r in ranks:
        r.receive("plain", encode_done(run_id_of("run"), plain.step, plain.stats.chunks_sent))
    plain.receive("node", encode_done(run_id_of("run"), ranks[0].step, node_sent))
    for r in everyone:
        r.settle(everything=True)
        r.fold_final()
    assert not any(r._debts for r in everyone)
    before = consensus_distance([[b.clone() for b in plain.buckets], _gather(ranks)])
    assert before > 1e-3, before  # their residuals keep them apart
    copies: dict[str, list[bytes]] = {"plain": [], "node": []}
    plain.start_final(["plain", "node"], copies["plain"].append)
    for r in ranks:
        r.start_final(["plain", "node"], copies["node"].append)
    for p in copies["node"]:
        plain.receive("node", p)
    for r, p in itertools.product(ranks, copies["plain"]):
        r.receive("plain", p)
    for r in everyone:
        assert r.final_complete
        summary = r.end_final()
        assert summary is not None and summary.complete and not summary.refused
    after = consensus_distance([[b.clone() for b in plain.buckets], _gather(ranks)])
    assert after < 1e-5, (before, after)


def test_a_sharded_replica_refuses_outer_mode() -> None:
    m, layout = _layout()
    whole = flatten_parameters(m, layout)
    pieces = PieceMap.of_rows(layout, _rows(layout, 0, 2))
    held = [whole[p.bucket][p.start : p.end].clone() for p in pieces.pieces]
    source = ChunkSource(run_id_of("run"), b"n".ljust(32, b"."), 0, layout.layout_id)
    outer = dataclasses.replace(TRAIN, mode="outer")
    with pytest.raises(ValueError, match="step"):
        Replica(layout, held, source, "node", CODEC, outer, pieces=pieces)


def test_sharded_ranks_mix_a_peers_fragment_as_an_unsharded_twin_does() -> None:
    """The consensus mix: a sharded node's ranks send their parts of each fragment, an
    unsharded peer takes them as a whole replica's; the peer's fragment moves the ranks
    as it moves an unsharded twin of the node, element for element (up to fp32
    rounding of the parts' own bounds)."""
    mixing = dataclasses.replace(TRAIN, consensus_interval_steps=1)
    m, layout = _layout()
    whole = flatten_parameters(m, layout)
    with torch.no_grad():  # the peer apart from the node, as replicas drift
        for b in whole:
            b.mul_(1.0 + 0.01 * torch.randn(b.shape, generator=torch.Generator().manual_seed(1)))

    def make(name: str, pieces: PieceMap | None, seed: int) -> Replica:
        source = ChunkSource(run_id_of("run"), name.encode().ljust(32, b"."), 0, layout.layout_id)
        if pieces is None:
            held = flatten_parameters(_layout()[0], layout)
        else:
            base = flatten_parameters(_layout()[0], layout)
            held = [base[p.bucket][p.start : p.end].clone() for p in pieces.pieces]
        return Replica(layout, held, source, name, CODEC, mixing, seed=seed, pieces=pieces)

    peer = Replica(
        layout, whole,
        ChunkSource(run_id_of("run"), b"peer".ljust(32, b"."), 0, layout.layout_id),
        "peer", CODEC, mixing,
    )  # fmt: skip
    ranks = [make("node", PieceMap.of_rows(layout, _rows(layout, r, 2)), 10 + r) for r in range(2)]
    twin = make("node", None, 1)
    _introduce([peer, *ranks])
    _introduce([peer, twin])
    # Fragments 1 to 40 of 64 (a round a step): both ranks' rows are in some.
    for _ in range(40):
        for r in [peer, twin, *ranks]:
            r.local_step()
            assert r.wants_params()
        fragments = {r: r.encode_params(r.snapshot_params()) for r in [peer, twin, *ranks]}
        for p in fragments[peer]:
            for r in [twin, *ranks]:
                r.receive("peer", p)
        # The ranks' parts of the node's fragment are a whole replica's to the peer.
        for r in ranks:
            for p in fragments[r]:
                peer.receive("node", p)
    for r in [twin, *ranks]:
        r.flush(wait=True)
        assert r.stats.params_mixed > 0 and not r.stats.refused
    gathered = _gather(ranks)
    for mine, theirs in zip(twin.buckets, gathered, strict=True):
        assert torch.allclose(mine, theirs, atol=1e-7)
    assert peer.stats.params_mixed > 0 and not peer.stats.refused
    assert peer.stats.params_unmatched == 0


def test_a_ranks_ranges_of_a_state_are_its_rows_of_every_tensor() -> None:
    """A sharded rank fetches of a whole replica's state only its rows: of every
    bucket its pieces, of every optimizer tensor shaped as a parameter the same rows,
    a scalar one whole, then the meta area (train.shardfetch.rank_ranges); a header
    of another model or naming an optimizer parameter that is not there is refused."""
    net = model(width=33)
    layout = BucketLayout.for_module(net, dense_below_numel=100)
    buckets = flatten_parameters(net, layout)
    opt = torch.optim.Adam(net.parameters())
    net(torch.randn(4, 32)).sum().backward()
    opt.step()
    blob, _ = pack_state(layout.layout_id, buckets, opt, {"applied": {"p1": 3}})
    header, start = read_header(blob)
    rows = {s.name: (s.shape[0] // 2, s.shape[0] - s.shape[0] // 2) for s in layout.slots}
    pieces = PieceMap.of_rows(layout, rows)
    params = dict(net.named_parameters())
    names = [canonical_name(n) for n in params]
    wanted = rank_ranges(header, start, layout, pieces, names)
    seen = set()
    for w in wanted:
        raw = bytes(blob[w.at : w.at + w.nbytes])
        if w.key == "meta":
            assert b'"applied":{"p1":3}' in raw
            continue
        got = torch.frombuffer(bytearray(raw), dtype=w.dtype)
        if w.piece >= 0:
            p = pieces.pieces[w.piece]
            assert torch.equal(got, buckets[p.bucket][p.start : p.end])
        else:
            index, _, name = w.key.removeprefix("opt/").partition("/")
            param = list(params.values())[int(index)]
            value = opt.state[param][name]
            r0, n = rows[names[int(index)]]
            expected = value.flatten() if value.dim() == 0 else value[r0 : r0 + n].flatten()
            assert torch.equal(got, expected.reshape(-1)), w.key
        seen.add(w.key)
    assert {f"opt/{i}/exp_avg" for i in range(len(names))} <= seen
    shard_bytes = sum(p.numel * 4 for p in pieces.pieces)
    assert sum(w.nbytes for w in wanted if w.piece >= 0) == shard_bytes
    with pytest.raises(StateFormatError, match="another model"):
        rank_ranges({**header, "layout": "0" * 16}, start, layout, pieces, names)
    with pytest.raises(StateFormatError, match="out of range"):
        rank_ranges(header, start, layout, pieces, names[:1])
