"""A daemon's state as the operator sees it: ``status`` (members, RTTs, routes,
counters, and the sections other parts add) and the route table. Read-only."""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable
from typing import Any, Protocol

from ciuic_p2p.config import Config
from ciuic_p2p.core.link.keys import peer_id_of
from ciuic_p2p.core.mesh.node import MeshNode
from ciuic_p2p.core.mesh.suspicion import NACKS_MISSING, PROBE_UNANSWERED, SUSPECTED
from ciuic_p2p.guard import Guard
from ciuic_p2p.transport.base import LinkStats, Transport


class StatusSource(Protocol):
    def status_sections(self) -> dict[str, Any]: ...


class MeshDaemon(Protocol):
    """What status reads of a daemon (daemon.node.MeshDaemon), named here so that the
    two modules do not import each other."""

    peer_id: str
    address: str
    started_at: float
    config: Config
    transport: Transport
    guard: Guard
    banned: set[str]
    counters: collections.Counter[str]
    mesh_bytes_sent: collections.Counter[str]
    mesh_messages_sent: collections.Counter[str]
    clock: Callable[[], float]

    @property
    def listener(self) -> StatusSource: ...

    @property
    def mesh(self) -> MeshNode: ...

    def backlog_bytes(self) -> int: ...


def route_table(d: MeshDaemon) -> list[dict[str, Any]]:
    """Each destination's current path (relayed when that beats the direct link),
    with the RTTs of the path and of the direct link as the map has them."""
    node = d.mesh
    rtt = node.rtt_s
    members = node.members()
    names = {p: m.name for p, m in members.items()}
    names[d.peer_id] = d.config.node.name
    table = []
    for dest, path in sorted(node.routes().items()):
        legs = [rtt(a, b) for a, b in itertools.pairwise(path)]
        direct = rtt(d.peer_id, dest)
        table.append(
            {
                "to": dest,
                "to_name": names.get(dest, ""),
                "path": list(path),
                "path_names": [names.get(p, "") for p in path],
                "path_rtt_ms": None if None in legs else round(sum(legs) * 1e3, 2),  # type: ignore[arg-type]
                "direct_rtt_ms": None if direct is None else round(direct * 1e3, 2),
            }
        )
    return table


def status(d: MeshDaemon) -> dict[str, Any]:
    node = d.mesh
    routes = node.routes()
    links = link_stats(d)
    members = []
    for name, m in sorted(node.members().items()):
        rtt = node.rtt_s(d.peer_id, name)
        link = links.get(name)
        members.append(
            {
                "peer": name,
                "name": m.name,
                "address": m.address,
                "region": m.region,
                "state": m.state.name.lower(),
                "incarnation": m.incarnation,
                "rtt_ms": None if rtt is None else round(rtt * 1000, 2),
                "rtt_source": node.rtt_source(d.peer_id, name),
                "route": list(routes.get(name, ())),
                "receive_rate_bps": _rounded(link.receive_rate_bps if link else None),
                "published_rate_bps": _rounded(node.rate_bps(name, d.peer_id)),
                "pace_bps": _rounded(link.pace_bps if link else None),
            }
        )
    return {
        "peer": d.peer_id,
        "name": d.config.node.name,
        "region": d.config.node.region,
        "address": d.address,
        "quic_backend": d.config.transport.quic_backend,
        "incarnation": node.incarnation,
        "joined": node.joined,
        "uptime_s": round(d.clock() - d.started_at, 1),
        "alive": len(node.view()),
        "health_score": node.health_score,
        "health_reasons": health_reasons(node.health_reasons),
        "members": members,
        "banned": sorted(d.banned),
        "counters": dict(d.counters),
        "credentials": dict(node.identities.counters),
        "udp_bytes_sent": d.transport.udp_bytes_sent,
        "lanes": d.transport.lanes_status(),
        "mesh_bytes_sent": dict(d.mesh_bytes_sent),
        "mesh_messages_sent": dict(d.mesh_messages_sent),
        "backlog_bytes": d.backlog_bytes(),
        "strategy": node.strategy(),
        "internal_errors": internal_errors(d),
        "strangers": strangers(d),
        **d.listener.status_sections(),
    }


HEALTH_REASONS = {
    PROBE_UNANSWERED: "{n} probe(s) of members unanswered, no helper to ask",
    NACKS_MISSING: "{n} helper(s) silent about probes that failed: this node's own "
    "links or CPU are the likely cause",
    SUSPECTED: "suspected by members {n} time(s) (refuted): they find this node slow",
}
"""What each cause of a raised health score (core.mesh.suspicion) says to an operator."""


def health_reasons(reasons: dict[str, int]) -> list[dict[str, Any]]:
    """Why the health score is above 0, largest share first: each cause, how much it
    added since the score was last 0, and a sentence for the page and ``status``."""
    out = []
    for reason, count in sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0])):
        text = HEALTH_REASONS.get(reason, reason + " ({n})").format(n=count)
        out.append({"reason": reason, "count": count, "text": text})
    return out


def _rounded(value: float | None) -> int | None:
    return None if value is None else round(value)


def link_stats(d: MeshDaemon) -> dict[str, LinkStats]:
    """Each live link's counters, by peer ID."""
    out: dict[str, LinkStats] = {}
    for key in d.transport.peers():
        stats = d.transport.link_stats(key)
        if stats is not None:
            out[peer_id_of(key)] = stats
    return out


def receive_rates(d: MeshDaemon) -> dict[str, float]:
    """The measured pace of each linked peer's bulk frames here, by peer ID (only the
    links that have carried a frame large enough to measure)."""
    return {
        peer: s.receive_rate_bps
        for peer, s in link_stats(d).items()
        if s.receive_rate_bps is not None
    }


def internal_errors(d: MeshDaemon) -> dict[str, int]:
    """Faults the guards caught (ciuic_p2p.guard), as ``component.where``: 0 is the
    only healthy value; anything else is a bug worth reporting."""
    out: dict[str, int] = {}
    for guard in (d.guard, d.transport.guard):
        for where, count in guard.counts.items():
            out[f"{guard.component}.{where}"] = count
    return out


def strangers(d: MeshDaemon) -> dict[str, Any]:
    """What sources that are not members cost this node (transport.gate)."""
    st = d.transport.strangers()
    return {
        "pending_connections": st.pending_connections,
        "connections_opened": st.connections_opened,
        "retries_sent": st.retries_sent,
        "refused": st.refused,
        "dropped": st.dropped,
    }
