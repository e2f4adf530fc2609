from __future__ import annotations

import csv
from pathlib import Path

import pytest

from ciuic_p2p.data import WAN_DIR, scenario_path
from ciuic_p2p.emulator.model.scenario import (
    EmulatedNetwork,
    scenario_from_mapping,
    scenario_from_matrix,
)
from ciuic_p2p.emulator.scenarios import load_scenario
from ciuic_p2p.errors import ConfigError

RTT = "region_a,region_b,rtt_ms,note\na,b,10,x\na,c,30,y\nb,c,50,z\n"


def test_matrix_pairs_are_symmetric_unless_given_per_direction() -> None:
    s = scenario_from_matrix(RTT + "b,a,20,asym\n", default_rate_gbps=None)
    assert s.params("a", "b").delay_s == pytest.approx(0.005)
    assert s.params("b", "a").delay_s == pytest.approx(0.010)
    assert s.params("c", "a").delay_s == pytest.approx(0.015)
    assert s.params("a", "b").rate_bps is None


def test_bandwidth_column_by_name_and_default_for_empty_cells() -> None:
    bw = "region_a,region_b,fast,slow\na,b,2.0,0.5\na,c,,0.1\n"
    s = scenario_from_matrix(RTT, bw, bandwidth_column="slow", default_rate_gbps=1.0)
    assert s.params("a", "b").rate_bps == pytest.approx(0.5e9)
    fast = scenario_from_matrix(RTT, bw, bandwidth_column="fast", rate_scale=0.001)
    assert fast.params("b", "a").rate_bps == pytest.approx(2e6)
    assert fast.params("a", "c").rate_bps == pytest.approx(1e6)  # empty cell: the default
    assert fast.params("b", "c").rate_bps == pytest.approx(1e6)  # absent pair: the default
    with pytest.raises(ConfigError, match="no column 'nope'"):
        scenario_from_matrix(RTT, bw, bandwidth_column="nope")


