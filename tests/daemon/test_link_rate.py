"""The passive link rate end to end: real daemons (QUIC) on the emulated WAN, a link
shaped to a known rate; after some large chunks the receiver's ``status`` shows that
rate, measured from the chunks alone, and its link state carries it to the sender,
which paces that link by it."""

from __future__ import annotations

import collections
import dataclasses

import pytest

from ciuic_p2p.config import Config
from ciuic_p2p.core.mesh.broadcast import Delivery
from ciuic_p2p.daemon import nodestatus
from ciuic_p2p.daemon.node import ChunkRecorder
from ciuic_p2p.data import scenario_path
from ciuic_p2p.emulator.scenarios import load_scenario
from ciuic_p2p.lab.daemons import DaemonMesh

pytestmark = pytest.mark.network

NAMES = ["azure:westeurope", "gcp:europe-west1-b"]
RATE_SCALE = 0.02
"""The shipped matrix's 1 Gbit/s links at 20 Mbit/s: slow enough to pace a chunk over
tens of milliseconds, fast enough to keep the test short."""


async def test_a_links_rate_is_measured_from_the_chunks_it_carries() -> None:
    scenario = load_scenario(scenario_path("multicloud8"), rate_scale=RATE_SCALE)
    shaped_bps = scenario.params(NAMES[0], NAMES[1]).rate_bps  # the scale applied
    assert shaped_bps is not None
    got: collections.Counter[str] = collections.Counter()

    def recorder(name: str) -> ChunkRecorder:
        def record(d: Delivery) -> None:
            got[name] += 1

        return ChunkRecorder(record)

    async with DaemonMesh(scenario, NAMES, Config.wan(), observer=recorder) as mesh:
        await mesh.form()
        sender, receiver = (mesh.daemons[n] for n in NAMES)
        before = nodestatus.status(receiver)["members"]
        assert [m["receive_rate_bps"] for m in before] == [None]  # nothing large yet
        for i in range(12):
            sender.broadcast(bytes([i]) * 200_000)
        await mesh.until(lambda: got[NAMES[1]] == 12, 60)
        (member,) = nodestatus.status(receiver)["members"]
        assert member["peer"] == sender.peer_id
        measured = member["receive_rate_bps"]
        # QUIC's window starts small, the emulator's queue adds jitter: the median of
        # the chunks' pace lands near the shaped rate, never above what the link allows.
        assert 0.5 * shaped_bps <= measured <= 1.15 * shaped_bps
        # Published with the receiver's link state: the sender learns the rate of its
        # own uplink, and both count it in their trees.
        await mesh.until(
            lambda: sender.mesh.rate_bps(sender.peer_id, receiver.peer_id) is not None, 30
        )
        published = sender.mesh.rate_bps(sender.peer_id, receiver.peer_id)
        assert published is not None and abs(published - measured) <= 0.25 * measured + 1e3
        (theirs,) = nodestatus.status(receiver)["members"]
        assert theirs["published_rate_bps"] == round(published)
        # The sender paces its bulk frames on that link at mesh.pace_gain times the
        # rate its receiver published (core.link.pacer); the receiver, which measured
        # nothing from the other side, sends unpaced.
        gain = Config.wan().mesh.pace_gain

        def paced_at() -> float | None:
            (entry,) = nodestatus.status(sender)["members"]
            pace = entry["pace_bps"]
            return None if pace is None else float(pace)

        await mesh.until(lambda: paced_at() is not None, 10)
        now_published = sender.mesh.rate_bps(sender.peer_id, receiver.peer_id)
        assert now_published is not None
        assert paced_at() == pytest.approx(gain * now_published, rel=0.02)
        assert theirs["pace_bps"] is None
        # The other way no one measured (the receiver sent nothing large), and only a
        # link's receiver's word counts for it: unknown, not borrowed.
        (mine,) = nodestatus.status(sender)["members"]
        assert mine["receive_rate_bps"] is None and mine["published_rate_bps"] is None


async def test_a_link_nothing_large_crossed_is_probed_once_and_measured() -> None:
    """Active and bounded: with no traffic at all, each node sends each peer one probe
    (two frames of filler) and the peer publishes the link's rate from it; the same
    link is not probed again within ``rate_probe_interval_s``."""
    scenario = load_scenario(scenario_path("multicloud8"), rate_scale=RATE_SCALE)
    names = [*NAMES, "gcp:europe-west6-a"]
    wan = Config.wan()  # probes are off by default
    probing = dataclasses.replace(wan.mesh, rate_probe_bytes=512 * 1024)  # two frames
    async with DaemonMesh(scenario, names, dataclasses.replace(wan, mesh=probing)) as mesh:
        await mesh.form()
        daemons = [mesh.daemons[n] for n in names]
        pairs = [(a, b) for a in daemons for b in daemons if a is not b]

        def all_measured() -> bool:
            return all(a.mesh.rate_bps(a.peer_id, b.peer_id) is not None for a, b in pairs)

        await mesh.until(all_measured, 30)
        for a, b in pairs:
            shaped = scenario.params(mesh.name_of[a.peer_id], mesh.name_of[b.peer_id]).rate_bps
            rate = a.mesh.rate_bps(a.peer_id, b.peer_id)
            assert shaped is not None and rate is not None and rate <= 1.15 * shaped
        sent = sum(d.counters["rate_probes_sent"] for d in daemons)
        assert sent == len(pairs)  # once per link; measured, never again
        assert sum(d.counters["rate_probes_received"] for d in daemons) == 2 * len(pairs)
