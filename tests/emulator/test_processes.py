"""Nodes as separate processes on loopback, each with the scenario file and its name."""

from __future__ import annotations

import os

import pytest

from ciuic_p2p.core.scenario import load_scenario
from ciuic_p2p.data import scenario_path
from ciuic_p2p.emulator.processes import ProcessMesh


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
