"""One emulated node as its own process: ``python -m ciuic_p2p.emulator.node``.

Started with a scenario file and its node name; node i of the scenario listens on
127.0.0.1:(base_port + i), so every process knows every address from the scenario
alone, and ``--start`` (a time.monotonic value, system-wide) aligns their schedules;
``--nodes N`` limits the mesh to the scenario's first N nodes.
It answers pings and, driven line by line on stdin, measures its own:

    ping K     ping every other node K times; print "rtt {json}" (median seconds)
    quit       exit

It prints "ready NAME" once listening, and exits cleanly on SIGTERM or end of input.
The daemon (`ciuic-node run`) will take the same flags once it exists.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import sys
import time

from ciuic_p2p.emulator.mesh import EmulatedMesh, PingNode
from ciuic_p2p.emulator.netns import address as netns_address
from ciuic_p2p.emulator.scenarios import load_scenario


async def serve(args: argparse.Namespace) -> int:
    scenario = load_scenario(args.scenario)
    names = scenario.node_names()[: args.nodes or None]
    if args.name not in names:
        print(f"error: {args.name!r} is not a node of {args.scenario}", file=sys.stderr)
        return 2
    mesh = EmulatedMesh(scenario, start=args.start)
    for i, name in enumerate(names):
        mesh.register(name, _address(args, i))
    me = await PingNode.start(
        mesh, args.name, _address(args, names.index(args.name)), shape=not args.netns
    )
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    print(f"ready {args.name}", flush=True)

    async def commands() -> None:
        while not stop.is_set():
            line = (await reader.readline()).decode().strip()
            if not line or line == "quit":
                stop.set()
                return
            if line.startswith("ping"):
                count = int(line.split()[1]) if len(line.split()) > 1 else 5
                result = {}
                for peer in names:
                    if peer == args.name:
                        continue
                    samples = []
                    for _ in range(count):
                        rtt = await me.ping(peer, 2 * scenario.rtt_s(args.name, peer) + 1.0)
                        if rtt is not None:
                            samples.append(rtt)
                    result[peer] = statistics.median(samples) if samples else None
                print("rtt " + json.dumps(result), flush=True)

    task = loop.create_task(commands())
    await stop.wait()
    task.cancel()
    me.close()
    return 0


def _address(args: argparse.Namespace, index: int) -> tuple[str, int]:
    if args.netns:  # inside the namespaces of emulator.netns: the kernel shapes
        return (netns_address(index), args.base_port)
    return ("127.0.0.1", args.base_port + index)


def main() -> int:
    ap = argparse.ArgumentParser(description="one emulated node (a test program)")
    ap.add_argument("--scenario", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--base-port", type=int, required=True)
    ap.add_argument("--start", type=float, default=None, help="time zero (time.monotonic)")
    ap.add_argument("--nodes", type=int, default=0, help="use the first N nodes (0: all)")
    ap.add_argument(
        "--netns",
        action="store_true",
        help="run inside the namespaces of `ciuic-node netem`: kernel netem shapes, not us",
    )
    args = ap.parse_args()
    if args.start is None:
        args.start = time.monotonic()
    return asyncio.run(serve(args))


if __name__ == "__main__":
    sys.exit(main())
