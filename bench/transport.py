#!/usr/bin/env python3
"""Transport benchmark: goodput of signed chunk frames over QUIC on loopback.

Sender and receiver run in separate processes; the sender signs every chunk and the
receiver verifies every signature (ChunkFilter) before counting it. Measured in one run:

- ciuic's transport with the defaults (qh3, uvloop, UDP GSO, datagrams of at most
  1452 bytes), then with one of them changed per row: without GSO, on asyncio's
  default loop, on aioquic (the defaults and aioquic alternate ``--repeats`` times;
  ``backend_over_aioquic_cpu`` is the median ratio of neighbouring runs);
- bare aioquic and bare qh3, default settings, default loop, one stream (references);
- handshake plus authentication time, CPU seconds per MB, chunk sign/verify rates.

    python bench/transport.py --mb 200 --json
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime as dt
import json
import multiprocessing as mp
import os
import ssl
import statistics
import sys
import time
from typing import Any

from cryptography.hazmat.primitives import serialization

from ciuic_p2p.admission import ClusterCA, Trust
from ciuic_p2p.config import TransportSection
from ciuic_p2p.core.codec.chunk import ChunkHeader, Codec, IndexCode, build_chunk
from ciuic_p2p.core.codec.origin import ChunkFilter, sign_chunk, verify_chunk
from ciuic_p2p.core.link.frames import FrameType
from ciuic_p2p.identity import NodeKey
from ciuic_p2p.transport.backend import ED25519_SIGNATURE
from ciuic_p2p.transport.base import FrameReceived
from ciuic_p2p.transport.laned import LanedTransport
from ciuic_p2p.transport.loop import new_event_loop
from ciuic_p2p.transport.quic import QuicTransport

CHUNK_PAYLOAD = 1 << 20
SETTINGS = TransportSection(max_datagram_size=1452)


def _loop(kind: str) -> asyncio.AbstractEventLoop:
    return new_event_loop() if kind == "uvloop" else asyncio.new_event_loop()


def _credentials(ca: ClusterCA) -> tuple[bytes, bytes]:
    key = NodeKey.generate()
    cert = ca.issue(key.public_key, dt.datetime.now(dt.UTC))
    return key.to_pem(), cert.public_bytes(serialization.Encoding.PEM)


def _node(
    cred: tuple[bytes, bytes], ca_pem: bytes, backend: str = "qh3", gso: bool = True
) -> QuicTransport:
    from cryptography import x509  # noqa: PLC0415

    key = NodeKey(serialization.load_pem_private_key(cred[0], None))  # type: ignore[arg-type]
    cert = x509.load_pem_x509_certificate(cred[1])
    trust = Trust(x509.load_pem_x509_certificate(ca_pem))
    settings = dataclasses.replace(SETTINGS, quic_backend=backend, udp_gso=gso)  # type: ignore[arg-type]
    return QuicTransport(key, cert, trust, settings=settings)


def receiver_main(
    cred: Any, ca_pem: bytes, loop_kind: str, conn: Any, backend: str, gso: bool
) -> None:
    async def run() -> None:
        node = _node(cred, ca_pem, backend, gso)
        host, port = await node.start()
        conn.send((host, port, node.local_key))
        inbox = ChunkFilter()
        total = conn.recv()
        got = 0
        cpu0 = time.process_time()
        while got < total:
            event = await node.next_event()
            if isinstance(event, FrameReceived) and event.type is FrameType.CHUNK:
                if inbox.admit(event.payload) is None:
                    raise SystemExit("chunk refused by the receiver")
                got += 1
        await node.send(event.peer, FrameType.GOSSIP, b"done")
        conn.send(time.process_time() - cpu0)
        await asyncio.sleep(0.2)
        await node.close()

    loop = _loop(loop_kind)
    loop.run_until_complete(run())


async def _send_signed_chunks(node: QuicTransport, peer: bytes, n_chunks: int) -> None:
    """Sign and send ``n_chunks`` distinct 1 MiB chunks, then wait for the receiver's
    "done" (it has verified every one)."""
    payload = os.urandom(CHUNK_PAYLOAD)
    for step in range(n_chunks):
        chunk = build_chunk(_header(node.local_key, step), [payload])
        sign_chunk(chunk, node.key)
        await node.send(peer, FrameType.CHUNK, bytes(chunk))
    while True:
        event = await node.next_event()
        if isinstance(event, FrameReceived) and event.payload == b"done":
            return


def run_ciuic(
    ca: ClusterCA, loop_kind: str, n_chunks: int, backend: str = "qh3", gso: bool = True
) -> dict[str, float]:
    ca_pem = ca.certificate.public_bytes(serialization.Encoding.PEM)
    parent, child = mp.Pipe()
    proc = mp.get_context("spawn").Process(
        target=receiver_main, args=(_credentials(ca), ca_pem, loop_kind, child, backend, gso)
    )
    proc.start()
    host, port, _ = parent.recv()
    parent.send(n_chunks)
    sender_cred = _credentials(ca)

    async def send() -> dict[str, float]:
        node = _node(sender_cred, ca_pem, backend, gso)
        await node.start()
        t0 = time.perf_counter()
        peer = await node.connect((host, port))
        handshake_ms = (time.perf_counter() - t0) * 1e3
        cpu0 = time.process_time()
        t0 = time.perf_counter()
        await _send_signed_chunks(node, peer, n_chunks)
        elapsed = time.perf_counter() - t0
        sender_cpu = time.process_time() - cpu0
        await node.close()
        return {"elapsed_s": elapsed, "handshake_ms": handshake_ms, "sender_cpu_s": sender_cpu}

    loop = _loop(loop_kind)
    try:
        result = loop.run_until_complete(send())
    finally:
        loop.close()
    result["receiver_cpu_s"] = parent.recv()
    proc.join(10)
    mb = n_chunks * (CHUNK_PAYLOAD + 184) / 1e6
    result["goodput_MBps"] = mb / result["elapsed_s"]
    result["cpu_s_per_MB"] = (result["sender_cpu_s"] + result["receiver_cpu_s"]) / mb
    return result


def _header(origin: bytes, step: int, payload: int = CHUNK_PAYLOAD, bucket: int = 0) -> ChunkHeader:
    n = payload // 4
    return ChunkHeader(
        codec=Codec.DENSE_FP32,
        index_code=IndexCode.NONE,
        rice_bits=0,
        block_size=0,
        run_id=b"bench-transport!",
        origin=origin,
        incarnation=1,
        step=step,
        layout_id=1,
        bucket=bucket,
        range_start=0,
        range_len=n,
        count=n,
    )


def _address(node: QuicTransport | LanedTransport) -> tuple[str, int]:
    main = node if isinstance(node, QuicTransport) else node.main
    return main.address


def run_lane_pool(ca: ClusterCA, lanes: int, n_chunks: int) -> float:
    """Goodput (MB/s) of 1 MiB MESH_CHUNK frames between two nodes of ``lanes`` paths
    each (transport.laned: the link and ``lanes - 1`` lane processes; 1 is a plain
    QuicTransport). Both nodes' own loops share this process; each lane has its own."""

    async def run() -> float:
        now = dt.datetime.now(dt.UTC)
        nodes: list[QuicTransport | LanedTransport] = []
        for _ in range(2):
            key = NodeKey.generate()
            cert = ca.issue(key.public_key, now)
            main = QuicTransport(key, cert, Trust(ca.certificate), settings=SETTINGS)
            node = main if lanes == 1 else LanedTransport(main, key, cert, lanes)
            await node.start()
            nodes.append(node)
        sender, receiver = nodes
        got = 0
        done = asyncio.Event()

        async def read(node: QuicTransport | LanedTransport, count: bool) -> None:
            nonlocal got
            while True:
                event = await node.next_event()
                if count and isinstance(event, FrameReceived):
                    got += 1
                    if got == n_chunks:
                        done.set()

        readers = [
            asyncio.ensure_future(read(sender, False)),
            asyncio.ensure_future(read(receiver, True)),
        ]
        try:
            peer = await sender.connect(_address(receiver))
            for _ in range(2000):  # both sides hear the other's lanes (bounded)
                if all((n.lanes_status() or {"paired": 1})["paired"] for n in nodes):
                    break
                await asyncio.sleep(0.01)
            else:
                raise RuntimeError("lanes did not pair")
            payload = os.urandom(CHUNK_PAYLOAD)
            t0 = time.perf_counter()
            for step in range(n_chunks):
                await sender.send(peer, FrameType.MESH_CHUNK, step.to_bytes(8, "little") + payload)
            await asyncio.wait_for(done.wait(), 600)
            elapsed = time.perf_counter() - t0
        finally:
            for reader in readers:
                reader.cancel()
            for node in nodes:
                await node.close()
        return n_chunks * (CHUNK_PAYLOAD + 8) / 1e6 / elapsed

    loop = _loop("uvloop")
    try:
        return loop.run_until_complete(run())
    finally:
        loop.close()


