"""The peers of bench/compare.py, one system per process.

    python bench/support/compare_peers.py gloo RANK ELEMENTS PORT OUT
    python bench/support/compare_peers.py hivemind RANK ELEMENTS COMPRESSION OUT [MADDR...]
    python bench/support/compare_peers.py ciuic 0 ELEMENTS DENSITY ROUNDS

A peer talks to the driver by lines: it prints ``@@ {json}`` (``addr``, ``ready``,
``done``, ``saved``, ``result``) and reads commands (``go``, ``save``, ``exit``) from
stdin. gloo and hivemind run one peer per process; the driver measures their CPU
time and socket bytes from outside. ciuic runs its four real daemons (QUIC,
membership, routing, forwarding) in one process, on loopback with no emulated delay
or rate, and measures itself: process CPU time and the daemons' UDP payload bytes.
hivemind and torch.distributed are imported inside functions, so that an environment
without them can still import and lint this module.
"""

from __future__ import annotations

import importlib
import json
import sys
import time
from typing import Any

import torch

PEERS = 4


def make_input(rank: int, elements: int, round_: int = 0) -> torch.Tensor:
    """Peer ``rank``'s update for round ``round_``: N(0, 1) fp32, seeded."""
    g = torch.Generator().manual_seed(1_000 * round_ + rank)
    return torch.randn(elements, generator=g)


def exact_mean(elements: int, round_: int = 0) -> torch.Tensor:
    total = make_input(0, elements, round_)
    for rank in range(1, PEERS):
        total.add_(make_input(rank, elements, round_))
    return total.div_(PEERS)


def rel_error(result: torch.Tensor, exact: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(result - exact) / torch.linalg.vector_norm(exact))


def emit(kind: str, **fields: Any) -> None:
    print("@@ " + json.dumps({"kind": kind, **fields}), flush=True)


def wait_for(command: str) -> None:
    while True:
        line = sys.stdin.readline()
        if not line:
            raise SystemExit(f"driver went away while waiting for {command!r}")
        if line.strip() == command:
            return
        if line.strip() == "exit":  # the driver gave up: leave now (hivemind's children too)
            raise SystemExit(f"told to exit while waiting for {command!r}")


def run_gloo(rank: int, elements: int, port: int, out: str) -> None:
    import torch.distributed as dist  # noqa: PLC0415

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=PEERS
    )
    t = make_input(rank, elements)
    warm = t.clone()  # a warm-up all-reduce of the same size: connections and buffers
    dist.all_reduce(warm)
    del warm
    emit("ready")
    wait_for("go")
    dist.all_reduce(t)
    t.div_(PEERS)
    emit("done", t=time.time())
    wait_for("save")
    t.numpy().tofile(out)
    emit("saved")
    wait_for("exit")
    dist.destroy_process_group()


def run_hivemind(rank: int, elements: int, compression: str, out: str, peers: list[str]) -> None:
    hivemind = importlib.import_module("hivemind")  # untyped; not in the dev environment
    hc = importlib.import_module("hivemind.compression")

    codec = {
        "none": hc.NoCompression(),
        "fp16": hc.Float16Compression(),
        "u8": hc.Uniform8BitQuantization(),
    }[compression]
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=peers)
    emit("addr", maddrs=[str(a) for a in dht.get_visible_maddrs()])
    averager = hivemind.averaging.DecentralizedAverager(
        [make_input(rank, elements)],
        dht,
        prefix=f"compare_{compression}",
        target_group_size=PEERS,
        min_group_size=PEERS,
        min_matchmaking_time=5.0,
        start=True,
        compression=codec,
    )
    wait_for("warm")
    averager.step(timeout=120)  # warm-up round: DHT keys, connections, then restore input
    with averager.get_tensors() as tensors:
        tensors[0].copy_(make_input(rank, elements))
    emit("ready")
    wait_for("go")
    gathered = averager.step(timeout=120)
    emit("done", t=time.time(), group=len(gathered) if gathered else 0)
    wait_for("save")
    with averager.get_tensors() as tensors:
        tensors[0].numpy().tofile(out)
    emit("saved")
    wait_for("exit")
    averager.shutdown()
    dht.shutdown()


def run_ciuic(elements: int, density: float, rounds: int) -> None:
    import asyncio  # noqa: PLC0415

    from ciuic_p2p.transport.loop import new_event_loop  # noqa: PLC0415

    loop = new_event_loop()
    try:
        result = loop.run_until_complete(_ciuic_rounds(elements, density, rounds, asyncio))
    finally:
        loop.close()
    emit("result", **result)


