#!/usr/bin/env python3
"""Attacks on three real daemons, and what they cost them: the hardening benchmark.

Three `ciuic-node run` daemons (a, b, c) on 127.0.0.1, each with an honest trainer
that publishes an update every 0.1 s through its daemon's trainer socket and records
every update it is delivered. Then, one after the other, bounded in count and time:

- floods at a from at least 1,000 source addresses of 127.0.0.0/8 (honest nodes use
  127.0.0.1): ``fake_initials`` (200,000 QUIC Initials of version 1 that no client sent,
  in 60 s), ``unsupported_versions`` (20,000 datagrams of QUIC versions nobody speaks),
  ``idle_handshakes`` (500 QUIC handshakes completed and left without AUTH);
- attacks by a member holding a real certificate of the cluster (tests/hostile/
  attack.py's Liar): ``accusations`` (Suspect/Dead of b above its incarnation, up to
  2^64 - 1), ``heads_mute`` (HEADS claiming a's next session), ``forged_chunks``
  (chunks and DONE/GONE/JOIN as a, a's next numbers, replays), ``address_hijack``
  (Alive of b at the liar's address), ``store_get_repeats`` (16 GETs naming one piece
  256 times each), ``huge_offers`` (two 512 MiB manifests to a fetch), ``made_up_members``
  (2,700 members without credentials), ``ping_req_reflection`` (probe requests and
  Alives naming a third party's address), ``credit_bomb`` (a CREDIT of 2^63 bytes),
  ``certificate_flood`` (gossip frames of 174 fresh certificates each, from a pool of
  5,000 that look like the cluster's, at a, 40 frames a second for 20 s).

Printed, per attack and in all: ``daemons_running``, ``false_dead`` and ``false_suspect``
(an honest node declared dead or suspected by an honest node, from the daemons' logs),
``rss_growth_mb`` (per daemon: the peak during the attack minus the value just before),
``rss_after_mb`` (``--settle-s`` after it, minus before), ``updates_missed`` (an update
an honest trainer published during the attack and not delivered to both other honest
trainers within 5 s of its end) and ``reflected_datagrams``; over the run,
``audit_growth_mb_max`` (bytes added to a daemon's audit directory). The certificate
flood also gives ``flood_victim_core_fraction``: a's CPU time during the flood minus
its CPU time in a window as long just before it, as a fraction of one core (the
target is at most 0.25), and the p50 of the honest updates' delay to a's trainer in
both windows (``victim_update_p50_ms``, ``baseline_update_p50_ms``).

Then the training section (bench/hostile_training.py): three honest daemons with
digits trainers and one member whose trainer attacks (sign-flipped copies with and
without a ``replicas`` claim, x5, a fixed direction at x10, a forged state at an absurd
and at a plausible version before a joiner), each beside the same run without the
member; a store replacement on real daemons; false link costs with every copy dropped
on the simulator's 11-city WAN. Its headline figures (``honest_loss_over_clean_max``,
``honest_accuracy_drop_max``, ``honest_trainer_crashes``, ``joiner_took_forged_state``,
``store_objects_replaced``, ``relay_delivery_p90_over_clean``) are printed at the top
level beside ``flood_victim_core_fraction``.

    python bench/hostile.py --json            # the whole run, about 20 minutes
    python bench/hostile.py --json --quick    # smaller floods, 3 s settles (a smoke run)
    python bench/hostile.py --json --only certificate_flood   # one attack (or several, a,b)
    python bench/hostile.py --json --only flip_x5,store_replacement   # training rows
    python bench/hostile.py --json --no-training   # the daemon attacks only
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import random
import socket
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the attackers live with the hostile tests

import torch  # noqa: E402

from ciuic_p2p.core.codec.bucket import BucketEncoder, BucketSpec, ChunkSource  # noqa: E402
from ciuic_p2p.core.codec.chunk import Codec, parse_chunk  # noqa: E402
from ciuic_p2p.core.link.frames import FrameType  # noqa: E402
from ciuic_p2p.core.mesh.messages import (  # noqa: E402
    MAX_INCARNATION,
    MAX_MESSAGE_BYTES,
    VERSION,
    Alive,
    Chunk,
    Dead,
    Heads,
    MeshKind,
    PingReq,
    Suspect,
    encode_update,
    update_size,
)
from ciuic_p2p.core.replica.messages import PayloadKind as TrainKind  # noqa: E402
from ciuic_p2p.core.replica.messages import (  # noqa: E402
    decode_payload,
    encode_done,
    encode_presence,
    envelope,
    run_id_of,
)
from ciuic_p2p.core.store.messages import Get, Manifest, Offer, Query, decode, encode  # noqa: E402
from ciuic_p2p.daemon.control import request  # noqa: E402
from ciuic_p2p.identity import NodeKey, peer_id_of  # noqa: E402
from ciuic_p2p.lab.cluster import LocalCluster  # noqa: E402
from ciuic_p2p.train.channel import DaemonChannel  # noqa: E402
from ciuic_p2p.transport.errors import TransportError  # noqa: E402
from tests.hostile.attack import (  # noqa: E402
    Liar,
    fresh_certificates,
    long_header,
    source_hosts,
)
from tests.transport.rawclient import RawClient  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
import hostile_training  # noqa: E402

NAMES = ["a", "b", "c"]
RUN = "hostile-bench"
CONFIG = """
[store]
fetch_timeout_s = 15.0
"""
MiB = 1 << 20
MIN_PHASE_S = 5.0
"""Every attack lasts at least this: each honest trainer publishes 50 updates in it."""


# -- honest trainers ------------------------------------------------------------------


class Trainer:
    """An honest trainer on one daemon: publishes a real update chunk every
    ``interval_s`` and records every update delivered to it."""

    def __init__(self, socket_path: Path, interval_s: float = 0.1) -> None:
        self.channel = DaemonChannel.connect(socket_path, timeout_s=30)
        welcome = self.channel.hello(RUN, timeout_s=30)
        self.peer = str(welcome["peer"])
        source = ChunkSource(
            run_id_of(RUN), bytes.fromhex(welcome["public_key"]), int(welcome["incarnation"]), 1
        )
        self.encoder = BucketEncoder(0, 20_000, BucketSpec(Codec.SPARSE_INT8, 0.02), source)
        self.interval_s = interval_s
        self.published: dict[int, float] = {}
        """step -> when published."""
        self.received: dict[tuple[str, int], float] = {}
        """(origin peer, step) -> when delivered here."""
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._publish, daemon=True),
            threading.Thread(target=self._receive, daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _publish(self) -> None:
        step = 0
        while not self._stop.wait(self.interval_s):
            step += 1
            for chunk in self.encoder.encode(torch.randn(20_000), step):
                self.channel.publish(envelope(TrainKind.UPDATE) + chunk)
            self.published[step] = time.time()

    def _receive(self) -> None:
        while not self._stop.wait(0.02):
            while self.channel.deliveries:
                peer, payload = self.channel.deliveries.popleft()
                msg = decode_payload(payload)
                if msg.kind is TrainKind.UPDATE:
                    header, _ = parse_chunk(msg.body)
                    self.received.setdefault((peer, header.step), time.time())

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(5)
        self.channel.close()


# -- what is measured --------------------------------------------------------------------


class RssSampler:
    """Each daemon's resident set, sampled every 0.1 s."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.samples: dict[str, list[tuple[float, int]]] = {n: [] for n in pids}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            for name, pid in self.pids.items():
                with contextlib.suppress(OSError, ValueError):
                    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                        if line.startswith("VmRSS:"):
                            self.samples[name].append((time.time(), int(line.split()[1]) * 1024))

    def at(self, name: str, when: float) -> int:
        before = [rss for t, rss in self.samples[name] if t <= when]
        return before[-1] if before else self.samples[name][0][1]

    def peak(self, name: str, start: float, end: float) -> int:
        during = [rss for t, rss in self.samples[name] if start <= t <= end]
        return max(during) if during else self.at(name, end)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


