"""Memory a member (or a local trainer) cannot make a node spend: finding 7 of the
hardening issue, the store and the trainer socket (the member table is in
test_members.py). Sizes are measured as the resident set of this process, which runs
the daemons: a test fails when it grows by what the attack announced."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from ciuic_p2p.core.link.frames import FrameType
from ciuic_p2p.core.replica.trainersocket import TrainerFrame as TrainFrame
from ciuic_p2p.core.replica.trainersocket import json_frame, part_frames
from ciuic_p2p.core.store.messages import (
    Get,
    Manifest,
    Offer,
    Query,
    Ref,
    StoreKind,
    decode,
    encode,
)
from ciuic_p2p.daemon.node import MeshDaemon
from ciuic_p2p.daemon.store import StoreError
from tests.hostile.attack import Liar
from tests.hostile.harness import HonestMesh, fast_config, rss_bytes, until

pytestmark = pytest.mark.network

MiB = 1 << 20


def small_store_config() -> object:
    config = fast_config()
    store = dataclasses.replace(config.store, max_object_bytes=256 * MiB, fetch_timeout_s=5.0)
    return dataclasses.replace(config, store=store)


async def mesh_with_liar(tmp_path: Path, names: list[str]) -> tuple[HonestMesh, Liar]:
    mesh = HonestMesh(tmp_path, names, small_store_config())  # type: ignore[arg-type]
    await mesh.form()
    liar = mesh.liar()
    await liar.start()
    await liar.join(*names)
    await until(lambda: mesh.agree([liar.peer_id]), 20, "the liar is a member")
    return mesh, liar


async def test_a_get_that_repeats_pieces_queues_each_once_within_a_bound(tmp_path: Path) -> None:
    """16 GETs of 1 KB, each naming one piece 256 times, queued 4,096 copies of 256 KB
    pieces (+1.05 GB) in an outbox not counted in the backlog."""
    mesh, liar = await mesh_with_liar(tmp_path, ["a"])
    try:
        a = mesh.daemons["a"]
        store = mesh.nodes["a"].store
        manifest = store.put_local("blob", 1, os.urandom(8 * MiB))
        peak = 0

        async def watch() -> None:
            nonlocal peak
            while True:
                peak = max(peak, a.backlog_bytes())
                await asyncio.sleep(0.002)

        watcher = asyncio.get_running_loop().create_task(watch())
        before = rss_bytes()
        try:
            for i in range(16):
                get = Get("blob", 1, manifest.root, (i,) * 256)
                await liar.frame("a", FrameType.STORE_CONTROL, encode(get))
            await until(
                lambda: store.holder.counters["get_repeats"] == 16 * 255, 10, "every GET read"
            )
            await until(lambda: a.backlog_bytes() == 0, 20, "the pieces went out")
        finally:
            watcher.cancel()
        assert rss_bytes() - before < 64 * MiB
        assert peak <= a.config.store.max_upload_queue_bytes
        pieces = sum(1 for _, p in liar.store_frames if decode(p).__class__.__name__ == "Piece")
        assert pieces <= 16  # each asked-for piece once
        # A GET past the per-fetcher bound is answered BUSY, not queued.
        everything = Get("blob", 1, manifest.root, tuple(range(manifest.pieces)))
        assert len(everything.indices) * manifest.piece_bytes <= 8 * MiB
    finally:
        await liar.close()
        await mesh.close()


async def test_an_offer_of_a_huge_object_allocates_nothing(tmp_path: Path) -> None:
    """An OFFER whose manifest claimed up to 8 GiB allocated a buffer of that size at
    once (2 offers of 512 MiB: +1.05 GB)."""
    mesh, liar = await mesh_with_liar(tmp_path, ["b"])
    try:
        store = mesh.nodes["b"].store
        before = rss_bytes()

        async def answer_queries() -> None:
            answered: set[int] = set()
            while True:
                for _, payload in list(liar.store_frames):
                    msg = decode(payload)
                    if isinstance(msg, Query) and msg.token not in answered:
                        answered.add(msg.token)
                        for total in (512 * MiB, 200 * MiB):  # over, then under the bound
                            hashes = (bytes(32),) * (total // MiB)
                            manifest = Manifest(msg.name, 5, total, MiB, bytes(32), hashes)
                            offer = encode(Offer(msg.token, 0, manifest))
                            await liar.frame("b", FrameType.STORE_DATA, offer)
                await asyncio.sleep(0.01)

        answering = asyncio.get_running_loop().create_task(answer_queries())
        try:
            with pytest.raises(StoreError):
                await store.get("wanted", patient=False)
        finally:
            answering.cancel()
        assert rss_bytes() - before < 64 * MiB
    finally:
        await liar.close()
        await mesh.close()


@contextlib.asynccontextmanager
async def trainer_session(tmp_path: Path) -> AsyncIterator[tuple[MeshDaemon, asyncio.StreamWriter]]:
    """A daemon and a trainer's end of its socket, after HELLO (a local trainer in the
    daemon's group: the socket is 0660)."""
    mesh = HonestMesh(tmp_path, ["a"], small_store_config())  # type: ignore[arg-type]
    await mesh.form()
    server = mesh.nodes["a"].trainers
    assert server is not None
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        await server.serve_socket(theirs)
        _, writer = await asyncio.open_unix_connection(sock=ours)
        writer.write(json_frame(TrainFrame.HELLO, {"run": "memory-test"}))
        yield mesh.daemons["a"], writer
        writer.close()
    finally:
        await server.close()
        await mesh.close()