# -- bare QUIC libraries -----------------------------------------------------------------
#
# The same harness for aioquic and qh3 (an aioquic fork with its TLS and crypto in
# Rust): their asyncio layers, default settings, one stream, so only the library differs.


def raw_receiver_main(total: int, conn: Any, library: str = "aioquic") -> None:
    import importlib  # noqa: PLC0415

    from cryptography.hazmat.primitives import serialization as ser  # noqa: PLC0415

    protocol = importlib.import_module(f"{library}.asyncio.protocol")
    server_mod = importlib.import_module(f"{library}.asyncio.server")
    configuration = importlib.import_module(f"{library}.quic.configuration")
    events = importlib.import_module(f"{library}.quic.events")

    ca = ClusterCA.create("raw", dt.datetime.now(dt.UTC))

    class Sink(protocol.QuicConnectionProtocol):  # type: ignore[misc,name-defined]
        got = 0

        def quic_event_received(self, event: Any) -> None:
            if isinstance(event, events.StreamDataReceived):
                Sink.got += len(event.data)
                if Sink.got >= total:
                    self._quic.send_stream_data(event.stream_id, b"!", end_stream=True)
                    self.transmit()

    async def run() -> None:
        conf = configuration.QuicConfiguration(is_client=False, alpn_protocols=["raw"])
        if library == "qh3":  # the CA's key is Ed25519, which qh3 does not offer unasked
            conf.signature_algorithms = [ED25519_SIGNATURE]
        import tempfile  # noqa: PLC0415

        with tempfile.TemporaryDirectory() as tmp:
            cert, key = os.path.join(tmp, "c.pem"), os.path.join(tmp, "k.pem")
            with open(cert, "wb") as f:
                f.write(ca.certificate.public_bytes(ser.Encoding.PEM))
            with open(key, "wb") as f:
                f.write(
                    ca.key.private_key.private_bytes(
                        ser.Encoding.PEM, ser.PrivateFormat.PKCS8, ser.NoEncryption()
                    )
                )
            conf.load_cert_chain(cert, key)
        server = await server_mod.serve("127.0.0.1", 0, configuration=conf, create_protocol=Sink)
        udp = server._transport
        assert udp is not None
        conn.send(udp.get_extra_info("sockname")[1])
        cpu0 = time.process_time()
        while Sink.got < total:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)
        conn.send(time.process_time() - cpu0)
        server.close()

    asyncio.run(run())


