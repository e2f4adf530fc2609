"""Nodes as separate processes on loopback, each with the scenario file and its name."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from ciuic_p2p.core.scenario import load_scenario
from ciuic_p2p.data import scenario_path
from ciuic_p2p.emulator.processes import ProcessMesh


@pytest.fixture
def process_mesh() -> Iterator[ProcessMesh]:
    mesh = ProcessMesh(scenario_path("multicloud8"), nodes=4).start()
    try:
        yield mesh
    finally:
        mesh.stop()
    for proc in mesh.procs.values():
        assert proc.poll() is not None, "a node process outlived the fixture"


def test_separate_processes_see_the_scenario_rtts(process_mesh: ProcessMesh) -> None:
    scenario = load_scenario(scenario_path("multicloud8"))
    rtts = process_mesh.measure_rtts(pings=3)
    assert set(rtts) == set(process_mesh.names)
    for a, row in rtts.items():
        for b, rtt in row.items():
            want = scenario.rtt_s(a, b)
            assert rtt is not None and abs(rtt - want) <= max(0.05 * want, 0.003), (a, b, rtt, want)


def test_teardown_leaves_no_process_behind() -> None:
    mesh = ProcessMesh(scenario_path("multicloud8"), nodes=3).start()
    pids = [p.pid for p in mesh.procs.values()]
    mesh.stop()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
