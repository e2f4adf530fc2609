"""Two ``ciuic-node run`` daemons with ``transport.lanes = 3``, as a user runs them."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from ciuic_p2p.daemon.control import request
from ciuic_p2p.lab.cluster import LocalCluster
from tests.procs import running

pytestmark = pytest.mark.processes

CONFIG = """preset = "local"

[transport]
lanes = 3

[log]
level = "warning"
"""


@pytest.mark.timeout(180)
def test_daemons_carry_chunks_over_their_lanes_and_leave_none_behind(tmp_path: Path) -> None:
    with LocalCluster(None, ["n0", "n1"], tmp_path / "c", CONFIG) as cluster:
        cluster.start()
        deadline = time.monotonic() + 60

        def status(name: str) -> dict:  # type: ignore[type-arg]
            answer = request(cluster.control(name), {"cmd": "status"}, timeout_s=10)
            assert answer.get("ok"), answer
            return answer

        def both_lanes_up(name: str) -> bool:
            # "paired" lists a peer once any of its lanes is up; a lane dialled late
            # (a busy machine) would see no chunk, so wait for both.
            paired = status(name)["lanes"]["paired"]
            return bool(paired) and all(len(up) == 2 for up in paired.values())

        while not all(both_lanes_up(n) for n in ("n0", "n1")):
            assert time.monotonic() < deadline, "lanes never paired"
            time.sleep(0.05)
        for _ in range(24):
            answer = request(cluster.control("n0"), {"cmd": "broadcast", "size": 1 << 20})
            assert answer.get("ok"), answer
        while status("n1")["counters"].get("chunks_delivered", 0) < 24:
            assert time.monotonic() < deadline, "chunks not delivered"
            time.sleep(0.05)
        lanes = status("n1")["lanes"]
        assert lanes["lanes"] == 3 and len(lanes["pids"]) == 2
        # The chunks came over the lane processes and the link, each verified once. A
        # chunk takes the lane with the fewest bytes queued, the first of equals
        # (tests/core/test_lanewire.py): sent one request at a time, each may drain
        # before the next comes, and the first lanes take them all (CI saw [9, 0]).
        assert sum(lanes["frames_by_lane"]) > 0
        assert sum(lanes["frames_by_lane"]) + lanes["counters"]["link_frames_received"] >= 24
        pids = lanes["pids"] + status("n0")["lanes"]["pids"]
        cluster.stop()
    deadline = time.monotonic() + 30
    while any(map(running, pids)):
        assert time.monotonic() < deadline, "a lane outlived its daemon"
        time.sleep(0.05)
