"""Golden bytes: every wire and file encoding, byte for byte as this release writes it.

A refactoring must leave every one of them unchanged (the encodings are the protocol:
nodes of one mesh, and files written before, must still understand each other). A
change that means to alter one is a new version of its format, said in its module and
in CHANGELOG.md; then regenerate with ``CIUIC_WRITE_GOLDEN=1 pytest tests/test_golden.py``
and review the diff of ``tests/golden_wire.json``.

Everything here is deterministic: fixed keys (Ed25519 signatures are), fixed fields,
exact top-k selection of a fixed tensor.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ciuic_p2p.core.audit import AuditChain
from ciuic_p2p.core.codec.bucket import BucketEncoder, BucketSpec, ChunkSource
from ciuic_p2p.core.codec.chunk import Codec, set_signature, signed_region
from ciuic_p2p.core.codec.origin import sign_chunk, verify_chunk
from ciuic_p2p.core.link.auth import build_auth
from ciuic_p2p.core.link.frames import FrameType, encode_frame
from ciuic_p2p.core.link.lanes import encode_lane_ports
from ciuic_p2p.core.mesh import messages as mw
from ciuic_p2p.core.replica import messages as tw
from ciuic_p2p.core.replica import trainersocket as ts
from ciuic_p2p.core.store import messages as sw
from ciuic_p2p.core.store.statefile import pack_state
from ciuic_p2p.identity import NodeKey
from ciuic_p2p.train.checkpoint import write_checkpoint

GOLDEN = Path(__file__).with_name("golden_wire.json")
KEY = NodeKey(Ed25519PrivateKey.from_private_bytes(bytes(range(32))))
SIG = KEY.sign(b"a fixed message")
PEER = KEY.peer_id
OTHER = "ciuicaaaabbbbccccddddeeeeffffgggghhhh"


def _chunks(over_digest: bool = False) -> list[bytes]:
    """Each codec's chunks, signed over their bytes (as the first signers did, still
    read) or over their digest (flags bit 1, as nodes sign now)."""
    source = ChunkSource(b"r" * 16, KEY.public_key, 3, 7)
    out = []
    for codec, density in (
        (Codec.SPARSE_INT8, 0.05),
        (Codec.SPARSE_FP16, 0.05),
        (Codec.DENSE_FP16, 1.0),
        (Codec.DENSE_INT8, 1.0),
        (Codec.SPARSE_INT4, 0.05),
        (Codec.SPARSE_INT2, 0.05),
    ):
        spec = BucketSpec(codec=codec, density=density, exact=True, chunk_payload_bytes=4096)
        # Exact integers of distinct magnitudes: no transcendental function (whose
        # last bit may differ between CPUs) and no ties for top-k to order.
        i = torch.arange(2000)
        update = (((i * 7919) % 2003) + 1).float() * torch.where(i % 2 == 0, 1.0, -1.0)
        for chunk in BucketEncoder(0, 2000, spec, source).encode(update, step=11):
            if over_digest:
                sign_chunk(chunk, KEY)
            else:
                set_signature(chunk, KEY.sign(*signed_region(chunk)), over_digest=False)
            assert verify_chunk(chunk).signed_over_digest == over_digest
            out.append(bytes(chunk))
    return out


def _mesh() -> dict[str, bytes]:
    coord = mw.Coordinate(tuple(float(i) / 8 for i in range(8)), 0.001, 0.5)
    updates: tuple[mw.Update, ...] = (
        mw.Alive(PEER, 3, "10.0.0.1:7946", "eu-west", SIG),
        mw.Suspect(OTHER, 2, PEER),
        mw.Dead(OTHER, 2, PEER),
        mw.Left(PEER, 4, SIG),
        mw.Links(PEER, 9, (mw.LinkEntry(OTHER, 123_456, 7),), SIG),
        mw.Credential(PEER, b"\x30\x82" + bytes(range(200))),
    )
    bodies: dict[str, mw.Body] = {
        "ping": mw.Ping(7, OTHER, coord, 0xDEADBEEF, updates),
        "ack": mw.Ack(7, coord, 0xDEADBEEF, updates[:2]),
        "ping_req": mw.PingReq(8, OTHER, "10.0.0.2:7946"),
        "nack": mw.Nack(8),
        "gossip": mw.Gossip(updates),
        "gossip_named_alive": mw.Gossip(
            (mw.Alive(PEER, 5, "10.0.0.1:7946", "eu-west", SIG, "frankfurt-1"),)
        ),
        "gossip_rated_links": mw.Gossip(
            (mw.Links(PEER, 10, (mw.LinkEntry(OTHER, 123_456, 7, 19_400),), SIG),)
        ),
        "sync": mw.Sync(True, updates),
        "chunk": mw.Chunk(PEER, (3 << 40) + 5, 2, b"payload" * 10, SIG),
        "routed_chunk": mw.Chunk(PEER, (3 << 40) + 6, 2, b"payload" * 10, SIG, route=1),
        "heads": mw.Heads(((PEER, 9), (OTHER, (2 << 40) + 1))),
        "want": mw.Want(OTHER, (1, 2, 3)),
    }
    return {f"mesh_{k}": mw.encode_message(mw.Message(PEER, b)) for k, b in bodies.items()}


def _store() -> dict[str, bytes]:
    manifest = sw.Manifest.build("state/abc", 12, bytes(range(256)) * 64, 4096)
    root = manifest.root
    messages: dict[str, sw.Message] = {
        "query": sw.Query("state/abc", 3, 99),
        "none": sw.NoneHeld("state/abc", 99),
        "offer": sw.Offer(99, 2, manifest),
        "offer_signed": sw.Offer(99, 2, manifest.signed(KEY.public_key, KEY.sign)),
        "query_writer": sw.Query("state/abc", 3, 99, PEER, 1000, root),
        "get": sw.Get("state/abc", 12, root, (0, 2, 1)),
        "piece": sw.Piece("state/abc", 12, root, 1, b"piece" * 10),
        **{
            kind.name.lower(): sw.Ref(kind, "state/abc", 12, root)
            for kind in (
                sw.StoreKind.BUSY,
                sw.StoreKind.HOLD,
                sw.StoreKind.HELD,
                sw.StoreKind.FINISHED,
                sw.StoreKind.GONE,
            )
        },
    }
    return {f"store_{k}": sw.encode(m) for k, m in messages.items()}


def _trainer() -> dict[str, bytes]:
    run = tw.run_id_of("golden-run")
    parts = ts.part_frames(ts.TrainerFrame.PUT_PART, "state/x", 3, b"p" * 10, b"c" * 32)
    return {
        "train_done": tw.encode_done(run, 40, 12),
        "train_join": tw.encode_presence(tw.PayloadKind.JOIN, run, 40, ask=True),
        "train_join_layout": tw.encode_presence(
            tw.PayloadKind.JOIN, run, 40, True, tw.LayoutSummary(0x0123456789ABCDEF, 12, 85_002)
        ),
        "train_join_stateless": tw.encode_presence(
            tw.PayloadKind.JOIN,
            run,
            40,
            False,
            tw.LayoutSummary(0x0123456789ABCDEF, 12, 85_002),
            stateless=True,
        ),
        "train_gone": tw.encode_presence(tw.PayloadKind.GONE, run),
        "train_envelope_update": tw.envelope(tw.PayloadKind.UPDATE),
        "train_envelope_final": tw.envelope(tw.PayloadKind.FINAL),
        "trainer_hello": ts.json_frame(ts.TrainerFrame.HELLO, {"run": "golden-run"}),
        "trainer_deliver_header": ts.frame_header(ts.TrainerFrame.DELIVER, 1000)
        + ts.peer_prefix(PEER),
        "trainer_put_part": b"".join(bytes(p) for p in parts[0]),
    }


def _link() -> dict[str, bytes]:
    out = {f"frame_{t.name.lower()}": encode_frame(t, b"x" * 8) for t in FrameType}
    out["lanes"] = encode_lane_ports((7300, 7301))
    out["auth"] = build_auth(KEY, b"\x30\x82fixed-der", "golden", b"s" * 32, b"c" * 8, b"o" * 8)
    return out


def _files(tmp: Path) -> dict[str, bytes]:
    layer = torch.nn.Linear(4, 3)
    with torch.no_grad():
        layer.weight.copy_(torch.arange(12, dtype=torch.float32).reshape(3, 4))
        layer.bias.copy_(torch.tensor([1.0, 2.0, 3.0]))
    state, compat = pack_state(5, [layer.weight.reshape(-1), layer.bias], None, {"step": 3})
    write_checkpoint(tmp / "run.ckpt", 3, state, compat)
    chain = AuditChain(PEER, KEY.sign)
    lines = [chain.entry("started", {"version": "golden"}, 1_700_000_000.5)]
    lines.append(chain.entry("refusals", {"total": 2, "reasons": {"x": 2}}, 1_700_000_060.0))
    return {
        "statefile": bytes(state),
        "checkpoint": (tmp / "run.ckpt").read_bytes(),
        "audit_lines": "\n".join(lines).encode(),
    }


def encodings(tmp: Path) -> dict[str, bytes]:
    out: dict[str, bytes] = {f"chunk_{i}": c for i, c in enumerate(_chunks())}
    out |= {f"chunk_digest_signed_{i}": c for i, c in enumerate(_chunks(over_digest=True))}
    builders: list[Callable[[], dict[str, bytes]]] = [_mesh, _store, _trainer, _link]
    for build in builders:
        out.update(build())
    out.update(_files(tmp))
    return out


def test_every_encoding_is_byte_for_byte_what_it_was(tmp_path: Path) -> None:
    got = {k: v.hex() for k, v in encodings(tmp_path).items()}
    if os.environ.get("CIUIC_WRITE_GOLDEN") == "1":
        GOLDEN.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    want = json.loads(GOLDEN.read_text())
    assert sorted(got) == sorted(want), "encodings added or removed: regenerate (see above)"
    changed = [
        f"{k}: {hashlib.sha256(bytes.fromhex(want[k])).hexdigest()[:12]} -> "
        f"{hashlib.sha256(bytes.fromhex(got[k])).hexdigest()[:12]}"
        for k in sorted(got)
        if got[k] != want[k]
    ]
    if changed:
        pytest.fail("encodings changed (a new format version?): " + "; ".join(changed))
