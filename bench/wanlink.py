#!/usr/bin/env python3
"""One QUIC link over a long emulated path: how much a single ciuic link carries.

A sender streams 1 MiB bulk frames to one peer for ``--seconds`` over a directed pair
of the 11-city scenario (default Singapore -> SaoPaulo: 327 ms RTT; rates scaled by
``--rate-scale``, 0.1 as in bench/recovery.py: 100 Mbit/s here), through the
user-space emulator on the real clock. Rows, side by side in one run: congestion
control ``cubic`` and ``reno`` (aioquic's), with no random loss and with 0.05% on
each direction. Both ends run on one event loop (one core), so the lossless rows
are bounded by this process's CPU, not by the link; the lossy rows by the
congestion controller. Figures: goodput (frame bytes the receiver got, per second,
slow start included), the window at the end and how many times it shrank.

    python bench/wanlink.py --json
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime as dt
import json
import os
import sys
import time
from typing import Any

from ciuic_p2p.admission import ClusterCA, Trust
from ciuic_p2p.config import CongestionControl, TransportSection
from ciuic_p2p.core.link.frames import FrameType
from ciuic_p2p.data import scenario_path
from ciuic_p2p.emulator.mesh import EmulatedMesh
from ciuic_p2p.emulator.scenarios import load_scenario
from ciuic_p2p.identity import NodeKey
from ciuic_p2p.transport.base import FrameReceived
from ciuic_p2p.transport.loop import new_event_loop
from ciuic_p2p.transport.quic import QuicTransport

FRAME_BYTES = 1 << 20


async def one_link(
    src_name: str,
    dst_name: str,
    rate_scale: float,
    loss: float,
    congestion: CongestionControl,
    seconds: float,
) -> dict[str, Any]:
    now = dt.datetime.now(dt.UTC)
    ca = ClusterCA.create("wanlink", now)
    scenario = load_scenario(scenario_path("cities11"), rate_scale=rate_scale)
    scenario = scenario.subset([src_name, dst_name])
    links = {k: v.with_changes(loss=loss) for k, v in scenario.links.items()}
    scenario = dataclasses.replace(scenario, links=links)
    mesh = EmulatedMesh(scenario)
    settings = TransportSection(congestion_control=congestion, stall_timeout_s=60.0)
    nodes: dict[str, QuicTransport] = {}
    for name in (src_name, dst_name):
        key = NodeKey.generate()
        node = QuicTransport(
            key,
            ca.issue(key.public_key, now),
            Trust(ca.certificate),
            settings=settings,
            wrap_udp=mesh.wrapper(name),
        )
        mesh.register(name, await node.start())
        nodes[name] = node
    src, dst = nodes[src_name], nodes[dst_name]
    received = 0

    async def receive() -> None:
        nonlocal received
        while True:
            event = await dst.next_event()
            if isinstance(event, FrameReceived) and event.type is FrameType.CHUNK:
                received += len(event.payload)

    payload = os.urandom(FRAME_BYTES)
    peer = await src.connect(mesh.addresses[dst_name])

    async def send() -> None:
        while True:
            await src.send(peer, FrameType.CHUNK, payload)

    link = src.connection(peer)
    assert link is not None
    cc = link.quic._loss._cc
    shrinks, last_window = 0, cc.congestion_window
    tasks = [asyncio.create_task(receive()), asyncio.create_task(send())]
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < seconds:
            await asyncio.sleep(0.05)
            for task in tasks:
                if task.done():
                    task.result()  # a transport error ends the row
            window = cc.congestion_window
            shrinks += window < last_window
            last_window = window
        elapsed = time.monotonic() - t0
    finally:
        for task in tasks:
            task.cancel()
        for node in nodes.values():
            await node.close()
    counters = mesh.network.links[(src_name, dst_name)].counters
    return {
        "congestion_control": congestion,
        "loss": loss,
        "goodput_MBps": received / elapsed / 1e6,
        "window_end_bytes": last_window,
        "window_shrinks": shrinks,
        "emulator_drops": counters.lost + counters.queue_drops,
        "datagrams": counters.sent,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--src", default="Singapore")
    ap.add_argument("--dst", default="SaoPaulo")
    ap.add_argument("--rate-scale", type=float, default=0.1)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--loss", type=float, default=0.0005, help="random loss of the lossy rows")
    args = ap.parse_args(argv)
    scenario = load_scenario(scenario_path("cities11"), rate_scale=args.rate_scale)
    params = scenario.params(args.src, args.dst)
    rows = []
    loop = new_event_loop()
    try:
        for loss in (0.0, args.loss):
            for congestion in ("cubic", "reno"):
                row = loop.run_until_complete(
                    one_link(args.src, args.dst, args.rate_scale, loss, congestion, args.seconds)
                )
                rows.append(row)
                print(
                    f"{congestion:6s} loss {loss * 100:5.2f}%  {row['goodput_MBps']:6.2f} MB/s"
                    f"  window {row['window_end_bytes'] / 1e3:7.0f} kB"
                    f"  shrank {row['window_shrinks']:3d}x  emulator drops {row['emulator_drops']}",
                    flush=True,
                )
    finally:
        loop.close()

    def goodput(congestion: str, loss: float) -> float:
        return next(
            float(r["goodput_MBps"])
            for r in rows
            if r["congestion_control"] == congestion and r["loss"] == loss
        )

    result = {
        "benchmark": "wanlink",
        "path": [args.src, args.dst],
        "rtt_ms": scenario.rtt_s(args.src, args.dst) * 1e3,
        "rate_MBps": (params.rate_bps or 0) / 8e6,
        "seconds": args.seconds,
        "rows": rows,
        "cubic_over_reno_lossy": goodput("cubic", args.loss) / goodput("reno", args.loss),
        "cubic_over_reno_lossless": goodput("cubic", 0.0) / goodput("reno", 0.0),
        "cpus": os.cpu_count(),
    }
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
