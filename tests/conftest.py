"""Shared fixtures. Tests are seeded; none sleeps."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

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