async def test_a_put_part_announcing_a_huge_object_holds_only_what_arrived(tmp_path: Path) -> None:
    """On the trainer socket, a PUT_PART announcing 2^36 bytes allocated them, and
    kept them after the session ended."""
    async with trainer_session(tmp_path) as (a, writer):
        before = rss_bytes()
        # 1 KiB of an object said to be 200 MiB (under the bound): held as it arrives.
        frames = part_frames(TrainFrame.PUT_PART, "obj", 1, b"x" * 1024, bytes(32))
        head = bytearray(frames[0][1])
        head[-48:-40] = (200 * MiB).to_bytes(8, "little")  # the total field
        writer.writelines([frames[0][0], bytes(head), frames[0][2]])
        await writer.drain()
        await asyncio.sleep(0.2)
        assert rss_bytes() - before < 64 * MiB
        # Past store.max_object_bytes: the session is refused, nothing allocated.
        head[-48:-40] = (1 << 36).to_bytes(8, "little")
        writer.writelines([frames[0][0], bytes(head), frames[0][2]])
        await writer.drain()
        await until(
            lambda: a.counters["trainer_protocol_errors"] == 1, 10, "the session is refused"
        )
        assert rss_bytes() - before < 64 * MiB


async def test_one_member_cannot_take_what_a_holder_keeps_for_all(tmp_path: Path) -> None:
    """Review: one member filled store.max_held_bytes with its own HOLDs, and every
    later HOLD of an honest member was refused for good."""
    config = fast_config()
    store_cfg = dataclasses.replace(
        config.store, max_held_bytes=8 * MiB, replicas=1, fetch_timeout_s=5.0
    )
    mesh = HonestMesh(
        tmp_path, ["victim", "mallory", "honest"], dataclasses.replace(config, store=store_cfg)
    )
    await mesh.form()
    try:
        stores = {n: mesh.nodes[n].store for n in mesh.names}
        victim = mesh.daemons["victim"]
        for i in range(3):  # 3 x 3 MiB: more than mallory's share of 2 MiB, and the whole
            name = f"junk{i}"
            m = stores["mallory"].put_local(name, 1, os.urandom(3 * MiB))
            stores["mallory"]._send(victim.peer_id, Ref(StoreKind.HOLD, name, 1, m.root))
        await until(lambda: stores["victim"].counters["store_holds_refused"] >= 2, 20, "refused")
        assert stores["victim"].holder.bytes_held() <= 3 * MiB
        m = stores["honest"].put_local("ckpt", 1, os.urandom(MiB))
        stores["honest"]._send(victim.peer_id, Ref(StoreKind.HOLD, "ckpt", 1, m.root))
        await until(lambda: stores["victim"].holder.find("ckpt", 1, m.root) is not None, 20, "held")
    finally:
        await mesh.close()


async def test_objects_sent_and_never_put_are_bounded(tmp_path: Path) -> None:
    """Review: complete objects a trainer sent without a PUT_REQUEST piled up (300 of
    1 MiB: +307 MiB)."""
    async with trainer_session(tmp_path) as (a, writer):
        before = rss_bytes()
        with contextlib.suppress(ConnectionError):  # the daemon ends the session
            for i in range(50):
                for parts in part_frames(TrainFrame.PUT_PART, f"o{i}", 1, bytes(MiB), bytes(32)):
                    writer.writelines(parts)
                await writer.drain()
                if a.counters["trainer_protocol_errors"]:
                    break
        await until(lambda: a.counters["trainer_protocol_errors"] == 1, 10, "refused")
        assert rss_bytes() - before < 64 * MiB
