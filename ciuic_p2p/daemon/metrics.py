"""What a daemon tells Prometheus: one custom collector per daemon, read at scrape time.

Nothing here sits on a hot path. The daemon already keeps what is measured (its
counters, per-peer traffic, outboxes, the membership table, the RTT map); the collector
reads them when ``/metrics`` is scraped and builds the metric families then, into a
registry of its own (``new_registry``), never the process-global one, so two daemons
in one process (tests, the emulator) never share series.

It also owns the two small trackers whose numbers do not exist elsewhere:

- ``TrainingProgress``: each origin's newest step, seen in the chunk headers that
  pass through daemon.trainer (published by our trainer, delivered from the others),
  steps per second over a sliding window, and the time spent signing and verifying
  chunks. The trainer does not send its own step rate or codec times over the socket;
  what is derived here is what the daemon can see.
- ``RouteWatch``: route changes, counted by comparing samples of the route table
  (core.mesh.routing keeps no count of its own; web.WebServer samples every ``refresh_s``).

Label ``peer`` is always a peer ID. Per-peer traffic is kept by address in the daemon
(the key of its outboxes) and named at scrape time (``MeshDaemon.peers_by_address``).
"""

from __future__ import annotations

import collections
import importlib.metadata
import math
import platform
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
)
from prometheus_client.gc_collector import GCCollector
from prometheus_client.metrics_core import Metric
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector, CollectorRegistry

from ciuic_p2p import __version__
from ciuic_p2p.core.mesh.members import State
from ciuic_p2p.daemon.node import MeshDaemon, PeerTraffic
from ciuic_p2p.identity import peer_id_of

RATE_WINDOW_S = 30.0
"""Steps per second are averaged over this long: long enough to span a few sends at
a slow send interval, short enough that a stalled trainer reads as stalled."""
RATE_SAMPLES = 64
"""Samples kept per origin (one per step seen), bounding memory at fast step rates."""
CREDENTIAL_EVENTS = (
    ("checked", "credential_checks"),
    ("refused", "credentials_refused"),
    ("unchecked", "credentials_unchecked"),
    ("cached", "credentials_cached"),
    ("dropped", "credentials_dropped"),
)
"""``ciuic_credentials``' events and the core.mesh.identities counters they show."""


# -- trackers --------------------------------------------------------------------------------


@dataclass
class StepRate:
    """One origin's steps as seen in its chunks' headers: ``(time_s, step)`` samples,
    one per new step, of one trainer session (incarnation)."""

    incarnation: int = -1
    samples: collections.deque[tuple[float, int]] = field(
        default_factory=lambda: collections.deque(maxlen=RATE_SAMPLES)
    )
    ended: str = ""
    """Why this session is over: ``done`` (it finished the run: DONE), ``gone`` (it
    went away mid-run: GONE, or our own trainer detached); empty while it trains."""
    final_step: int | None = None
    """The last step its DONE said: its run's last update is stamped past it (as
    covering the steps its residual held), and that stamp is no step it trained."""

    def observe(self, incarnation: int, step: int, now_s: float) -> None:
        if incarnation != self.incarnation:  # a new trainer session counts from 1 again
            self.incarnation = incarnation
            self.samples.clear()
            self.ended = ""
            self.final_step = None
        elif self.samples and step <= self.samples[-1][1]:
            return  # more chunks of the same step, or a late (repaired) one
        self.samples.append((now_s, step))

    @property
    def step(self) -> int | None:
        if self.final_step is not None:
            return self.final_step
        return self.samples[-1][1] if self.samples else None

    @property
    def seen_s(self) -> float | None:
        return self.samples[-1][0] if self.samples else None

    def per_s(self, now_s: float) -> float | None:
        """Steps per second from the oldest sample within the window until now; ``now``
        rather than the newest sample, so that a trainer that stopped decays to 0."""
        if len(self.samples) < 2:
            return None
        first = next((s for s in self.samples if now_s - s[0] <= RATE_WINDOW_S), self.samples[-1])
        elapsed_s = now_s - first[0]
        if elapsed_s <= 0:
            return None
        return (self.samples[-1][1] - first[1]) / elapsed_s


ROUNDS_KEPT = 32
"""Rounds (steps) whose first and last chunk times are kept, and closed rounds."""