async def _ciuic_rounds(elements: int, density: float, rounds: int, asyncio: Any) -> dict[str, Any]:
    import dataclasses  # noqa: PLC0415

    from ciuic_p2p.config import Config, LogSection  # noqa: PLC0415
    from ciuic_p2p.core.codec.bucket import (  # noqa: PLC0415
        BucketEncoder,
        BucketSpec,
        ChunkSource,
        apply_chunk,
    )
    from ciuic_p2p.core.codec.chunk import Codec  # noqa: PLC0415
    from ciuic_p2p.core.mesh.broadcast import Delivery  # noqa: PLC0415
    from ciuic_p2p.daemon.node import ChunkRecorder  # noqa: PLC0415
    from ciuic_p2p.emulator.model.scenario import scenario_from_mapping  # noqa: PLC0415
    from ciuic_p2p.lab.daemons import DaemonMesh  # noqa: PLC0415
    from ciuic_p2p.logsetup import configure_logging  # noqa: PLC0415

    configure_logging(LogSection(level="error"))
    names = [f"p{i}" for i in range(PEERS)]
    scenario = scenario_from_mapping({"nodes": [{"name": n} for n in names]})
    config = Config.lan()  # one data centre: 1 MiB chunks
    spec = dataclasses.replace(
        BucketSpec.from_config(config.codec, elements, sparse=True),
        codec=Codec.SPARSE_INT8,
        density=density,
    )
    acc = {n: torch.zeros(elements) for n in names}
    applied = dict.fromkeys(names, 0)

    def recorder(who: str) -> ChunkRecorder:
        def deliver(d: Delivery) -> None:
            apply_chunk(d.payload, acc[who])
            applied[who] += 1

        return ChunkRecorder(deliver)

    async with DaemonMesh(scenario, names, config, observer=recorder, trainers=False) as mesh:
        await mesh.form()
        await asyncio.sleep(2.0)  # links probed, routes published

        def counters() -> dict[str, int]:
            total: dict[str, int] = {}
            for d in mesh.daemons.values():
                for k, v in d.counters.items():
                    total[k] = total.get(k, 0) + int(v)
            return total

        def encoders(seed: int) -> dict[str, BucketEncoder]:
            return {
                n: BucketEncoder(
                    0, elements, spec, ChunkSource(bytes(16), bytes([i]) * 32, 1, 1), seed=seed + i
                )
                for i, n in enumerate(names)
            }

        async def one_round(enc: dict[str, BucketEncoder], round_: int) -> dict[str, Any]:
            inputs = {n: make_input(i, elements, round_) for i, n in enumerate(names)}
            for n in names:
                acc[n].zero_()
                applied[n] = 0
            sent0 = sum(d.transport.udp_bytes_sent for d in mesh.daemons.values())
            counters0 = counters()
            cpu0, t0 = time.process_time(), time.monotonic()
            total, encode_s, payload = 0, 0.0, 0
            for n in names:  # one process: the four encodes run one after another
                e0 = time.monotonic()
                chunks = enc[n].encode(inputs[n], round_)
                encode_s += time.monotonic() - e0
                total += len(chunks)
                for c in chunks:
                    payload += len(c)
                    apply_chunk(c, acc[n])
                    applied[n] += 1
                    mesh.daemons[n].broadcast(bytes(c))
            await mesh.until(lambda: all(applied[n] == total for n in names), 300)
            wall, cpu = time.monotonic() - t0, time.process_time() - cpu0
            sent = sum(d.transport.udp_bytes_sent for d in mesh.daemons.values()) - sent0
            changed = {k: v - counters0.get(k, 0) for k, v in counters().items()}
            return {
                "wall": wall,
                "cpu": cpu,
                "bytes": sent,
                "encode": encode_s,
                "chunk": payload,
                "counters": {k: v for k, v in changed.items() if v},
            }

        await one_round(encoders(100), 0)  # warm-up round: QUIC connections, windows
        enc = encoders(0)
        rows, applied_sum, true_sum, first_error = [], None, None, 0.0
        for r in range(rounds):
            row = await one_round(enc, r)
            exact = exact_mean(elements, r)
            results = [acc[n] / PEERS for n in names]
            errors = [rel_error(x, exact) for x in results]
            if r == 0:
                first_error = max(errors)
            applied_sum = results[0] if applied_sum is None else applied_sum + results[0]
            true_sum = exact if true_sum is None else true_sum + exact
            rows.append(row)
        assert applied_sum is not None and true_sum is not None
        return {
            "rounds": rows,
            "error": first_error,
            "ef_error": rel_error(applied_sum, true_sum),
            "spread": max(float((acc[n] - acc[names[0]]).abs().max()) for n in names),
        }


def main(argv: list[str]) -> None:
    system, rank, elements = argv[0], int(argv[1]), int(argv[2])
    if system == "gloo":
        run_gloo(rank, elements, int(argv[3]), argv[4])
    elif system == "hivemind":
        run_hivemind(rank, elements, argv[3], argv[4], argv[5:])
    elif system == "ciuic":
        run_ciuic(elements, float(argv[3]), int(argv[4]))
    else:
        raise SystemExit(f"unknown system {system!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
