"""Shared fixtures. Tests are seeded; none sleeps."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

from tests.daemon.fleet import Fleet

settings.register_profile(
    "ci",
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=200, deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _seed_torch() -> None:
    torch.manual_seed(1234)


def devices() -> list[str]:
    """CPU always; CUDA where present, so GPU machines run the same tests."""
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


async def eventually(condition: Callable[[], object], timeout_s: float = 2.0) -> None:
    """Wait until ``condition()`` is true, checking every 10 ms, for at most
    ``timeout_s``; fail the test otherwise. Tests wait on conditions, never on sleeps."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s} s")
        await asyncio.sleep(0.01)


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    """Daemons started with the public CLI (tests.daemon.fleet), all stopped after."""
    f = Fleet(tmp_path)
    try:
        yield f
    finally:
        f.stop_all()