def cpu_s(pid: int) -> float:
    """A process's CPU time (user and system), from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def median(values: list[float]) -> float | None:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else None


def member_events(log: Path, honest: set[str]) -> list[tuple[float, str, str]]:
    """(time, event, peer) of every member_suspect / member_dead about an honest node."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        if not line.startswith("{"):
            continue
        with contextlib.suppress(ValueError):
            event = json.loads(line)
            if (
                event.get("event") in ("member_suspect", "member_dead")
                and event.get("peer") in honest
            ):
                when = dt.datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00"))
                out.append((when.timestamp(), event["event"], event["peer"]))
    return out


def dir_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


@dataclass
class Phase:
    name: str
    start: float = 0.0
    end: float = 0.0
    sent: int = 0
    notes: dict[str, Any] = field(default_factory=dict)


# -- the attacks -------------------------------------------------------------------------


def flood(target: tuple[str, int], datagrams: Callable[[int], bytes], count: int,
          seconds: float, hosts: list[str]) -> int:  # fmt: skip
    """Send ``count`` datagrams over ``seconds``, round robin over ``hosts``."""
    sockets = []
    for host in hosts:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind((host, 0))
        sockets.append(s)
    sent = 0
    t0 = time.monotonic()
    try:
        for i in range(count):
            due = t0 + seconds * i / count
            delay = due - time.monotonic()
            if delay > 0.002:
                time.sleep(delay)
            with contextlib.suppress(BlockingIOError, OSError):
                sockets[i % len(sockets)].sendto(datagrams(i), target)
                sent += 1
    finally:
        for s in sockets:
            s.close()
    return sent


class Bench:
    def __init__(
        self, workdir: Path, quick: bool, settle_s: float, only: set[str] | None = None
    ) -> None:
        self.quick = quick
        self.only = only
        self.settle_s = settle_s
        self.cluster = LocalCluster(None, NAMES, workdir, config_toml=CONFIG)
        self.phases: list[Phase] = []
        self.trainers: dict[str, Trainer] = {}
        self.liar: Liar | None = None
        self.reflected: list[bytes] = []
        self.peers: dict[str, str] = {}

    def address(self, name: str) -> str:
        return f"127.0.0.1:{self.cluster.base_port + NAMES.index(name)}"

    def target(self) -> tuple[str, int]:
        return ("127.0.0.1", self.cluster.base_port)

    def status(self, name: str) -> dict[str, Any]:
        return request(self.cluster.control(name), {"cmd": "status"}, timeout_s=10)

    async def run_phase(self, name: str, attack: Callable[[Phase], Awaitable[None]]) -> None:
        phase = Phase(name)
        phase.start = time.time()
        await attack(phase)
        await asyncio.sleep(max(0.0, phase.start + MIN_PHASE_S - time.time()))
        phase.end = time.time()
        self.phases.append(phase)
        print(f"  {name}: {phase.end - phase.start:.1f} s, {phase.sent} sent", flush=True)
        await asyncio.sleep(self.settle_s)  # the RSS after it, the updates delivered

    # -- floods ------------------------------------------------------------------------

    async def fake_initials(self, phase: Phase) -> None:
        count, seconds = (20_000, 6.0) if self.quick else (200_000, 60.0)
        template = bytearray(long_header(1, rng=random.Random(1)))

        def initial(i: int) -> bytes:
            template[6:14] = i.to_bytes(8, "little")  # a new connection ID each time
            return bytes(template)

        phase.sent = await asyncio.to_thread(
            flood, self.target(), initial, count, seconds, source_hosts(1024, first_octet=1)
        )

    async def unsupported_versions(self, phase: Phase) -> None:
        rng = random.Random(2)
        pool = [long_header(0x1A2A3A4A + i, rng=rng) for i in range(256)]
        count = 2_000 if self.quick else 20_000
        phase.sent = await asyncio.to_thread(
            flood, self.target(), lambda i: pool[i % len(pool)], count, MIN_PHASE_S,
            source_hosts(1024, first_octet=3),
        )  # fmt: skip

    async def idle_handshakes(self, phase: Phase) -> None:
        hosts = source_hosts(50 if self.quick else 500, first_octet=4)
        clients: list[RawClient] = []

        async def one(host: str) -> None:
            with contextlib.suppress(TimeoutError, OSError):
                clients.append(await RawClient.connect(self.target(), local_host=host, timeout_s=3))

        for i in range(0, len(hosts), 50):
            await asyncio.gather(*(one(h) for h in hosts[i : i + 50]))
        phase.sent = len(hosts)
        phase.notes["handshakes_completed"] = len(clients)
        await asyncio.sleep(3)  # each held until the node's auth timeout closes it
        for c in clients:
            c.close()

    # -- member attacks ----------------------------------------------------------------

    async def accusations(self, phase: Phase) -> None:
        liar = self._liar()
        b = self.peers["b"]
        for name in ("a", "c"):
            await liar.gossip(
                name, Suspect(b, MAX_INCARNATION, liar.peer_id), Dead(b, MAX_INCARNATION, "x")
            )
            for u in (Suspect(b, 2**64 - 1, liar.peer_id), Dead(b, 2**64 - 1, liar.peer_id)):
                raw = _raw_gossip(liar.peer_id, encode_update(u))
                await liar.frame(name, FrameType.GOSSIP, raw)
                phase.sent += 1
            phase.sent += 2
        await asyncio.sleep(3)

    async def heads_mute(self, phase: Phase) -> None:
        liar = self._liar()
        a = self.peers["a"]
        session = max(
            (h >> 40 for m in liar.received if isinstance(m.body, Heads)
             for o, h in m.body.heads if o == a),
            default=0,
        )  # fmt: skip
        for _ in range(30):
            for name in ("b", "c"):
                await liar.say(name, Heads(((a, ((session + 5) << 40) | 7),)))
                phase.sent += 1
            await asyncio.sleep(0.1)

    async def forged_chunks(self, phase: Phase) -> None:
        liar = self._liar()
        a = self.peers["a"]
        heads = [h for m in liar.received if isinstance(m.body, Heads)
                 for o, h in m.body.heads if o == a]  # fmt: skip
        nxt = max(heads, default=1) + 1
        run = run_id_of(RUN)
        presence = [
            encode_presence(TrainKind.GONE, run),
            encode_presence(TrainKind.JOIN, run, 1_000_000),
            encode_done(run, 10, 0),
        ]
        real = [m.body for m in liar.received if isinstance(m.body, Chunk)][-10:]
        for round_ in range(30):
            forged = [
                Chunk(a, nxt + round_ * 3 + i, 0, presence[i], bytes(64)) for i in range(3)
            ] + [liar.signed_chunk(Chunk(a, nxt + round_ * 3 + 1, 0, presence[0]))]
            for name in ("b", "c"):
                await liar.say(name, *forged, *real)
                phase.sent += len(forged) + len(real)
            await asyncio.sleep(0.1)
        phase.notes["replayed"] = len(real)

    async def address_hijack(self, phase: Phase) -> None:
        liar = self._liar()
        b = self.peers["b"]
        hijack = Alive(b, 1000, liar.address, "elsewhere", bytes(64))
        for name in ("a", "c"):
            await liar.gossip(name, hijack, Alive(b, 1001, liar.address, "", liar.key.sign(b"x")))
            phase.sent += 2
        await asyncio.sleep(3)

    async def store_get_repeats(self, phase: Phase) -> None:
        liar = self._liar()
        data = os.urandom(8 * MiB)
        blob = self.cluster.workdir / "blob"
        blob.write_bytes(data)
        answer = await asyncio.to_thread(
            request,
            self.cluster.control("a"),
            {"cmd": "store_put", "name": "blob", "path": str(blob), "local": True, "version": 1},
        )
        assert answer["ok"], answer
        manifest = Manifest.build("blob", 1, data, 256 * 1024)
        for i in range(16):
            get = Get("blob", 1, manifest.root, (i,) * 256)
            await liar.frame("a", FrameType.STORE_CONTROL, encode(get))
            phase.sent += 1
        await asyncio.sleep(3)

    async def huge_offers(self, phase: Phase) -> None:
        liar = self._liar()
        done = asyncio.get_running_loop().create_task(
            asyncio.to_thread(
                request,
                self.cluster.control("b"),
                {"cmd": "store_get", "name": "nothing", "path": str(self.cluster.workdir / "x")},
                30.0,
            )
        )  # fmt: skip
        answered: set[int] = set()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            for _, payload in list(liar.store_frames):
                msg = decode(payload)
                if isinstance(msg, Query) and msg.token not in answered:
                    answered.add(msg.token)
                    for _ in range(2):
                        hashes = (bytes(32),) * 512
                        manifest = Manifest(msg.name, 9, 512 * MiB, MiB, bytes(32), hashes)
                        await liar.frame(
                            "b", FrameType.STORE_DATA, encode(Offer(msg.token, 0, manifest))
                        )
                        phase.sent += 1
            await asyncio.sleep(0.05)
        phase.notes["queries_answered"] = len(answered)
        phase.notes["store_frames_at_liar"] = len(liar.store_frames)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(done, 30)

    async def made_up_members(self, phase: Phase) -> None:
        liar = self._liar()
        fakes = [peer_id_of(NodeKey.generate().public_key) for _ in range(2700)]
        for start in range(0, len(fakes), 300):
            batch = fakes[start : start + 300]
            await liar.gossip("a", *(Alive(f, 1, liar.address, "", bytes(64)) for f in batch))
            phase.sent += len(batch)
        await asyncio.sleep(3)
        status = await asyncio.to_thread(self.status, "a")
        phase.notes["members_at_a"] = len(status["members"])

    async def ping_req_reflection(self, phase: Phase) -> None:
        liar = self._liar()
        loop = asyncio.get_running_loop()
        bench = self

        class Victim(asyncio.DatagramProtocol):
            def datagram_received(self, data: bytes, addr: Any) -> None:
                bench.reflected.append(data)

        victim, _ = await loop.create_datagram_endpoint(Victim, local_addr=("127.0.0.1", 0))
        where = "127.0.0.1:{}".format(victim.get_extra_info("sockname")[1])
        fake = peer_id_of(NodeKey.generate().public_key)
        try:
            for i in range(20):
                for name in ("a", "c"):
                    await liar.say(
                        name, PingReq(i, self.peers["b"], where), PingReq(i, fake, where)
                    )
                    await liar.gossip(name, Alive(fake, 1, where, "", bytes(64)))
                    phase.sent += 3
                await asyncio.sleep(0.1)
            await asyncio.sleep(2)
        finally:
            victim.close()
        phase.notes["reflected_datagrams"] = len(self.reflected)

    async def credit_bomb(self, phase: Phase) -> None:
        liar = self._liar()
        with contextlib.suppress(Exception):
            await liar.frame("a", FrameType.CREDIT, struct.pack("<Q", 1 << 63))
        phase.sent = 1
        await asyncio.sleep(3)

    async def certificate_flood(self, phase: Phase) -> None:
        liar = self._liar()
        seconds = 5.0 if self.quick else 20.0
        assert self.cluster.ca is not None
        pool = await asyncio.to_thread(fresh_certificates, 5000, self.cluster.ca.cluster)
        per_frame = (MAX_MESSAGE_BYTES - 256) // update_size(pool[0])
        pid = self.cluster.daemons["a"].pid
        # The same daemon, the same trainers, no flood: the baseline window.
        t0, cpu0 = time.time(), cpu_s(pid)
        await asyncio.sleep(seconds)
        t1, cpu1 = time.time(), cpu_s(pid)
        sent = dropped = 0
        while time.time() < t1 + seconds:
            start = (sent * per_frame) % len(pool)
            try:
                await liar.gossip("a", *(pool + pool)[start : start + per_frame])
            except TransportError:  # a saturated victim acknowledges nothing: link again
                liar.links.pop("a", None)
                dropped += 1
            sent += 1
            await asyncio.sleep(max(0.0, t1 + sent / 40 - time.time()))
        t2, cpu2 = time.time(), cpu_s(pid)
        phase.sent = sent * per_frame
        await asyncio.sleep(2)  # the last frames read
        status = await asyncio.to_thread(self.status, "a")
        flood = (cpu2 - cpu1) / (t2 - t1)
        base = (cpu1 - cpu0) / (t1 - t0)
        phase.notes.update(
            frames=sent,
            liar_links_dropped=dropped,
            certificates_per_frame=per_frame,
            victim_core_fraction=round(flood, 3),
            baseline_core_fraction=round(base, 3),
            flood_victim_core_fraction=round(flood - base, 3),
            victim_update_p50_ms=self._update_p50_ms("a", t1, t2),
            baseline_update_p50_ms=self._update_p50_ms("a", t0, t1),
            credentials_at_a=status.get("credentials", {}),
        )

    def _update_p50_ms(self, name: str, start: float, end: float) -> float | None:
        """The median delay of the others' updates published in [start, end] to
        ``name``'s trainer."""
        at = self.trainers[name]
        delays = [
            at.received[(t.peer, step)] - when
            for other, t in self.trainers.items()
            if other != name
            for step, when in t.published.items()
            if start <= when <= end and (t.peer, step) in at.received
        ]
        p50 = median(delays)
        return None if p50 is None else round(p50 * 1000, 1)

    def _liar(self) -> Liar:
        assert self.liar is not None
        return self.liar

    # -- the run -------------------------------------------------------------------------

    async def run(self) -> dict[str, Any]:
        c = self.cluster
        c.start(timeout_s=90)
        self.peers = {n: self.status(n)["peer"] for n in NAMES}
        honest = set(self.peers.values())
        audit0 = {n: dir_bytes(c.state_dir(n) / "audit") for n in NAMES}
        sampler = RssSampler({n: c.daemons[n].pid for n in NAMES})
        for n in NAMES:
            self.trainers[n] = Trainer(c.trainer_socket(n))
        assert c.ca is not None
        self.liar = Liar(c.ca, self.address)
        await self.liar.start()
        await self.liar.join(*NAMES)
        await asyncio.sleep(3)  # trainers publishing, the liar a member everywhere
        attacks: list[Callable[[Phase], Awaitable[None]]] = [
            self.fake_initials, self.unsupported_versions, self.idle_handshakes,
            self.accusations, self.heads_mute, self.forged_chunks, self.address_hijack,
            self.store_get_repeats, self.huge_offers, self.made_up_members,
            self.ping_req_reflection, self.credit_bomb, self.certificate_flood,
        ]  # fmt: skip
        if self.only is not None:
            attacks = [a for a in attacks if a.__name__ in self.only]
        try:
            for attack in attacks:
                await self.run_phase(attack.__name__, attack)
            await asyncio.sleep(max(0.0, 5.0 - self.settle_s))
        finally:
            await self.liar.close()
            for t in self.trainers.values():
                t.close()
            sampler.close()
        running = sum(c.daemons[n].poll() is None for n in NAMES)
        events = {n: member_events(c.state_dir(n) / "daemon.log", honest) for n in NAMES}
        rows = [self._row(p, sampler, events) for p in self.phases]
        audit = {n: (dir_bytes(c.state_dir(n) / "audit") - audit0[n]) / MiB for n in NAMES}
        fractions = [
            r["flood_victim_core_fraction"] for r in rows if "flood_victim_core_fraction" in r
        ]
        flood_fraction = fractions[0] if fractions else None
        c.stop()
        return {
            "daemons_running": running,
            "daemons": len(NAMES),
            "false_dead": sum(r["false_dead"] for r in rows),
            "false_suspect": sum(r["false_suspect"] for r in rows),
            "rss_growth_mb_max": max(max(r["rss_growth_mb"].values()) for r in rows),
            "rss_after_mb_max": max(max(r["rss_after_mb"].values()) for r in rows),
            "audit_growth_mb_max": round(max(audit.values()), 3),
            "updates_missed": sum(r["updates_missed"] for r in rows),
            "updates_published_min": min(r["updates_published"] for r in rows),
            "reflected_datagrams": len(self.reflected),
            "flood_victim_core_fraction": flood_fraction,
            "settle_s": self.settle_s,
            "quick": self.quick,
            "attacks": rows,
        }

    def _row(
        self, p: Phase, sampler: RssSampler, events: dict[str, list[tuple[float, str, str]]]
    ) -> dict[str, Any]:
        window_end = p.end + min(self.settle_s, 5.0)
        seen = [e for evs in events.values() for e in evs if p.start <= e[0] <= window_end]
        growth, after = {}, {}
        for n in NAMES:
            before = sampler.at(n, p.start)
            growth[n] = round((sampler.peak(n, p.start, p.end) - before) / MiB, 1)
            after[n] = round((sampler.at(n, p.end + self.settle_s) - before) / MiB, 1)
        missed = published = 0
        for n, t in self.trainers.items():
            others = [o for o in NAMES if o != n]
            for step, when in t.published.items():
                if not p.start <= when <= p.end:
                    continue
                published += 1
                deadline = p.end + 5.0
                if any(
                    self.trainers[o].received.get((t.peer, step), float("inf")) > deadline
                    for o in others
                ):
                    missed += 1
        return {
            "attack": p.name,
            "seconds": round(p.end - p.start, 1),
            "sent": p.sent,
            "false_dead": sum(1 for e in seen if e[1] == "member_dead"),
            "false_suspect": sum(1 for e in seen if e[1] == "member_suspect"),
            "rss_growth_mb": growth,
            "rss_after_mb": after,
            "updates_published": published,
            "updates_missed": missed,
            **p.notes,
        }


def _raw_gossip(sender: str, update: bytes) -> bytes:
    name = sender.encode()
    return bytes([VERSION, MeshKind.GOSSIP, len(name)]) + name + struct.pack("<H", 1) + update


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object last")
    ap.add_argument("--quick", action="store_true", help="floods a tenth, settles of 3 s")
    ap.add_argument("--settle-s", type=float, help="wait after each attack (30; quick: 3)")
    ap.add_argument("--keep", type=Path, help="keep the daemons' state and logs here")
    ap.add_argument("--only", help="run only these attacks (names, comma-separated)")
    ap.add_argument("--no-training", action="store_true", help="skip the training section")
    ap.add_argument(
        "--train-steps", type=int, default=hostile_training.STEPS, help="training section's steps"
    )
    args = ap.parse_args()
    settle = args.settle_s if args.settle_s is not None else (3.0 if args.quick else 30.0)
    workdir = args.keep or Path(tempfile.mkdtemp(prefix="ciuic-hostile-"))
    only = None if args.only is None else set(args.only.split(","))
    training_names = {a.name for a in hostile_training.ATTACKS} | {
        "store_replacement",
        "false_links",
    }
    result: dict[str, Any] = {}
    if only is None or only - training_names:
        bench = Bench(workdir, args.quick, settle, None if only is None else only - training_names)
        result = asyncio.run(bench.run())
    if not args.no_training and (only is None or only & training_names):
        chosen = None if only is None else sorted(only & training_names)
        training = hostile_training.training_section(
            chosen, steps=args.train_steps, keep=args.keep / "training" if args.keep else None
        )
        result["training"] = training
        for key in hostile_training.HEADLINE:
            if key in training:
                result[key] = training[key]
    result["machine"] = f"{os.cpu_count()} cores"
    if args.json:
        print(json.dumps(result))
    else:
        print(json.dumps(result, indent=1))
    ok = result.get("daemons_running", len(NAMES)) == len(NAMES) and not result.get("false_dead")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