@dataclass
class RoundTimes:
    """How long each round takes to gather here, measured from the chunks that pass:
    from the first chunk of a step (from any origin, this node's own included) to the
    last, once the round is closed (every origin seen in it has sent a later step, or
    the newest step is two rounds on). What ``status`` shows beside the strategy's
    predicted round time (core.mesh.strategy)."""

    first_s: dict[int, float] = field(default_factory=dict)
    last_s: dict[int, float] = field(default_factory=dict)
    origins: dict[int, set[str]] = field(default_factory=dict)
    newest: dict[str, int] = field(default_factory=dict)
    closed: collections.deque[tuple[int, float]] = field(
        default_factory=lambda: collections.deque(maxlen=ROUNDS_KEPT)
    )

    def observe(self, origin: str, step: int, now_s: float) -> None:
        if step not in self.first_s:
            if len(self.first_s) >= ROUNDS_KEPT and step < min(self.first_s):
                return  # older than every round kept: a straggler, not a round
            self.first_s[step] = now_s
            self.origins[step] = set()
        self.last_s[step] = now_s
        self.origins[step].add(origin)
        self.newest[origin] = max(step, self.newest.get(origin, step))
        self._close()

    def _close(self) -> None:
        top = max(self.first_s)
        for step in sorted(self.first_s):
            seen = self.origins[step]
            moved_on = all(self.newest.get(o, step) > step for o in seen)
            if step < top and (moved_on or len(self.first_s) > ROUNDS_KEPT or step < top - 1):
                self.closed.append((step, self.last_s[step] - self.first_s[step]))
                del self.first_s[step], self.last_s[step], self.origins[step]

    def status(self) -> dict[str, float | int | None]:
        times = sorted(t for _, t in self.closed)
        return {
            "rounds_measured": len(times),
            "last_round_s": round(self.closed[-1][1], 4) if self.closed else None,
            "median_round_s": round(times[len(times) // 2], 4) if times else None,
        }


TIMING_BUCKETS_S = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3)
"""Histogram bounds for per-chunk work (signing, verifying): 10 us to 0.3 s."""


@dataclass
class Timing:
    """A histogram of durations, in seconds: per-bucket counts, count and sum."""

    count: int = 0
    total_s: float = 0.0
    buckets: list[int] = field(default_factory=lambda: [0] * len(TIMING_BUCKETS_S))

    def add(self, seconds: float) -> None:
        self.count += 1
        self.total_s += seconds
        for i, bound in enumerate(TIMING_BUCKETS_S):
            if seconds <= bound:
                self.buckets[i] += 1
                break

    def cumulative(self) -> list[tuple[str, float]]:
        out, running = [], 0
        for bound, n in zip(TIMING_BUCKETS_S, self.buckets, strict=True):
            running += n
            out.append((repr(bound), float(running)))
        return [*out, ("+Inf", float(self.count))]


TRAINER_FIGURES = {
    "encode_s": "Seconds the trainer's encoder thread spent compressing updates.",
    "decode_s": "Seconds the trainer spent decoding and checking peers' chunks.",
    "wait_s": "Seconds the trainer's steps waited for lagging replicas.",
    "hook_s": "Seconds the training thread spent in the hook's step().",
}


TRAINER_COUNTS = {
    "clipped": "Peer update chunks the trainer took at less than their norm or weight "
    "(one origin's influence bounded: docs/concepts/security.md).",
    "weight_raised": "Peer update chunks that claimed a smaller run than the trainer saw.",
}
MAX_SET_ASIDE_REPORTED = 256
"""Origins set aside that a trainer's report may name (the rest are dropped)."""


class TrainingProgress:
    """Training progress per origin (this node's trainer included), fed by
    daemon.trainer with the header of each chunk it signs or verifies."""

    def __init__(self) -> None:
        self.runs: dict[bytes, dict[str, StepRate]] = {}
        """Each run's origins (by run ID): runs share the mesh, so chunks of runs other
        than ours pass here too, and one origin's steps of two runs never mix."""
        self.run_id: bytes | None = None
        """The run of this node's trainer (its HELLO, or the run it trained last)."""
        self._last_run: bytes | None = None
        self.sign = Timing()
        """Signing the chunks our trainer publishes (the daemon's encode side)."""
        self.verify = Timing()
        """Verifying delivered chunks before the trainer sees them (its decode side)."""
        self.trainer: dict[str, float] = {}
        """The attached trainer's reported totals (``TRAINER_FIGURES``)."""
        self.run = ""
        """The run the attached trainer trains (its HELLO): the ``run`` label."""
        self.rounds = RoundTimes()
        """How long the rounds (steps) of updates take to gather here."""
        self.set_aside: dict[str, int] = {}
        """Origins the trainer set aside (core.replica.influence), until which of its
        steps."""
        self.loss: float | None = None
        """The training loss the trainer last gave ``sync.step(loss=...)``."""

    def report(self, figures: dict[str, object]) -> list[tuple[str, int]]:
        """The trainer's own totals (its encoder thread, its decoding reader, its waits
        and the hook's time, its influence counters), as it sends them with each stats
        request; the origins it set aside since the last report (origin, until step)."""
        for key in (*TRAINER_FIGURES, *TRAINER_COUNTS):
            value = figures.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool) and value >= 0:
                self.trainer[key] = float(value)
        loss = figures.get("loss")
        if isinstance(loss, int | float) and not isinstance(loss, bool) and math.isfinite(loss):
            self.loss = float(loss)  # any finite number: a loss may be negative
        aside = figures.get("set_aside")
        if not isinstance(aside, dict):
            return []
        fresh: list[tuple[str, int]] = []
        for origin, until in list(aside.items())[:MAX_SET_ASIDE_REPORTED]:
            if (
                isinstance(origin, str)
                and len(origin) <= 64
                and isinstance(until, int)
                and not isinstance(until, bool)
                and 0 <= until < 1 << 62
                and self.set_aside.get(origin) != until
            ):
                self.set_aside[origin] = until
                fresh.append((origin, until))
        return fresh

    @property
    def origins(self) -> dict[str, StepRate]:
        """The origins of this node's run (no run of ours yet: of the run seen last)."""
        run = self.run_id if self.run_id is not None else self._last_run
        return self.runs.get(run, {}) if run is not None else {}

    def trainer_attached(self, run: str, run_id: bytes, own: str) -> None:
        """This node's trainer said which run it trains (HELLO): a new session."""
        self.run, self.run_id = run[:64], run_id
        rate = self.runs.get(run_id, {}).get(own)
        if rate is not None:
            rate.ended = ""

    def ended(self, origin: str, run_id: bytes, why: str, step: int | None = None) -> None:
        """``origin``'s trainer of ``run_id`` ended (``StepRate.ended``), at ``step``
        when its DONE said."""
        rate = self.runs.get(run_id, {}).get(origin)
        if rate is not None:
            rate.ended = why
            if step is not None:
                rate.final_step = step

    def observe(
        self,
        origin: str,
        incarnation: int,
        step: int,
        now_s: float,
        update: bool = True,
        run_id: bytes = b"",
    ) -> None:
        """A chunk of ``origin``'s ``step`` of run ``run_id`` passed (``update``: of an
        update, whose round this node gathers if it is of our run; consensus fragments
        are not a round's)."""
        origins = self.runs.setdefault(run_id, {})
        self._last_run = run_id
        rate = origins.get(origin)
        if rate is None:
            rate = origins[origin] = StepRate()
        rate.observe(incarnation, step, now_s)
        if update and self.run_id in (None, run_id):
            self.rounds.observe(origin, step, now_s)

    def rows(self, own: str, now_s: float) -> dict[str, dict[str, float | int | str | None]]:
        """Per origin of our run: step, steps/s, staleness and age of the newest step
        seen, and ``state``: ``live``, or why it ended (``StepRate.ended``).

        Staleness is how many steps an origin's newest chunk here is behind our own
        trainer's newest (or, without one, the furthest origin's): chunks delivered,
        which the trainer applies between steps, so it is a lower bound of
        core.replica.rule's staleness of applied steps."""
        return self._rows(self.origins, own, now_s, ours=True)

    def _rows(
        self, origins: dict[str, StepRate], own: str, now_s: float, ours: bool
    ) -> dict[str, dict[str, float | int | str | None]]:
        steps = {o: r.step for o, r in origins.items() if r.step is not None}
        reference = steps.get(own, max(steps.values(), default=0))
        out: dict[str, dict[str, float | int | str | None]] = {}
        for origin, rate in sorted(origins.items()):
            step, seen_s, per_s = rate.step, rate.seen_s, rate.per_s(now_s)
            if step is None or seen_s is None:
                continue
            out[origin] = {
                "step": step,
                # An ended trainer has no rate: its last one would read as live.
                "steps_per_s": None if per_s is None or rate.ended else round(per_s, 3),
                "staleness_steps": max(0, reference - step),
                "age_s": round(now_s - seen_s, 3),
                "set_aside_until": self.set_aside.get(origin) if ours else None,
                "loss": self.loss if ours and origin == own else None,
                "state": rate.ended or "live",
            }
        return out

    def runs_status(self, own: str, now_s: float) -> list[dict[str, object]]:
        """Every run whose chunks passed here, ours first, then by the newest chunk:
        its ID, its name where known (ours), and its trainers' rows (as ``rows``, with
        ``state``: live, done or gone)."""
        ours = self.run_id if self.run_id is not None else self._last_run

        def newest(item: tuple[bytes, dict[str, StepRate]]) -> tuple[bool, float]:
            seen = [r.seen_s for r in item[1].values() if r.seen_s is not None]
            return item[0] != ours, -max(seen, default=0.0)

        out: list[dict[str, object]] = []
        for run_id, origins in sorted(self.runs.items(), key=newest):
            is_ours = run_id == self.run_id
            out.append(
                {
                    "run_id": run_id.hex(),
                    "name": self.run if is_ours else "",
                    "own": is_ours,
                    "trainers": self._rows(origins, own, now_s, ours=is_ours),
                }
            )
        return out