def run_raw(total: int, library: str = "aioquic") -> dict[str, float]:
    """Goodput and CPU per MB (sender plus receiver) of one library's bare harness."""
    import importlib  # noqa: PLC0415

    client_mod = importlib.import_module(f"{library}.asyncio.client")
    configuration = importlib.import_module(f"{library}.quic.configuration")

    parent, child = mp.Pipe()
    proc = mp.get_context("spawn").Process(target=raw_receiver_main, args=(total, child, library))
    proc.start()
    port = parent.recv()

    async def send() -> float:
        conf = configuration.QuicConfiguration(
            is_client=True, alpn_protocols=["raw"], verify_mode=ssl.CERT_NONE
        )
        if library == "qh3":
            conf.signature_algorithms = [ED25519_SIGNATURE]
        async with client_mod.connect("127.0.0.1", port, configuration=conf) as client:
            reader, writer = await client.create_stream()
            block = os.urandom(1 << 20)
            t0 = time.perf_counter()
            sent = 0
            while sent < total:
                writer.write(block)
                sent += len(block)
                if library == "qh3":  # its stream writer has no transport to drain
                    await asyncio.sleep(0)
                else:
                    await writer.drain()
            await reader.read()
            return time.perf_counter() - t0

    cpu0 = time.process_time()
    elapsed = asyncio.run(send())
    sender_cpu = time.process_time() - cpu0
    receiver_cpu = parent.recv()
    proc.join(10)
    return {
        "elapsed_s": elapsed,
        "goodput_MBps": total / 1e6 / elapsed,
        "cpu_s_per_MB": (sender_cpu + receiver_cpu) / (total / 1e6),
    }


