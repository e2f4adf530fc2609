"""Emulator fixtures; the transport's cluster fixture (CA and credentials) is reused."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ciuic_p2p.data import scenario_path
from ciuic_p2p.emulator.processes import ProcessMesh
from tests.transport.conftest import cluster

__all__ = ["cluster", "process_mesh"]


@pytest.fixture
def process_mesh() -> Iterator[ProcessMesh]:
    """Four nodes of the multi-cloud scenario, each its own process on loopback;
    torn down (by PID) after the test, and checked gone."""
    mesh = ProcessMesh(scenario_path("multicloud8"), nodes=4).start()
    try:
        yield mesh
    finally:
        mesh.stop()
    for proc in mesh.procs.values():
        assert proc.poll() is not None, "a node process outlived the fixture"