class RouteWatch:
    """Counts changes of the route table between samples, by kind: ``changed`` (the
    path to a destination moved), ``added`` and ``removed`` (a destination came or
    went with the view)."""

    def __init__(self) -> None:
        self.routes: dict[str, tuple[str, ...]] = {}
        self.changes: collections.Counter[str] = collections.Counter()

    def sample(self, routes: dict[str, tuple[str, ...]]) -> None:
        old = self.routes
        for dst, path in routes.items():
            before = old.get(dst)
            if before is None:
                self.changes["added"] += 1
            elif before != path:
                self.changes["changed"] += 1
        self.changes["removed"] += sum(1 for dst in old if dst not in routes)
        self.routes = dict(routes)


# -- the collector ---------------------------------------------------------------------------


def traffic_by_peer(daemon: MeshDaemon) -> dict[str, PeerTraffic]:
    """The daemon's per-address traffic summed per peer ID (a member that came back on
    another port has two addresses; one series per peer either way)."""
    names = daemon.peers_by_address()
    out: dict[str, PeerTraffic] = {}
    for address, t in daemon.traffic.items():
        peer = names.get(address, address)
        total = out.setdefault(peer, PeerTraffic())
        total.bytes_sent += t.bytes_sent
        total.bytes_received += t.bytes_received
        total.chunks_sent += t.chunks_sent
        total.chunks_received += t.chunks_received
        total.chunks_relayed += t.chunks_relayed
    return out