def sign_verify_rates(reps: int = 50) -> dict[str, float]:
    key = NodeKey.generate()
    out: dict[str, float] = {}
    for label, size in (("", CHUNK_PAYLOAD), ("_4k", 4096)):
        chunk = build_chunk(_header(key.public_key, 0, size), [os.urandom(size)])
        t0 = time.perf_counter()
        for _ in range(reps):
            sign_chunk(chunk, key)
        out[f"sign_per_s{label}"] = reps / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        for _ in range(reps):
            verify_chunk(chunk)
        out[f"verify_per_s{label}"] = reps / (time.perf_counter() - t0)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--mb", type=int, default=200, help="megabytes per measurement")
    ap.add_argument("--lanes", type=int, default=2, help="parallel links for the multi-core row")
    ap.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="alternated runs of each compared pair (backends, lanes); ratios are the "
        "median of the pairs'",
    )
    args = ap.parse_args()
    n_chunks = max(1, args.mb * 1_000_000 // CHUNK_PAYLOAD)
    ca = ClusterCA.create("bench", dt.datetime.now(dt.UTC))
    chosen = TransportSection().quic_backend
    # The two backends alternate, each pair side by side in time: this machine's CPU
    # time per MB moves by 20% from minute to minute, a ratio of neighbours far less.
    pairs = [
        (
            run_ciuic(ca, "uvloop", n_chunks, chosen, gso=True),
            run_ciuic(ca, "uvloop", n_chunks, "aioquic", gso=True),
        )
        for _ in range(max(1, args.repeats))
    ]
    ratios = [a["cpu_s_per_MB"] / b["cpu_s_per_MB"] for a, b in pairs]
    mid = sorted(range(len(pairs)), key=lambda i: ratios[i])[len(pairs) // 2]
    # The rows differ in one thing each from the first (the product's defaults).
    rows = {
        "default": pairs[mid][0],
        "no_gso": run_ciuic(ca, "uvloop", n_chunks, chosen, gso=False),
        "asyncio_loop": run_ciuic(ca, "asyncio", n_chunks, chosen, gso=True),
        "aioquic": pairs[mid][1],
        "qh3": run_ciuic(ca, "uvloop", n_chunks, "qh3", gso=True),
    }
    raw = run_raw(n_chunks * CHUNK_PAYLOAD)
    raw_qh3 = run_raw(n_chunks * CHUNK_PAYLOAD, "qh3")
    handshakes = [run_ciuic(ca, "uvloop", 1)["handshake_ms"] for _ in range(3)]
    rates = sign_verify_rates()
    lane_pairs = [
        (run_lane_pool(ca, 1, n_chunks), run_lane_pool(ca, args.lanes, n_chunks))
        for _ in range(max(1, args.repeats))
    ]
    speedups = sorted(two / one for one, two in lane_pairs)
    one_lane_MBps = statistics.median(one for one, _ in lane_pairs)
    lanes_MBps = statistics.median(two for _, two in lane_pairs)
    uv = rows["default"]
    result = {
        "benchmark": "transport",
        "backend": chosen,
        "max_datagram_size": SETTINGS.max_datagram_size,
        "megabytes": n_chunks * CHUNK_PAYLOAD / 1e6,
        "goodput_MBps": uv["goodput_MBps"],
        "cpu_s_per_MB": uv["cpu_s_per_MB"],
        "no_gso_goodput_MBps": rows["no_gso"]["goodput_MBps"],
        "no_gso_cpu_s_per_MB": rows["no_gso"]["cpu_s_per_MB"],
        "gso_cpu_ratio": uv["cpu_s_per_MB"] / rows["no_gso"]["cpu_s_per_MB"],
        "goodput_default_loop_MBps": rows["asyncio_loop"]["goodput_MBps"],
        "cpu_s_per_MB_default_loop": rows["asyncio_loop"]["cpu_s_per_MB"],
        "aioquic_goodput_MBps": rows["aioquic"]["goodput_MBps"],
        "aioquic_cpu_s_per_MB": rows["aioquic"]["cpu_s_per_MB"],
        "qh3_goodput_MBps": rows["qh3"]["goodput_MBps"],
        "qh3_cpu_s_per_MB": rows["qh3"]["cpu_s_per_MB"],
        "qh3_over_aioquic_cpu": rows["qh3"]["cpu_s_per_MB"] / rows["aioquic"]["cpu_s_per_MB"],
        "backend_over_aioquic_cpu": statistics.median(ratios),
        "backend_over_aioquic_cpu_runs": ratios,
        "backend_cpu_s_per_MB_runs": [a["cpu_s_per_MB"] for a, _ in pairs],
        "aioquic_cpu_s_per_MB_runs": [b["cpu_s_per_MB"] for _, b in pairs],
        "raw_aioquic_MBps": raw["goodput_MBps"],
        "raw_aioquic_cpu_s_per_MB": raw["cpu_s_per_MB"],
        "ratio_vs_raw": uv["goodput_MBps"] / raw["goodput_MBps"],
        "raw_qh3_MBps": raw_qh3["goodput_MBps"],
        "raw_qh3_cpu_s_per_MB": raw_qh3["cpu_s_per_MB"],
        "handshake_ms": statistics.median([*handshakes, uv["handshake_ms"]]),
        **rates,
        "lanes": args.lanes,
        "one_lane_goodput_MBps": one_lane_MBps,
        "lanes_goodput_MBps": lanes_MBps,
        "lanes_speedup": statistics.median(speedups),
        "lanes_speedup_runs": speedups,
        "cpus": os.cpu_count(),
    }
    labels = {
        "default": f"ciuic, {chosen}, uvloop, GSO (the defaults)",
        "no_gso": "  the same without GSO",
        "asyncio_loop": "  the same on asyncio's default loop",
        "aioquic": "ciuic on aioquic (uvloop, GSO)",
        "qh3": "ciuic on qh3 (uvloop, GSO)",
    }
    for name, row in rows.items():
        print(
            f"{labels[name]:44s} {row['goodput_MBps']:6.1f} MB/s  "
            f"{row['cpu_s_per_MB'] * 1e3:6.1f} ms CPU/MB"
        )
    for library, row in (("aioquic", raw), ("qh3", raw_qh3)):
        print(
            f"{'bare ' + library + ', one stream, default loop':44s} "
            f"{row['goodput_MBps']:6.1f} MB/s  {row['cpu_s_per_MB'] * 1e3:6.1f} ms CPU/MB"
        )
    print(
        f"handshake+auth {result['handshake_ms']:7.1f} ms; sign {rates['sign_per_s']:.0f}/s, "
        f"verify {rates['verify_per_s']:.0f}/s (1 MiB chunks)"
    )
    print(
        f"{chosen} over aioquic, CPU per MB, alternated pairs: "
        + ", ".join(f"{r:.3f}" for r in ratios)
        + f" (median {result['backend_over_aioquic_cpu']:.3f})"
    )
    print(
        f"lane pool: 1 lane {one_lane_MBps:.1f} MB/s, {args.lanes} lanes {lanes_MBps:.1f} MB/s "
        f"on {os.cpu_count()} CPUs (median of pairs {result['lanes_speedup']:.2f}x)"
    )
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
