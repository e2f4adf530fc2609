"""What bench/recovery.py and bench/fetchload.py share: their node config, the node
farthest from the others, and one timed store fetch of a state-sized object held by
every other node, with each daemon's CPU and UDP receive-buffer drops (from /proc)."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path
from typing import Any

from ciuic_p2p.daemon.control import request
from ciuic_p2p.data import scenario_path
from ciuic_p2p.emulator.scenarios import load_scenario
from ciuic_p2p.lab.cluster import LocalCluster

CONFIG = """
[codec]
density = 0.01
[store]
fetch_timeout_s = 900
"""


def farthest(scenario: str, names: list[str]) -> str:
    sc = load_scenario(scenario_path(scenario)).subset(names)
    return max(names, key=lambda n: sum(sc.rtt_s(n, m) for m in names if m != n))


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def udp_rcvbuf_errors() -> int:
    """Datagrams this host dropped because a UDP socket's receive buffer was full (all
    sockets: the benchmark's daemons are the only UDP traffic here)."""
    rows = [line.split() for line in Path("/proc/net/snmp").read_text().splitlines()]
    names, values = [r for r in rows if r[0] == "Udp:"][:2]
    return int(values[names.index("RcvbufErrors")])


def socket_drops(pid: int) -> int:
    """Datagrams dropped on the full receive buffers of ``pid``'s UDP sockets."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        target = os.readlink(fd) if fd.is_symlink() else ""
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    drops = 0
    for table in ("/proc/net/udp", "/proc/net/udp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[9] in inodes:
                drops += int(cols[-1])
    return drops


def timed_fetch(
    c: LocalCluster, fetcher: str, holders: list[str], mb: float, at: Path, name: str
) -> dict[str, Any]:
    """``fetcher`` gets ``mb`` MB of random bytes that every one of ``holders`` holds
    (checked byte for byte); seconds, rate, each daemon's CPU seconds and drops."""
    blob, into = at / "blob", at / "blob.got"
    blob.write_bytes(random.randbytes(int(mb * 1e6)))
    for holder in holders:
        body = {"cmd": "store_put", "name": name, "path": str(blob), "local": True}
        answer = request(c.control(holder), body, timeout_s=120)
        assert answer.get("ok"), answer
    pids = {n: p.pid for n, p in c.daemons.items()}
    cpu0 = {n: cpu_s(pid) for n, pid in pids.items()}
    drops0 = udp_rcvbuf_errors()
    sock0 = {n: socket_drops(pid) for n, pid in pids.items()}
    t0 = time.monotonic()
    answer = request(
        c.control(fetcher), {"cmd": "store_get", "name": name, "path": str(into)}, timeout_s=900
    )
    seconds = time.monotonic() - t0
    assert answer.get("ok") and into.read_bytes() == blob.read_bytes(), answer
    blob.unlink()
    into.unlink()
    return {
        "seconds": seconds,
        "mbit_s": mb * 8 / seconds,
        "daemon_cpu_s": {n: round(cpu_s(pid) - cpu0[n], 2) for n, pid in pids.items()},
        "donors": len(answer.get("donors", {})),
        "udp_rcvbuf_drops": udp_rcvbuf_errors() - drops0,
        "daemon_drops": {n: socket_drops(pid) - sock0[n] for n, pid in pids.items()},
    }