class DaemonCollector(Collector):
    """The collector of one daemon's state (``collect`` runs at each scrape)."""

    def __init__(
        self,
        daemon: MeshDaemon,
        *,
        training: TrainingProgress | None = None,
        routes: RouteWatch | None = None,
    ) -> None:
        self.daemon = daemon
        self.training = training
        self.routes = routes or RouteWatch()
        self.started_unix_s = time.time() - (daemon.clock() - daemon.started_at)

    def collect(self) -> Iterable[Metric]:
        d = self.daemon
        if d.node is None:  # not started yet: nothing but the counters is meaningful
            yield from self._faults()
            yield from self._counters()
            return
        yield from self._node()
        yield from self._traffic()
        yield from self._queues()
        yield from self._membership()
        yield from self._routing()
        yield from self._strategy()
        yield from self._training()
        yield from self._faults()
        yield from self._counters()

    def _live(self) -> set[str]:
        """Members alive or suspected: the peers that have per-peer series."""
        return {p for p, m in self.daemon.mesh.members().items() if m.state <= State.SUSPECT}

    def _node(self) -> Iterator[Metric]:
        d = self.daemon
        build = InfoMetricFamily(
            "ciuic_build", "The software this daemon runs.", labels=["version", "python", "quic"]
        )
        build.add_metric([__version__, platform.python_version(), _quic_version()], {})
        yield build
        yield GaugeMetricFamily(
            "ciuic_start_time_seconds",
            "When the daemon started, in seconds since the Unix epoch.",
            self.started_unix_s,
        )
        info = InfoMetricFamily("ciuic_node", "This node.", labels=["peer", "name", "address"])
        info.add_metric(
            [d.peer_id, d.config.node.name, d.address], {"region": d.config.node.region}
        )
        yield info
        yield GaugeMetricFamily(
            "ciuic_uptime_seconds", "Seconds since the daemon started.", d.clock() - d.started_at
        )
        yield CounterMetricFamily(
            "ciuic_udp_sent_bytes",
            "UDP bytes this node sent (every link, QUIC overhead included).",
            d.transport.udp_bytes_sent,
        )
        link_rtt = GaugeMetricFamily(
            "ciuic_link_rtt_seconds",
            "Smoothed RTT of each link, by estimator: application pings or QUIC's loss recovery.",
            labels=["peer", "estimator"],
        )
        for key in d.transport.peers():
            stats = d.transport.rtt(key)
            if stats is None:
                continue
            for estimator, value in (
                ("ping", stats.ping_smoothed_s),
                ("quic", stats.quic_smoothed_s),
            ):
                if value is not None:
                    link_rtt.add_metric([peer_id_of(key), estimator], value)
        yield link_rtt
        dis = d.mesh.dissemination
        chunks = CounterMetricFamily(
            "ciuic_dissemination_chunks",
            "Mesh chunks by what became of them here: dropped as duplicates, repaired, "
            "given up (lost), dropped as a restarted origin's previous life's (stale), "
            "dropped as of an unknown origin past the log limit (unknown_origin).",
            labels=["event"],
        )
        for event, value in (
            ("duplicate", dis.duplicates),
            ("repaired", dis.repaired),
            ("lost", dis.lost),
            ("stale", dis.stale),
            ("unknown_origin", dis.unknown_origins),
        ):
            chunks.add_metric([event], value)
        yield chunks
        yield CounterMetricFamily(
            "ciuic_origins_restarted",
            "Times an origin was heard from in a new session (it restarted).",
            dis.restarts_seen,
        )

    def _traffic(self) -> Iterator[Metric]:
        families = {
            what: CounterMetricFamily(f"ciuic_peer_{what}", doc, labels=["peer"])
            for what, doc in (
                ("sent_bytes", "Frame bytes handed to the transport for this peer."),
                ("received_bytes", "Frame bytes received from this peer."),
                ("sent_chunks", "Mesh chunks sent to this peer (own and relayed)."),
                ("received_chunks", "Mesh chunks received from this peer (duplicates too)."),
                ("relayed_chunks", "Chunks of other origins queued onward to this peer."),
            )
        }
        live = self._live()
        for name, t in sorted(traffic_by_peer(self.daemon).items()):
            if name not in live:
                continue  # a departed member's series go with it
            peer = [name]
            families["sent_bytes"].add_metric(peer, t.bytes_sent)
            families["received_bytes"].add_metric(peer, t.bytes_received)
            families["sent_chunks"].add_metric(peer, t.chunks_sent)
            families["received_chunks"].add_metric(peer, t.chunks_received)
            families["relayed_chunks"].add_metric(peer, t.chunks_relayed)
        yield from families.values()
        by_kind = {
            what: CounterMetricFamily(f"ciuic_mesh_sent_{what}", doc, labels=["kind"])
            for what, doc in (
                ("bytes", "Mesh message bytes sent, by kind, before the transport's framing."),
                ("messages", "Mesh messages sent, by kind."),
            )
        }
        for kind in sorted(self.daemon.mesh_bytes_sent):
            by_kind["bytes"].add_metric([kind], self.daemon.mesh_bytes_sent[kind])
            by_kind["messages"].add_metric([kind], self.daemon.mesh_messages_sent[kind])
        yield from by_kind.values()

    def _queues(self) -> Iterator[Metric]:
        d = self.daemon
        names = d.peers_by_address()
        yield GaugeMetricFamily(
            "ciuic_bulk_backlog_bytes",
            "Bulk bytes queued in this daemon's outboxes, not yet handed to the transport.",
            d.backlog_bytes(),
        )
        frames = GaugeMetricFamily(
            "ciuic_outbox_frames",
            "Frames waiting per destination and lane.",
            labels=["peer", "lane"],
        )
        queued = GaugeMetricFamily(
            "ciuic_outbox_bytes",
            "Bytes waiting per destination and lane (store pieces not counted).",
            labels=["peer", "lane"],
        )
        depths: collections.Counter[tuple[str, str, str]] = collections.Counter()
        for (address, lane), (n_frames, n_bytes) in d.outbox_depths().items():
            peer, lane_name = names.get(address, address), "bulk" if lane else "control"
            depths[(peer, lane_name, "frames")] += n_frames
            depths[(peer, lane_name, "bytes")] += n_bytes
        for (peer, lane_name, what), value in sorted(depths.items()):
            (frames if what == "frames" else queued).add_metric([peer, lane_name], value)
        yield frames
        yield queued
        buffered = GaugeMetricFamily(
            "ciuic_link_bulk_buffered_bytes",
            "Bulk bytes in the QUIC stack for a peer, not yet credited back by it.",
            labels=["peer"],
        )
        rate = GaugeMetricFamily(
            "ciuic_link_receive_rate_bps",
            "The pace of a peer's bulk frames arriving here, measured passively (bits/s).",
            labels=["peer"],
        )
        pace = GaugeMetricFamily(
            "ciuic_link_pace_bps",
            "The rate this node paces its bulk frames to a peer at (bits/s; absent: not paced).",
            labels=["peer"],
        )
        for key in d.transport.peers():
            stats = d.transport.link_stats(key)
            if stats is not None:
                buffered.add_metric([peer_id_of(key)], stats.bulk_buffered_bytes)
                if stats.receive_rate_bps is not None:
                    rate.add_metric([peer_id_of(key)], stats.receive_rate_bps)
                if stats.pace_bps is not None:
                    pace.add_metric([peer_id_of(key)], stats.pace_bps)
        yield buffered
        yield rate
        yield pace

    def _membership(self) -> Iterator[Metric]:
        d = self.daemon
        node = d.mesh
        events = CounterMetricFamily(
            "ciuic_membership_events",
            "Membership changes this node saw, by the state entered.",
            labels=["state"],
        )
        for state in State:
            events.add_metric([state.name.lower()], d.member_events[state.name.lower()])
        yield events
        members = GaugeMetricFamily(
            "ciuic_members",
            "Members in the table by state (this node not included).",
            labels=["state"],
        )
        by_state = collections.Counter(m.state for m in node.members().values())
        for state in State:
            members.add_metric([state.name.lower()], by_state[state])
        yield members
        # Names and regions by peer ID, to join onto the per-peer series in queries
        # (`* on(peer) group_left(name) ciuic_peer_info`); members that are not alive
        # or suspected have no series, so a departed peer's disappears.
        info = InfoMetricFamily(
            "ciuic_peer", "Each live member's name and region.", labels=["peer", "name"]
        )
        for peer, m in sorted(node.members().items()):
            if m.state <= State.SUSPECT:
                info.add_metric([peer, m.name], {"region": m.region})
        yield info
        yield GaugeMetricFamily(
            "ciuic_health_score",
            "Lifeguard local health: 0 is healthy; higher stretches this node's timeouts.",
            node.health_score,
        )
        answered = CounterMetricFamily(
            "ciuic_membership_answered_by_traffic",
            "Late probes whose target's own messages came meanwhile (probe), and "
            "suspicions not turned into deaths here for the same reason (death).",
            labels=["what"],
        )
        answered.add_metric(["probe"], node.membership.probes_answered_by_traffic)
        answered.add_metric(["death"], node.membership.deaths_withheld)
        yield answered
        credentials = CounterMetricFamily(
            "ciuic_credentials",
            "Members' credentials (node certificates) relayed in gossip, by what became of "
            "them: checked (a certificate verification run), refused, unchecked (dropped "
            "past their sender's bucket of checks), cached (taken without a check, as "
            "accepted before), dropped (the table of credentials full of members).",
            labels=["event"],
        )
        for event, name in CREDENTIAL_EVENTS:
            credentials.add_metric([event], node.identities.counters[name])
        yield credentials
        yield CounterMetricFamily(
            "ciuic_mesh_replans",
            "Times this node computed its routes and trees again, for a new view or a new "
            "link state taken.",
            node.replans,
        )
        yield CounterMetricFamily(
            "ciuic_link_state_held",
            "Members' link-state versions that came sooner than mesh.link_publish_min_s "
            "after the last one taken from them: held, and taken when due (only a member "
            "publishing faster than an honest node makes this grow).",
            node.rttmap.links_held,
        )
        rtt = GaugeMetricFamily(
            "ciuic_peer_rtt_seconds",
            "RTT to each member as routing uses it, by source (measured, vivaldi).",
            labels=["peer", "source"],
        )
        for peer in self._live():
            value = node.rtt_s(d.peer_id, peer)
            if value is not None:
                rtt.add_metric([peer, node.rtt_source(d.peer_id, peer)], value)
        yield rtt

    def _routing(self) -> Iterator[Metric]:
        routes = self.daemon.mesh.routes()
        self.routes.sample(routes)
        changes = CounterMetricFamily(
            "ciuic_route_changes",
            "Route table changes seen between samples (every refresh_s), by kind.",
            labels=["kind"],
        )
        for kind in ("changed", "added", "removed"):
            changes.add_metric([kind], self.routes.changes[kind])
        yield changes
        relays = GaugeMetricFamily(
            "ciuic_route_relays", "Relays on the current route to each member.", labels=["peer"]
        )
        for dst, path in sorted(routes.items()):
            relays.add_metric([dst], max(0, len(path) - 2))
        yield relays

    def _strategy(self) -> Iterator[Metric]:
        st = self.daemon.mesh.strategy()
        info = GaugeMetricFamily(
            "ciuic_strategy_info",
            "The strategy this node's rounds spread by (1), and the configured one.",
            labels=["strategy", "configured"],
        )
        info.add_metric([str(st["strategy"]), str(st["configured"])], 1.0)
        yield info
        predicted = GaugeMetricFamily(
            "ciuic_strategy_predicted_round_seconds",
            "The cost model's round time of each strategy at the last decision.",
            labels=["strategy"],
        )
        times = st["predicted_s"]
        assert isinstance(times, dict)
        for name, seconds in sorted(times.items()):
            if math.isfinite(seconds):
                predicted.add_metric([name], seconds)
        yield predicted
        switches = CounterMetricFamily(
            "ciuic_strategy_switches", "Times ``auto`` changed the strategy in force."
        )
        switches.add_metric([], float(st["switches"]))  # type: ignore[arg-type]
        yield switches
        measured = GaugeMetricFamily(
            "ciuic_round_measured_seconds",
            "How long the last rounds took to gather here (first to last chunk of a step).",
            labels=["which"],
        )
        if self.training is not None:
            r = self.training.rounds.status()
            for which in ("last_round_s", "median_round_s"):
                value = r[which]
                if value is not None:
                    measured.add_metric([which.removesuffix("_round_s")], float(value))
        yield measured

    def _training(self) -> Iterator[Metric]:
        t = self.training
        run = t.run if t is not None else ""
        step = GaugeMetricFamily(
            "ciuic_trainer_step",
            "Newest step seen in each origin's chunks of this node's run.",
            labels=["peer", "run"],
        )
        rate = GaugeMetricFamily(
            "ciuic_trainer_steps_per_second",
            f"Each origin's steps per second over the last {RATE_WINDOW_S:g} s of its chunks "
            "(rate(ciuic_trainer_step[...]) gives any other window).",
            labels=["peer", "run"],
        )
        stale = GaugeMetricFamily(
            "ciuic_staleness_steps",
            "Steps each origin's newest chunk is behind this node's trainer.",
            labels=["peer", "run"],
        )
        sign = HistogramMetricFamily(
            "ciuic_chunk_sign_seconds",
            "Signing a chunk our trainer published (encode side).",
            labels=["run"],
        )
        verify = HistogramMetricFamily(
            "ciuic_chunk_verify_seconds",
            "Verifying a delivered chunk for our trainer (decode side).",
            labels=["run"],
        )
        if t is not None:
            for origin, row in t.rows(self.daemon.peer_id, self.daemon.clock()).items():
                step.add_metric([origin, run], float(row["step"] or 0))
                stale.add_metric([origin, run], float(row["staleness_steps"] or 0))
                if row["steps_per_s"] is not None:
                    rate.add_metric([origin, run], float(row["steps_per_s"]))
            sign.add_metric([run], t.sign.cumulative(), t.sign.total_s)
            verify.add_metric([run], t.verify.cumulative(), t.verify.total_s)
        yield from (step, rate, stale, sign, verify)
        for key, text in TRAINER_FIGURES.items():
            name = "ciuic_trainer_" + key.removesuffix("_s") + "_seconds"
            family = CounterMetricFamily(name, text, labels=["run"])
            if t is not None and key in t.trainer:
                family.add_metric([run], t.trainer[key])
            yield family
        for key, text in TRAINER_COUNTS.items():
            family = CounterMetricFamily("ciuic_trainer_chunks_" + key, text, labels=["run"])
            if t is not None and key in t.trainer:
                family.add_metric([run], t.trainer[key])
            yield family
        loss = GaugeMetricFamily(
            "ciuic_trainer_loss",
            "The training loss this node's trainer last reported (sync.step(loss=...)).",
            labels=["run"],
        )
        if t is not None and t.loss is not None:
            loss.add_metric([run], t.loss)
        yield loss
        aside = GaugeMetricFamily(
            "ciuic_trainer_origins_set_aside",
            "Origins the trainer set aside after repeated refusals (each until a step of "
            "its own; `ciuic-node ca revoke` removes a member for good).",
            labels=["run"],
        )
        if t is not None:
            own = max((r.step or 0 for r in t.origins.values()), default=0)
            aside.add_metric([run], float(sum(1 for u in t.set_aside.values() if u > own)))
        yield aside

    def _faults(self) -> Iterator[Metric]:
        d = self.daemon
        errors = CounterMetricFamily(
            "ciuic_internal_errors",
            "Exceptions caught by a guard (a library's or our fault; 0 when healthy), by "
            "component and callback.",
            labels=["component", "where"],
        )
        for guard in (d.guard, d.transport.guard):
            for where, count in sorted(guard.counts.items()):
                errors.add_metric([guard.component, where], count)
        yield errors
        gate = d.transport.strangers()
        dropped = CounterMetricFamily(
            "ciuic_strangers_dropped",
            "Datagrams from unknown sources dropped before any state, by reason.",
            labels=["reason"],
        )
        for reason, count in sorted(gate.dropped.items()):
            dropped.add_metric([reason], count)
        yield dropped
        yield GaugeMetricFamily(
            "ciuic_pending_connections",
            "Accepted connections not yet authenticated.",
            gate.pending_connections,
        )
        yield CounterMetricFamily(
            "ciuic_retries_sent", "QUIC Retry packets sent (address validation).", gate.retries_sent
        )
        yield CounterMetricFamily(
            "ciuic_links_refused",
            "Connections refused before authentication (bad credential, timeout, framing).",
            gate.refused,
        )

    def _counters(self) -> Iterator[Metric]:
        events = CounterMetricFamily(
            "ciuic_daemon_events",
            "The daemon's own counters (drops, refusals, deliveries...), by name.",
            labels=["event"],
        )
        for name, value in sorted(self.daemon.counters.items()):
            events.add_metric([name], value)
        yield events


def new_registry(collector: DaemonCollector) -> CollectorRegistry:
    """A registry of this daemon's collector and the process's own (``process_*``:
    CPU, memory, open files; ``python_*``: the interpreter and its garbage collector),
    never the process-global registry."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry


def _quic_version() -> str:
    try:
        return "aioquic " + importlib.metadata.version("aioquic")
    except importlib.metadata.PackageNotFoundError:
        return "aioquic"