@pytest.mark.parametrize(
    ("text", "message"),
    [("x,y\n1,2\n", "lacks columns"), ("region_a,region_b,rtt_ms\na,b,fast\n", "not a number")],
)
def test_bad_matrices_are_named(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        scenario_from_matrix(text)


@pytest.mark.parametrize("name", ["rtt_cloudping_11cities", "rtt_multicloud_8regions"])
def test_shipped_scenarios_reproduce_the_measured_matrices(name: str) -> None:
    shipped = {"rtt_cloudping_11cities": "cities11", "rtt_multicloud_8regions": "multicloud8"}
    scenario = load_scenario(scenario_path(shipped[name]))
    rows = list(csv.DictReader((WAN_DIR / f"{name}.csv").read_text().splitlines()))
    by_region = {n.region: n.name for n in scenario.nodes}
    assert (
        len(scenario.nodes) == len(by_region)
        and len(rows) == len(by_region) * (len(by_region) - 1) // 2
    )
    for row in rows:
        a, b = by_region[row["region_a"]], by_region[row["region_b"]]
        assert scenario.rtt_s(a, b) * 1000 == pytest.approx(float(row["rtt_ms"]))


def test_a_csv_on_its_own_is_a_scenario() -> None:
    scenario = load_scenario(WAN_DIR / "rtt_multicloud_8regions.csv")
    assert len(scenario.nodes) == 8 and len(scenario.links) == 56


def test_cities_scenario_uses_the_measured_bandwidths_scaled() -> None:
    scenario = load_scenario(scenario_path("cities11"))
    assert scenario.rate_scale == 0.001
    assert scenario.params("Tokyo", "Singapore").rate_bps == pytest.approx(1.01e6)
    assert scenario.params("Tokyo", "Paris").rate_bps == pytest.approx(1.0e6)  # empty cell


def test_schedule_cuts_heals_and_partitions() -> None:
    net = EmulatedNetwork(load_scenario(scenario_path("partition")))
    assert net.transmit("Tokyo", "Frankfurt", 29.0, 100)
    assert not net.transmit("Tokyo", "Frankfurt", 30.5, 100)
    assert not net.transmit("Frankfurt", "Tokyo", 31.0, 100)
    assert net.transmit("Tokyo", "Paris", 31.0, 100)
    assert net.transmit("Frankfurt", "Tokyo", 60.5, 100)
    assert not net.transmit("London", "Sydney", 90.5, 100)
    assert net.transmit("London", "Paris", 90.5, 100) and net.transmit(
        "Sydney", "Oregon", 91.0, 100
    )
    assert net.transmit("London", "Sydney", 120.5, 100)


def test_manual_changes_and_isolation() -> None:
    scenario = scenario_from_mapping(
        {
            "nodes": [{"name": n} for n in "abcd"],
            "defaults": {"delay_ms": 5},
            "links": [{"src": "a", "dst": "b", "delay_ms": 50, "symmetric": True}],
            "schedule": [
                {"at_s": 1, "action": "isolate", "node": "c"},
                {"at_s": 2, "action": "rejoin", "node": "c"},
                {"at_s": 3, "action": "set", "src": "a", "dst": "d", "loss": 1.0},
            ],
        }
    )
    net = EmulatedNetwork(scenario)
    assert net.transmit("b", "a", 0.0, 10) == [pytest.approx(0.05)]
    assert not net.transmit("c", "d", 1.5, 10) and not net.transmit("a", "c", 1.5, 10)
    assert net.transmit("c", "d", 2.5, 10)
    assert not net.transmit("a", "d", 3.5, 10) and net.transmit("d", "a", 3.5, 10)
    net.partition(["a", "b"], ["c", "d"])
    assert not net.transmit("a", "c", 4.0, 10) and net.transmit("a", "b", 4.0, 10)
    net.heal_all()
    assert net.transmit("a", "c", 4.1, 10)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"nodes": [{"name": "a"}], "schedule": [{"at_s": 1, "action": "explode"}]}, "action"),
        ({"nodes": [{"name": "a"}], "schedule": [{"action": "isolate", "node": "z"}]}, "unknown"),
        (
            {
                "nodes": [{"name": "a"}, {"name": "b"}],
                "links": [{"src": "a", "dst": "b", "colour": 1}],
            },
            "colour",
        ),
        ({"defaults": {"loss": 2}}, "probability"),
        ({"rate_scale": 0}, "rate_scale"),
    ],
)
def test_bad_scenarios_name_the_problem(data: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        scenario_from_mapping(data)


def test_scenario_files_load_from_toml_and_json(tmp_path: Path) -> None:
    (tmp_path / "s.json").write_text('{"nodes": [{"name": "x"}, {"name": "y"}], "seed": 4}')
    assert load_scenario(tmp_path / "s.json").seed == 4
    with pytest.raises(ConfigError, match="cannot read"):
        load_scenario(tmp_path / "absent.toml")


def test_a_node_uplink_is_shared_by_all_its_links() -> None:
    """Links of 8 Mbit/s behind a 4 Mbit/s uplink: 1 MB to each of two peers, offered
    at 8 Mbit/s to each, leaves at the uplink's pace (2 MB in 4 s) and overflows its
    queue; a node with an 8 Mbit/s uplink sending to one peer keeps its link's pace."""
    data = {
        "rate_scale": 0.5,
        "uplink_gbps": 0.016,  # x 0.5: 8 Mbit/s for every node...
        "defaults": {"rate_mbps": 8.0, "queue_bytes": 4_000_000},
        "nodes": [
            {"name": "a", "uplink_gbps": 0.008},  # ...but a's own: 4 Mbit/s
            {"name": "b"},
            {"name": "c"},
        ],
    }
    scenario = scenario_from_mapping(data)
    assert [n.uplink_bps for n in scenario.nodes] == [4e6, 8e6, 8e6]
    net = EmulatedNetwork(scenario)
    arrivals = [
        net.transmit("a", "b" if k % 2 else "c", k * 0.001, 2000) for k in range(1000)
    ]  # 2 kB a millisecond: 16 Mbit/s offered, 8 Mbit/s to each peer
    kept = [t for got in arrivals for t in got]
    assert len(kept) < 1000  # the uplink's queue overflowed: tail drop
    rate = len(kept) * 2000 * 8 / (max(kept) - min(kept))
    assert rate == pytest.approx(4e6, rel=0.02)  # the uplink's pace, not 2 x 8 Mbit/s
    alone = [t for k in range(500) for t in net.transmit("b", "c", k * 0.002, 2000)]
    assert len(alone) == 500 and max(alone) == pytest.approx(1.0, rel=0.01)
    with pytest.raises(ConfigError, match="uplink_gbps"):
        scenario_from_mapping({**data, "uplink_gbps": -1})
