"""Kernel netem in network namespaces: runs where the kernel has netem, and is skipped,
with the command's own reason, where it has not (this project's build machines)."""

from __future__ import annotations

import pytest

from ciuic_p2p.data import scenario_path
from ciuic_p2p.emulator.model.netem import LinkParams
from ciuic_p2p.emulator.netns import commands, netem_args
from ciuic_p2p.emulator.scenarios import load_scenario
from tests.test_cli import run_cli

pytestmark = pytest.mark.processes


def test_netem_command_measures_the_scenario_or_says_netem_is_missing() -> None:
    result = run_cli("netem", "multicloud8", "--nodes", "3", "--pings", "2")
    if result.returncode == 3:
        assert "netem" in result.stderr
        pytest.skip(result.stderr.strip())
    assert result.returncode == 0, result.stderr
    assert result.stdout.count(" ms") >= 12  # 6 directed pairs, configured and measured


def test_every_destination_gets_its_own_class_netem_and_filter() -> None:
    scenario = load_scenario(scenario_path("cities11")).subset(["Tokyo", "Paris", "London"])
    up, down = commands(scenario, "t")
    text = [" ".join(c) for c in up]
    assert sum("u32 match ip dst" in c for c in text) == 6
    assert sum(" netem " in c for c in text) == 6
    assert len(down) == 4  # three nodes and the switch


def test_netem_arguments_follow_the_link_parameters() -> None:
    args = netem_args(
        LinkParams(
            delay_s=0.05,
            jitter_s=0.002,
            jitter_dist="normal",
            ge_p=0.01,
            ge_r=0.3,
            duplicate=0.001,
            rate_bps=1e6,
        )
    )
    assert args[:5] == ["delay", "50.000ms", "2.000ms", "distribution", "normal"]
    assert "gemodel" in args and "duplicate" in args and "limit" in args
